"""What every benchmark prints about the machine it ran on (imported by the scripts beside it)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def trace_file(name: str, override: str | Path | None = None) -> Path:
    """A workload trace to replay: ``override`` (a benchmark's ``--trace``) if given, else ``name``
    in ``$RAYFLEET_TRACE_DIR`` (default: the repository's ``traces/``; sources in its README).

    Exits with a one-line message naming the file and the fix when it does not exist.
    """
    from rayfleet.platform.sim.workload import TRACE_DIR_ENV, default_trace_dir

    path = Path(override) if override is not None else default_trace_dir() / name
    if not path.is_file():
        raise SystemExit(f"trace {path} does not exist. Fix: pass --trace FILE, or set {TRACE_DIR_ENV} "
                         f"to a folder holding {name}")
    return path


# -- the catalogue the tests use: every script here has --quick, and its quick run is tested -----

def benchmark_scripts(root: Path | None = None) -> list[Path]:
    """Every benchmark script in ``benchmarks/`` (this helper module and ``_``-prefixed helper
    modules excluded)."""
    here = root or Path(__file__).resolve().parent
    return sorted(p for p in here.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))


def declared_options(script: Path) -> set[str]:
    """The ``--options`` a script declares with ``add_argument`` (read from its source, not run)."""
    import ast

    options = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return options


def starts_own_ray_cluster(script: Path) -> bool:
    """Whether a script starts a Ray cluster of its own (its quick run then belongs to the
    integration tier, which runs alone: two Ray clusters on one host confuse Ray Train)."""
    import re

    return bool(re.search(r"\bray\.init\(|\binit_local_ray\(|LocalFleet\.up\(|connect\(address=[\"']local",
                          script.read_text()))


def init_local_ray(**resources: float) -> None:
    """``ray.init(address="local", ...)`` with up to three tries: on a busy machine a raylet can
    miss Ray's fixed 30 s start-up window, and a second try usually makes it."""
    import ray

    from rayfleet.platform.ray_compat import shared_host_ray_env

    _os.environ.update(shared_host_ray_env())  # its log monitor scans every 2 s, its reporter every 30 s

    for attempt in range(3):
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, **resources)
            return
        except Exception as exc:  # noqa: BLE001 - retried, then re-raised
            print(f"ray.init failed ({exc}); retry {attempt + 1}/2", flush=True)
            ray.shutdown()
            if attempt == 2:
                raise


# -- the results ledger: every run of every benchmark, with its commit, machine, load and goals ------
#
# Layout (benchmarks/results/ is ignored by git but for ledger/):
#   benchmarks/results/ledger/<benchmark>.jsonl   full runs, one JSON line per run, appended; committed
#   benchmarks/results/quick/<benchmark>.jsonl    --quick runs (what the tests run); never committed
# $RAYFLEET_LEDGER_DIR replaces benchmarks/results/ as the root (the tests point it at a temp dir, so a
# test run writes nothing into the checkout). One line per run keeps history diffable and the repo
# small: a benchmark records its headline figures and tables, not its raw samples (those stay in its
# --json file). The newest full entry holding a table is what the docs show (scripts/render_docs.py).

import os as _os
import time as _time
from typing import NamedTuple as _NamedTuple

LEDGER_DIR_ENV = "RAYFLEET_LEDGER_DIR"
# Taken when a benchmark imports this module, i.e. before it measures anything.
_LOAD_BEFORE = _os.getloadavg() if hasattr(_os, "getloadavg") else None
_STARTED_AT = _time.time()

_COMPARATORS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t, ">": lambda v, t: v > t,
                "<": lambda v, t: v < t}


# NamedTuples, not dataclasses: the tests load this file by path (no entry in sys.modules), where a
# dataclass with postponed annotations cannot be built.
class Goal(_NamedTuple):
    """A goal a benchmark states, judged in code on the unrounded ``value``.

    ``printed_halfwidth`` is only for figures imported from a printed table (rounded): the true
    value lies within ``value ± printed_halfwidth``, and where that interval straddles the
    threshold the goal is undecidable (``met`` is None) rather than judged on the rounded figure.
    """

    name: str
    comparator: str  # ">=", "<=", ">" or "<"
    threshold: float
    value: float | None
    printed_halfwidth: float = 0.0

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        check = _COMPARATORS[self.comparator]  # a KeyError names a comparator that is not one of these
        low, high = self.value - self.printed_halfwidth, self.value + self.printed_halfwidth
        at_low, at_high = check(low, self.threshold), check(high, self.threshold)
        return at_low if at_low == at_high else None

    def as_dict(self) -> dict:
        out = {"name": self.name, "comparator": self.comparator, "threshold": self.threshold,
               "value": self.value, "met": self.met}
        if self.printed_halfwidth:
            out["printed_halfwidth"] = self.printed_halfwidth
        return out


class Table(_NamedTuple):
    """A table as the benchmark formats it (cells are display strings; the unrounded numbers are in
    the entry's ``figures``). ``scripts/render_docs.py`` writes it into the docs as markdown."""

    columns: list[str]
    rows: list[list[str]]
    note: str = ""

    def as_dict(self) -> dict:
        return {"columns": list(self.columns), "rows": [[str(c) for c in r] for r in self.rows], "note": self.note}


class LedgerPaths(_NamedTuple):
    full: Path
    quick: Path


def ledger_paths(name: str) -> LedgerPaths:
    root = Path(_os.environ.get(LEDGER_DIR_ENV) or Path(__file__).resolve().parent / "results")
    return LedgerPaths(full=root / "ledger" / f"{name}.jsonl", quick=root / "quick" / f"{name}.jsonl")


def git_state(repo: Path | None = None) -> dict:
    """The commit this run measured and whether the tree had uncommitted changes to tracked files."""
    import subprocess

    cwd = repo or Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": bool(dirty) if commit else None}


def accelerator() -> str | None:
    """The GPUs ``nvidia-smi`` lists (name, memory), or None: the benchmarks here run on CPU."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return "; ".join(line.strip() for line in out.splitlines() if line.strip()) or None


def machine_state() -> dict:
    """Cores, CPU model, memory, accelerator and the load average when the benchmark started
    (imported this module) and now."""
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    load_after = _os.getloadavg() if hasattr(_os, "getloadavg") else None
    return {"cores": _os.cpu_count(), "cpu": cpu_name(), "memory_gib": mem_gib, "accelerator": accelerator(),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_before": list(_LOAD_BEFORE) if _LOAD_BEFORE else None,
            "load_avg_after": list(load_after) if load_after else None}


def record_run(*, name: str, quick: bool, params: dict, figures: dict, goals: list[Goal] = (),
               tables: dict[str, Table] | None = None, argv: list[str] | None = None) -> Path:
    """Append this run to the ledger (full runs: ``results/ledger/<name>.jsonl``; quick runs:
    ``results/quick/<name>.jsonl``, ignored by git) and print each goal's verdict. Call it once, at
    the end of a benchmark. Returns the file written."""
    import json
    import sys
    from datetime import datetime, timezone

    entry = {"benchmark": name, "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "mode": "quick" if quick else "full", "provenance": "measured",
             "wall_s": round(_time.time() - _STARTED_AT, 1),
             "git": git_state(), "machine": machine_state(),
             "params": {"argv": list(sys.argv[1:] if argv is None else argv), **params},
             "figures": _compact(figures), "goals": [g.as_dict() for g in goals],
             "tables": {k: t.as_dict() for k, t in (tables or {}).items()}}
    paths = ledger_paths(name)
    path = paths.quick if quick else paths.full
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(entry, default=str, sort_keys=False)
    if len(line) > 64_000:  # a ledger line holds headline figures, not samples
        print(f"warning: ledger entry for {name} is {len(line):,} bytes; keep raw samples in --json", flush=True)
    with path.open("a") as f:
        f.write(line + "\n")
    for g in goals:
        verdict = {True: "met", False: "NOT MET", None: "undecidable"}[g.met]
        value = "n/a" if g.value is None else f"{g.value:.6g}"
        print(f"goal {g.name}: {value} {g.comparator} {g.threshold:g}: {verdict}")
    print(f"ledger: {path}")
    return path


def _compact(value, *, max_items: int = 64):
    """``value`` with every list longer than ``max_items`` replaced by its length: raw samples belong
    in the benchmark's --json file, not in the ledger."""
    if isinstance(value, dict):
        return {str(k): _compact(v, max_items=max_items) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > max_items:
            return {"omitted_list_of": len(value)}
        return [_compact(v, max_items=max_items) for v in value]
    return value


def read_ledger(path: Path) -> list[dict]:
    """Every entry of one ledger file, oldest first."""
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank; NaN when empty)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns under a header and a rule (what the benchmarks print)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])
