"""Render every figure table in README.md and docs/*.md from the results ledger.

    python scripts/render_docs.py            # rewrite the tables in place
    python scripts/render_docs.py --check    # exit 1, naming each table that differs from its ledger entry

A generated table sits between markers naming its source::

    <!-- ledger: serving.router_replay -->
    ... (generated: do not edit by hand; re-run this script) ...
    <!-- /ledger -->

``<benchmark>.<table>`` is the table ``<table>`` of the newest *full* run in
``benchmarks/results/ledger/<benchmark>.jsonl`` that has one (quick runs never reach the docs);
``<benchmark>.goals`` lists that benchmark's newest full run's goals, judged in code when the run
was recorded (``benchmarks/common.py: Goal``). Under each table a line says which run it is:
when, the commit (and whether the tree was dirty), the machine, its load, and the provenance
(measured, or imported from an earlier README and not re-measured).

Design decisions: the tables' cells are the strings the benchmark formatted (the ledger also keeps
the unrounded figures), so rendering never rounds or recomputes; the check is a plain re-render and
string comparison, so any hand edit between the markers fails it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEDGER = REPO / "benchmarks" / "results" / "ledger"
BLOCK = re.compile(r"(<!-- ledger: (?P<source>[\w.\-]+) -->\n)(?P<body>.*?)(<!-- /ledger -->)", re.S)


def doc_paths(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def _entries(benchmark: str, ledger: Path) -> list[dict]:
    path = ledger / f"{benchmark}.jsonl"
    if not path.exists():
        raise LookupError(f"no ledger {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def newest(benchmark: str, table: str, ledger: Path = LEDGER) -> dict:
    """The newest full entry of ``benchmark`` holding ``table`` (or, for ``goals``, any goal)."""
    for entry in reversed(_entries(benchmark, ledger)):
        if entry.get("mode") != "full":
            continue
        if (table == "goals" and entry.get("goals")) or table in entry.get("tables", {}):
            return entry
    raise LookupError(f"no full run of {benchmark} in the ledger has a table {table!r}")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance_line(entry: dict, benchmark: str) -> str:
    git, machine = entry.get("git") or {}, entry.get("machine") or {}
    commit = (git.get("commit") or "unknown")[:10]
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    where = f"`benchmarks/results/ledger/{benchmark}.jsonl`, {entry['mode']} run recorded {entry['recorded_at']}"
    if entry.get("provenance", "measured") != "measured":
        return f"<sub>Source: {where}; {entry['provenance']}.</sub>"
    parts = [f"commit {commit}{dirty}"]
    if machine.get("cores"):
        accel = machine.get("accelerator") or "no accelerator"
        parts.append(f"{machine['cores']} cores ({machine.get('cpu', '?')}), {accel}")
    before, after = machine.get("load_avg_before"), machine.get("load_avg_after")
    if before and after:
        parts.append(f"1-min load {before[0]:.1f} before, {after[0]:.1f} after")
    args = shlex.join(entry.get("params", {}).get("argv", []))
    parts.append(f"`python benchmarks/{benchmark}.py{' ' + args if args else ''}`")
    return f"<sub>Source: {where}; " + "; ".join(parts) + ".</sub>"


def _value(v) -> str:
    return "n/a" if v is None else f"{v:.6g}"


def render(source: str, ledger: Path = LEDGER) -> str:
    """The generated body for ``<!-- ledger: source -->``."""
    benchmark, _, table = source.partition(".")
    entry = newest(benchmark, table, ledger)
    if table == "goals":
        verdict = {True: "met", False: "**not met**", None: "undecidable (printed figure only)"}
        body = markdown_table(["goal", "target", "value", "met"],
                              [[g["name"], f"{g['comparator']} {g['threshold']:g}", _value(g["value"]), verdict[g["met"]]]
                               for g in entry["goals"]])
        note = ""
    else:
        t = entry["tables"][table]
        body, note = markdown_table(t["columns"], t["rows"]), t.get("note", "")
    return body + "\n\n" + (f"{note}. " if note else "") + provenance_line(entry, benchmark) + "\n"


def render_text(text: str, ledger: Path = LEDGER, missing: list[str] | None = None) -> str:
    """``text`` with every ledger block rendered; a block whose source is not in the ledger is left
    as it is and named in ``missing``."""
    def one(m: re.Match) -> str:
        try:
            return m.group(1) + render(m.group("source"), ledger) + m.group(4)
        except LookupError as exc:
            if missing is not None:
                missing.append(f"{m.group('source')}: {exc}")
            return m.group(0)

    return BLOCK.sub(one, text)


def check(paths: list[Path], ledger: Path = LEDGER) -> list[str]:
    """One line per generated table that differs from (or lacks) its ledger entry."""
    problems = []
    for path in paths:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            try:
                want = render(m.group("source"), ledger)
            except LookupError as exc:
                problems.append(f"{path.name}: ledger: {m.group('source')}: {exc}")
                continue
            if m.group("body") != want:
                problems.append(f"{path.name}: the table for ledger: {m.group('source')} differs from the ledger "
                                f"(edited by hand, or the ledger has a newer run). Fix: python scripts/render_docs.py")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 on a difference")
    args = parser.parse_args(argv)
    paths = doc_paths()
    if args.check:
        problems = check(paths)
        print("\n".join(problems) or f"every ledger table in {len(paths)} files matches the ledger")
        return 1 if problems else 0
    missing: list[str] = []
    for path in paths:
        text = path.read_text()
        new = render_text(text, missing=missing)
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(REPO)}")
    for line in missing:
        print(f"not rendered: {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
