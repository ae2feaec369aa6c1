"""Run the test suite tier by tier (what ``make test`` runs) and print each tier's time at the end.

Why a script and not three Makefile lines: the suite's budget (under 40 minutes from a fresh
clone on 2 cores) is only kept if every run shows where its time went. Each pytest session is
timed on the wall clock, and inside a session the time of each test directory is summed from
pytest's JUnit report (setup + call + teardown, so a session fixture's start is charged to the
first test that needs it). The slowest tests are listed too.

Sessions, in this order (why they are separate: see the Makefile):

1. ``tests/unit`` and ``tests/vllm/test_offline.py`` (vLLM's offline engine, started once; no Ray; in
   pytest-xdist workers, one per core: ``UNIT_WORKERS``);
2. ``tests/cluster tests/gpu`` (the cluster tier's fleet is session-scoped);
3. the rest of ``tests/vllm`` (a small fleet of its own, after the first one is gone);
4. ``tests/integration`` but ``test_ray_up.py`` (each test owns a Ray cluster), two tests at a
   time (``INTEGRATION_WORKERS``);
5. ``tests/integration/test_ray_up.py`` alone (``ray up`` takes the head's fixed ports and starts
   nodes on non-loopback addresses whose servers listen on every interface).

``BESIDE`` can start a session together with another (its output is then kept in a file and
printed when it ends). It is empty: measured on this 2-core machine (2026-11-27), the Ray-free
session and the vLLM session beside the cluster session drove the load average to 40 with 45% of
the CPU in the kernel (vLLM's workers and the gloo ranks spinning against each other), and after
11 minutes the unit session had run 5% of its tests, so the three together were slower than one
after another, and the live tests' deadlines were at risk. Tried again (2026-11-27, the unit session
in 2 xdist workers beside the integration session, nothing else running): both ended after 20.2 min,
the integration session's alone time was 15.4 min and the unit session's 5-8, so nothing was won
(load 28; the quality benchmark's quick run took 340 s instead of 195). A third try (2026-11-28): the unit
session at the idle CPU priority (``SCHED_IDLE``, so it only gets a core the live session leaves;
its tests with wall-clock deadlines in a short foreground session first) beside the cluster
session. The cluster session took 30.3 min instead of 24.1 and the unit session ended after 31.5,
so the pair took 31.5 min against 32.2 one after another: nothing won. The scheduler policy does
not keep the two apart on this VM (caches, memory bandwidth, and perhaps host cores shared by its
two vCPUs are outside it). A fourth (2026-11-29): ``tests/cluster`` and ``tests/vllm`` in one session,
two pytest-xdist work units at a time (``loadgroup``; a cluster module or the whole vLLM tier per
unit, each worker on fleets of its own): 26.4 min against 27.7 one after another, 47.7 CPU min
against 43.3 (a second 4-node fleet), and two vLLM pool tests failed on their counters' deadlines;
not kept. Two fleets on one host do work
(``RAY_ADDRESS`` names each fleet to its processes; the auth token is created atomically).

Every session runs even if an earlier one failed (a red tier should not hide the others' times);
the exit status is the first non-zero one. The last line is the plain summary
``suite: N passed, N failed, N skipped``. Times are also written as JSON to
``$RAYFLEET_TEST_TIMES`` (default ``.pytest-times.json``, ignored by git).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from cpu_meter import CpuMeter  # noqa: E402 - scripts/cpu_meter.py, beside this script

OFFLINE_VLLM = ("tests/vllm/test_offline.py",)
"""vLLM's offline engine in subprocesses, no Ray: they run in the Ray-free session (module doc)."""

UNIT_WORKERS = ("-n", str(min(4, os.cpu_count() or 1)), "--dist", "loadfile")
"""The Ray-free session runs in pytest-xdist workers, one per core (at most 4), a file per worker:
alone it kept about half of this 2-core machine busy (busy 0.55). Live sessions do not: their
fleets and engines are session fixtures and their tests share them in order."""

INTEGRATION_WORKERS = ("-n", str(max(1, min(2, os.cpu_count() or 1))), "--dist", "worksteal")
"""The integration session runs two of its tests at a time. Unlike the sessions side by side
(module doc), it pays: each of its tests owns its cluster and spends much of its time in job and
engine starts that keep one core busy (busy 0.66 alone), so a second test fills the other core.
Measured on this 2-core machine (2026-11-29, nothing else running): 12.4 min against 14.9 (the
fresh-clone run at 6a11334) one at a time. Each test's fleet uses ports the OS chose and the leak
check is per xdist worker (its marker). The longest tests are collected first
(``tests/integration/conftest.py``) so that no long one starts last. ``test_ray_up.py`` runs
after it, alone: in one fresh-clone run beside another test its worker nodes had not joined after
120 s (alone they join in 14 s; not explained: more than CPU contention, perhaps its nodes'
servers, which listen on every interface, meeting the other test's ports)."""

RAY_UP_TEST = "tests/integration/test_ray_up.py"

SESSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("unit", ("tests/unit", *OFFLINE_VLLM, *UNIT_WORKERS)),
    ("cluster+gpu", ("tests/cluster", "tests/gpu")),
    ("vllm", ("tests/vllm", *(f"--ignore={path}" for path in OFFLINE_VLLM))),
    ("integration", ("tests/integration", f"--ignore={RAY_UP_TEST}", *INTEGRATION_WORKERS)),
    ("ray up", (RAY_UP_TEST,)),
)
BESIDE: dict[str, str] = {}
"""Session -> the session it runs beside (started together; the next one waits for all of them).
Empty: side by side was slower on 2 cores (module doc)."""
# The CPU per process kind: how many kinds each session keeps (in .pytest-times.json) and prints.
KINDS_KEPT, KINDS_SHOWN = 25, 8


@dataclass
class TestTime:
    name: str
    seconds: float


@dataclass
class SessionResult:
    name: str
    paths: tuple[str, ...]
    exit_code: int
    wall_s: float
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    dir_to_seconds: dict[str, float] = field(default_factory=dict)
    slowest: list[TestTime] = field(default_factory=list)
    cpu_s: float | None = None  # CPU seconds of the session and all it started (cpu_meter.py)
    cpu_by_kind: dict[str, float] = field(default_factory=dict)  # those seconds per process kind, largest first

    @property
    def busy(self) -> float | None:
        """CPU seconds over wall seconds times cores: 1.0 = the machine saturated by this session."""
        return None if self.cpu_s is None or self.wall_s <= 0 else self.cpu_s / (self.wall_s * (os.cpu_count() or 1))


def _tier_of(classname: str, file_attr: str | None) -> str:
    """``tests/cluster/...`` -> ``cluster``: the directory under ``tests/`` a test case lives in."""
    path = (file_attr or classname.replace(".", "/")).replace("\\", "/")
    parts = path.split("/")
    if "tests" in parts and parts.index("tests") + 1 < len(parts):
        return parts[parts.index("tests") + 1]
    return parts[0] if parts else "?"


def read_junit(path: Path, result: SessionResult, *, top: int) -> None:
    """Fill counts, per-directory seconds and the slowest tests from a pytest JUnit report."""
    if not path.exists():  # pytest died before writing it (e.g. a collection crash)
        return
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds = float(case.get("time") or 0.0)
        tier = _tier_of(case.get("classname", ""), case.get("file"))
        result.dir_to_seconds[tier] = result.dir_to_seconds.get(tier, 0.0) + seconds
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            result.failed += 1
        elif "skipped" in outcome:
            result.skipped += 1
        else:
            result.passed += 1
        cases.append(TestTime(name=f"{case.get('classname', '')}::{case.get('name', '')}", seconds=seconds))
    result.slowest = sorted(cases, key=lambda t: -t.seconds)[:top]


def _argv(paths: tuple[str, ...], junit: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *paths, "-q", f"--junitxml={junit}", "-o", "junit_family=xunit1", *extra]


def host_state() -> str:
    """Memory available, what tmpfs holds (it is memory too) and the load: a session that fails
    on a host starved by something left behind (e.g. snapshots in /dev/shm) says so."""
    parts = []
    with contextlib.suppress(OSError, KeyError, ValueError):  # no /proc (not Linux): left out
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        parts.append(f"MemAvailable {int(meminfo['MemAvailable'].split()[0]) / 2**20:.1f} GiB")
    with contextlib.suppress(OSError):  # no /dev/shm: left out
        shm = os.statvfs("/dev/shm")
        parts.append(f"/dev/shm holds {(shm.f_blocks - shm.f_bfree) * shm.f_frsize / 2**30:.2f} GiB")
    parts.append(f"load {os.getloadavg()[0]:.1f}")
    return ", ".join(parts)


def run_session(name: str, paths: tuple[str, ...], *, extra: list[str], top: int) -> SessionResult:
    with tempfile.TemporaryDirectory(prefix="rayfleet-junit-") as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = _argv(paths, junit, extra)
        print(f"\n== {name}: {' '.join(argv[1:])}\n   host before: {host_state()}", flush=True)
        meter = CpuMeter().start()
        start = time.monotonic()
        code = subprocess.call(argv, cwd=REPO, env=meter.environ())
        result = SessionResult(name=name, paths=paths, exit_code=code, wall_s=time.monotonic() - start,
                               cpu_s=meter.stop(), cpu_by_kind=dict(meter.by_kind().most_common(KINDS_KEPT)))
        print(f"   host after {name}: {host_state()}", flush=True)
        read_junit(junit, result, top=top)
    return result


class BackgroundSession:
    """A pytest session started now and collected later (``finish``), its output in a file.

    ``-p no:cacheprovider``: the foreground session writes ``.pytest_cache`` at its end too."""


    def __init__(self, name: str, paths: tuple[str, ...], *, extra: list[str]) -> None:
        self.name, self.paths = name, paths
        self._tmp = tempfile.TemporaryDirectory(prefix="rayfleet-junit-")
        self.junit = Path(self._tmp.name) / "junit.xml"
        self.log = Path(self._tmp.name) / "output.txt"
        argv = _argv(paths, self.junit, [*extra, "-p", "no:cacheprovider"])
        print(f"\n== {name} (beside the next session; output when it ends): {' '.join(argv[1:])}", flush=True)
        self.meter = CpuMeter().start()
        self.start = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=self.meter.environ())

    def finish(self, *, top: int) -> SessionResult:
        code = self.proc.wait()
        result = SessionResult(name=self.name, paths=self.paths, exit_code=code, wall_s=time.monotonic() - self.start,
                               cpu_s=self.meter.stop(), cpu_by_kind=dict(self.meter.by_kind().most_common(KINDS_KEPT)))
        print(f"\n== {self.name} (ran beside another session), its output:", flush=True)
        sys.stdout.write(self.log.read_text(errors="replace"))
        sys.stdout.flush()
        read_junit(self.junit, result, top=top)
        self._tmp.cleanup()
        return result


def run_sessions(sessions, *, extra: list[str], top: int) -> list[SessionResult]:
    """Run ``sessions`` in order; a session in ``BESIDE`` starts together with its partner, which
    waits for it before the next session starts (module doc). Alone (its partner not selected)
    it runs in the foreground."""
    names = [name for name, _ in sessions]
    results: dict[str, SessionResult] = {}
    for name, paths in sessions:
        if BESIDE.get(name) in names:
            continue  # started with its partner
        backgrounds = [BackgroundSession(other, other_paths, extra=extra)
                       for other, other_paths in sessions if BESIDE.get(other) == name]
        results[name] = run_session(name, paths, extra=extra, top=top)
        for background in backgrounds:
            results[background.name] = background.finish(top=top)
    return [results[name] for name in names]


def render(results: list[SessionResult], *, install_s: float | None, elapsed_s: float | None = None) -> str:
    lines = ["", "== suite timings (wall clock, this run; CPU = minutes of CPU used by the session and all it "
             f"started, busy = CPU / (wall x {os.cpu_count()} cores))",
             f"{'session':<20} {'tier':<12} {'minutes':>8} {'CPU':>6} {'busy':>5}  result"]
    if install_s is not None:
        lines.append(f"{'install':<20} {'':<12} {install_s / 60:>8.1f}")
    for r in results:
        verdict = "ok" if r.exit_code == 0 else f"exit {r.exit_code}"
        cpu = f"{r.cpu_s / 60:>6.1f} {r.busy:>5.2f}" if r.cpu_s is not None else f"{'':>6} {'':>5}"
        lines.append(f"{r.name:<20} {'(session)':<12} {r.wall_s / 60:>8.1f} {cpu}  {verdict}: "
                     f"{r.passed} passed, {r.failed} failed, {r.skipped} skipped")
        for tier, seconds in sorted(r.dir_to_seconds.items()):
            lines.append(f"{'':<20} {tier:<12} {seconds / 60:>8.1f}")
    if elapsed_s is None:
        elapsed_s = sum(r.wall_s for r in results)
    total = elapsed_s + (install_s or 0.0)
    ran = {r.name for r in results}
    beside = ", ".join(f"{a} beside {b}" for a, b in BESIDE.items() if a in ran and b in ran)
    lines.append(f"{'total':<20} {'':<12} {total / 60:>8.1f}"
                 + (f"  (wall clock; {beside}, so the sessions' minutes overlap)" if beside else ""))
    kinds = [r for r in results if r.cpu_by_kind]
    if kinds:
        lines.append(f"where the CPU went (CPU minutes per process kind, the {KINDS_SHOWN} largest per session):")
        for r in kinds:
            top_kinds = list(r.cpu_by_kind.items())[:KINDS_SHOWN]
            lines.append(f"  {r.name:<18} " + ", ".join(f"{kind} {seconds / 60:.1f}" for kind, seconds in top_kinds))
    lines.append("slowest tests:")
    slowest = sorted((t for r in results for t in r.slowest), key=lambda t: -t.seconds)[:15]
    lines += [f"  {t.seconds:7.1f}s  {t.name}" for t in slowest]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=[s[0] for s in SESSIONS],
                        help="run only this session (repeatable)")
    parser.add_argument("--install-seconds", type=float, default=None,
                        help="the install step's time, to show it in the table (the Makefile passes it)")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest session (after --)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results = run_sessions([(name, paths) for name, paths in SESSIONS if not args.only or name in args.only],
                           extra=args.pytest_args, top=args.top)
    elapsed = time.monotonic() - started
    print(render(results, install_s=args.install_seconds, elapsed_s=elapsed))
    out = Path(os.environ.get("RAYFLEET_TEST_TIMES", REPO / ".pytest-times.json"))
    out.write_text(json.dumps({"install_s": args.install_seconds, "elapsed_s": elapsed,
                               "sessions": [asdict(r) for r in results]}, indent=1))
    passed, failed, skipped = (sum(getattr(r, k) for r in results) for k in ("passed", "failed", "skipped"))
    print(f"suite: {passed} passed, {failed} failed, {skipped} skipped")
    return next((r.exit_code for r in results if r.exit_code != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
