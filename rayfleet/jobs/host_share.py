"""A training worker's cap on its host's CPU (``resources.host_cpu_share``).

Why: on a host that training shares with latency-sensitive work (a local fleet on one machine,
CPU nodes that also run serving replicas or engines), a best-effort job that trains flat out takes
the cores the other work needs the moment it needs them: an engine starting on a lent
accelerator, a replica answering. A Kubernetes pod gets a CPU limit (a CFS quota on its cgroup);
a Ray 2.60 actor has no per-actor quota, so the train loop keeps the limit itself.

How: after each step a rank idles until the CPU time its process used since it last idled is at
most ``share`` of the wall time that passed, ``cpu_s / share - wall_s`` seconds (never more than
``MAX_IDLE_S`` at once). Ranks idle after the step's all-gather, so a rank's idle never stretches
another rank's measured step time, and the health monitor's slow-rank verdicts (compute time)
and hang timeout (whole steps) are unchanged. Counted: the whole process (the loop, gloo's and
the metrics stream's threads), so the share holds for what the host sees. ``share`` 1.0 caps
nothing a single-threaded worker could exceed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rayfleet.jobs.train_state import TrainHooks

__all__ = ["MAX_IDLE_S", "HostShareHook", "idle_for"]

MAX_IDLE_S = 30.0
"""The longest single idle: a stop request (polled once a step) is never kept waiting longer."""


def idle_for(cpu_s: float, wall_s: float, share: float) -> float:
    """Seconds to idle so that ``cpu_s`` is at most ``share`` of the wall time (0 when it already is)."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share={share!r}: must lie in (0, 1]")
    return min(MAX_IDLE_S, max(0.0, cpu_s / share - wall_s))


class HostShareHook(TrainHooks):
    """Idles after each step to keep this process's CPU at most ``share`` of its wall time."""

    def __init__(self, share: float, *, cpu_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        idle_for(0.0, 0.0, share)  # validates share
        self.share = share
        self._cpu_clock, self._wall_clock, self._sleep = cpu_clock, wall_clock, sleep
        self._cpu0 = self._wall0 = None
        self.idled_s = 0.0

    def on_start(self, **kwargs: Any) -> None:
        self._cpu0, self._wall0 = self._cpu_clock(), self._wall_clock()

    def after_step(self, step: int, **kwargs: Any) -> None:
        if self._cpu0 is None:
            self.on_start()
            return
        idle = idle_for(self._cpu_clock() - self._cpu0, self._wall_clock() - self._wall0, self.share)
        if idle > 0:
            self._sleep(idle)
            self.idled_s += idle
        self._cpu0, self._wall0 = self._cpu_clock(), self._wall_clock()
