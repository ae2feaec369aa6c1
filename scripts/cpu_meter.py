"""CPU seconds used by one test session and everything it started (what ``test_tiers.py`` prints).

Why: a session's wall time alone does not say whether it waits or computes. On a 2-core machine
the suite's budget is only cut by doing less work, or by overlapping a session that waits with
one that computes; this meter tells the two apart. ``busy`` is the session's CPU seconds over
its wall seconds times the machine's cores: near 1.0 the session saturates the machine (nothing
to gain by running anything beside it), far below it the session mostly waits.

How: the session's command gets ``RAYFLEET_TEST_SESSION=<tag>`` in its environment, and every
process it starts inherits it (subprocesses, ``ray start``'s daemons, Ray's workers and job
drivers, vLLM's engine processes). A thread samples all processes once a second and, for those
that carry the tag, keeps the last user + system CPU time seen per (pid, start time). The tag is
read from ``/proc/<pid>/environ`` once per process. Processes other people run on the machine
are not counted, so the figure holds on a busy host. A process's CPU after the last sample before
it exits (under a second) is missed, so the figure is a lower bound, lowest for sessions of many
short processes (the unit session: 0.55 busy measured while the load average stayed near 2).

Where it goes: each process is also given a kind from its command line (``process_kind``: a Ray
actor's class, a Ray daemon, a job driver, a vLLM engine, pytest), kept from the last sample that
showed one (a Ray worker is ``ray::IDLE`` until it takes an actor, and a process that has exited
but is not yet reaped shows no command line). ``by_kind`` sums the CPU per kind, so a session's
table says which starts its minutes went to.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections import Counter

import psutil

__all__ = ["TAG_VAR", "CpuMeter", "process_kind"]

TAG_VAR = "RAYFLEET_TEST_SESSION"


class CpuMeter:
    """Samples the CPU time of the processes that carry ``TAG_VAR=<tag>`` until ``stop``."""

    def __init__(self, *, interval_s: float = 1.0) -> None:
        self.tag = f"tiers-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.interval_s = interval_s
        self._tagged: dict[tuple[int, float], bool] = {}
        self._cpu: dict[tuple[int, float], float] = {}
        self._kind: dict[tuple[int, float], str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the tag set, for the session's command."""
        return {**(os.environ if base is None else base), TAG_VAR: self.tag}

    def start(self) -> CpuMeter:
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop sampling (after one last sample); the CPU seconds counted."""
        self._done.set()
        self._thread.join()
        return self.cpu_seconds

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())

    def by_kind(self) -> Counter[str]:
        """CPU seconds per process kind (``process_kind``), largest first with ``most_common``."""
        out: Counter[str] = Counter()
        for key, seconds in self._cpu.items():
            out[self._kind.get(key) or "other"] += seconds
        return out

    def sample(self) -> None:
        for proc in psutil.process_iter(["create_time", "cpu_times"]):
            key = (proc.pid, proc.info["create_time"] or 0.0)
            tagged = self._tagged.get(key)
            if tagged is None:
                try:
                    tagged = proc.environ().get(TAG_VAR) == self.tag
                except (psutil.Error, OSError):
                    tagged = False
                self._tagged[key] = tagged
            times = proc.info["cpu_times"]
            if tagged and times is not None:
                self._cpu[key] = times.user + times.system
                try:  # re-read each time: Ray workers and vLLM's engines rename themselves after they start
                    kind = process_kind(proc.cmdline())
                except (psutil.Error, OSError):
                    kind = None
                if kind and (kind not in _UNSETTLED or key not in self._kind):
                    self._kind[key] = kind

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.sample()
        self.sample()


_IDLE_WORKER = "ray worker (idle)"
_FORKED = "multiprocessing child"
_UNSETTLED = (_IDLE_WORKER, _FORKED)  # kinds a process shows before it says what it runs
# Ray's daemons: the program (C++) or the script (Python) among the first arguments. Later
# arguments do not count: every Ray worker is passed the raylet's socket path.
_RAY_PROGRAMS = ("raylet", "gcs_server")
_RAY_SCRIPTS = {"dashboard/agent.py": "dashboard agent", "dashboard/dashboard.py": "dashboard",
                "runtime_env/agent/main.py": "runtime env agent", "log_monitor.py": "log_monitor",
                "_private/monitor.py": "monitor", "ray.util.client.server": "client server"}


def process_kind(cmdline: list[str]) -> str | None:
    """What a process is, from its command line: ``ray::<ActorClass>`` for a Ray worker (method
    and ids dropped), ``ray daemon: <name>``, ``python -m <module>``, ``vLLM engine``, ``pytest``
    or the program's name. None when the command line is empty (an exited, unreaped process)."""
    if not cmdline or not cmdline[0]:
        return None
    line = " ".join(cmdline)
    if line.startswith("ray::"):
        name = re.split(r"[ .:]", line[len("ray::"):], maxsplit=1)[0]
        return _IDLE_WORKER if name == "IDLE" else f"ray::{name}"
    if line.upper().startswith("VLLM") or "EngineCore" in line:
        return "vLLM engine"
    program = os.path.basename(cmdline[0])
    if program in _RAY_PROGRAMS:
        return f"ray daemon: {program}"
    head = " ".join(cmdline[1:4])
    if "default_worker.py" in head:
        return _IDLE_WORKER  # a Ray worker before it names itself
    for script, name in _RAY_SCRIPTS.items():
        if script in head:
            return f"ray daemon: {name}"
    if "multiprocessing.forkserver" in line or "multiprocessing.spawn" in line or "multiprocessing.resource_tracker" in line:
        return _FORKED  # fork-server ranks, vLLM's engine before it renames itself
    if "exec(eval(sys.stdin.readline()))" in line:
        return "pytest-xdist worker"
    if "-m" in cmdline[1:-1]:
        module = cmdline[cmdline.index("-m", 1) + 1]
        return "pytest" if module == "pytest" else f"python -m {module}"
    if program.startswith("python") and len(cmdline) > 1:
        return f"python {os.path.basename(cmdline[1])}"
    return program
