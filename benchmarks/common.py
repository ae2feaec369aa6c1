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

    for attempt in range(3):
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, **resources)
            return
        except Exception as exc:  # noqa: BLE001 - retried, then re-raised
            print(f"ray.init failed ({exc}); retry {attempt + 1}/2", flush=True)
            ray.shutdown()
            if attempt == 2:
                raise
