"""The repository stands on its own: no code, test, benchmark or document reads or links a path
outside it (a fresh clone with nothing beside it must test and benchmark the same)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("rayfleet", "tests", "benchmarks", "examples", "docs", "scripts", "traces")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "cluster.yaml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".ipynb", ".cfg", ".txt", ".sh", ""}

# The team's notes and the original trace folder live beside the repository, not in it.
OUTSIDE_TEXT = re.compile(r"(\.\./)+shared\b|\bshared/(traces|notes|DESIGN\.md|CONVENTIONS\.md)|/work/")
PATH_JOIN_SHARED = re.compile(r"/\s*[\"']shared[\"']")  # Path(...) / "shared"
PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _files() -> list[Path]:
    found = [REPO / name for name in TOP_FILES if (REPO / name).exists()]
    for top in SCANNED:
        found += [p for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in SUFFIXES
                  and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts]
    return sorted(p for p in found if p != Path(__file__).resolve())  # its own examples are bad on purpose


def outside_references(path: Path, text: str) -> list[str]:
    """Lines of ``text`` (the file at ``path``) that name a place outside the repository."""
    rel = path.relative_to(REPO)
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{rel}:{number}"
        if OUTSIDE_TEXT.search(line) or (path.suffix == ".py" and PATH_JOIN_SHARED.search(line)):
            out.append(f"{where}: {line.strip()}")
        for match in PARENTS.finditer(line):
            if int(match.group(1)) >= len(rel.parts):  # parents[len(parts) - 1] is the repository root
                out.append(f"{where}: climbs above the repository: {match.group(0)}")
        if path.suffix == ".md":
            for target in MD_LINK.findall(line):
                if "://" in target or target.startswith(("#", "mailto:")):
                    continue
                resolved = (path.parent / target.split("#")[0]).resolve()
                if not resolved.is_relative_to(REPO) or not resolved.exists():
                    out.append(f"{where}: link to {target} (outside the repository or missing)")
    return out


def test_nothing_reads_or_links_outside_the_repository():
    offenders = []
    for path in _files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offenders += outside_references(path, text)
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_the_check_catches_each_kind_of_outside_reference():
    here = REPO / "benchmarks" / "x.py"
    assert outside_references(here, 'TRACE = ROOT.parent / "shared" / "traces"')
    assert outside_references(here, "# from ../shared/traces/azure2023_conv.csv")
    assert outside_references(here, "p = Path(__file__).resolve().parents[2] / 'x'")
    assert not outside_references(here, "p = Path(__file__).resolve().parents[1] / 'traces'")
    doc = REPO / "docs" / "x.md"
    assert outside_references(doc, "see [design](../../shared/DESIGN.md)")
    assert outside_references(doc, "see [gone](missing-file.md)")
    assert not outside_references(doc, "see [queues](queues.md) and [Ray](https://docs.ray.io)")
