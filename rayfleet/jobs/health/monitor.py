"""Live health checks of a running job: slow ranks from compute time, hung collectives from heartbeats.

The policies (``health.policy``) are pure; this module feeds them from a live job and carries
out their decisions. It is a :class:`TrainHooks`, so the same object runs under Ray Train and
under plain ``torch.distributed`` processes.

Design decisions:
- Slow ranks are judged on ``compute_time_s_per_rank`` (each rank's training-thread CPU time,
  all-gathered by the loop), never on wall step time: in synchronous training every rank leaves
  the step's last collective together, so wall times are equal and a straggler is invisible.
- Hung collectives: a rank blocked in a collective cannot report anything itself, so each rank
  runs a daemon thread that publishes the training thread's progress (the 0-based step it last
  started, and a sequence number) to the process group's own key-value store (the c10d store
  every rank already reaches; no extra actor). Rank 0's thread reads every rank's entry each
  ``poll_s`` and stamps *when it saw the entry change* on its own monotonic clock, so the
  policy compares ages on one clock (no cross-host skew). A rank that never started the step
  the others are blocked in has the lowest step: it is the suspect.
- Acting on a hung decision: rank 0 records the decision (``on_decision``) and exits its own
  process. Ray Train sees a dead worker and restarts the whole group, which then restores from
  the flash snapshot; a collective already blocked cannot be cancelled in place, so a restart
  is the only recovery (the same reason NCCL's watchdog aborts the process).
- The hang timeout adapts to the job: ``max(hang_timeout_s, hang_step_factor x slowest step
  seen)``, and watching starts after the first completed step (the first step pays for model
  build, compilation and restores).
- Fault injection (``FaultInjection``, from ``RAYFLEET_DEBUG_SLOW_RANK="rank:factor"`` and
  ``RAYFLEET_DEBUG_HANG_RANK="rank:step"``) exists so the live tests can make one rank slow or
  hang for real; it is read by the loop and never set by the platform.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.jobs.health.policy import SlowRankPolicy, decide_hung_collective
from rayfleet.jobs.train_state import TrainHooks

__all__ = ["FaultInjection", "HealthMonitor", "burn_cpu", "HUNG_EXIT_CODE"]

HUNG_EXIT_CODE = 70  # rank 0's exit status after a hung-collective decision (EX_SOFTWARE)
_KEY = "rayfleet/progress/{rank}"


@dataclass(frozen=True)
class FaultInjection:
    """Debug faults: ``slow_rank`` computes ``slow_factor`` x longer; ``hang_rank`` stops before
    0-based step ``hang_step`` forever (only in a run that started from step 0, so the restarted
    group, which resumes from a snapshot, runs clean)."""

    slow_rank: int | None = None
    slow_factor: float = 1.0
    hang_rank: int | None = None
    hang_step: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultInjection:
        env = os.environ if env is None else env
        slow = _pair(env, "RAYFLEET_DEBUG_SLOW_RANK", "rank:factor, e.g. 2:3.0")
        hang = _pair(env, "RAYFLEET_DEBUG_HANG_RANK", "rank:step, e.g. 1:6")
        if slow is not None and slow[1] < 1.0:
            raise SpecError("RAYFLEET_DEBUG_SLOW_RANK", env["RAYFLEET_DEBUG_SLOW_RANK"],
                            "the factor must be >= 1 (it multiplies the rank's compute time)", "use e.g. 2:3.0")
        return cls(slow_rank=None if slow is None else int(slow[0]), slow_factor=1.0 if slow is None else slow[1],
                   hang_rank=None if hang is None else int(hang[0]), hang_step=None if hang is None else int(hang[1]))


def _pair(env: Mapping[str, str], name: str, form: str) -> tuple[float, float] | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        left, right = text.split(":")
        return float(int(left)), float(right)
    except ValueError:
        raise SpecError(name, text, f"it must have the form {form}", f"set {name} to {form}, or unset it") from None


def burn_cpu(seconds: float) -> None:
    """Compute (small matmuls) on this thread until its CPU time has grown by ``seconds``:
    what a slower accelerator does to the same step, not a sleep (a sleep is not compute)."""
    import torch

    end = time.thread_time() + seconds
    a = torch.randn(64, 64)
    while time.thread_time() < end:
        a = torch.tanh(a @ a)


class HealthMonitor(TrainHooks):
    """Slow-rank and hung-collective checks for ``train_worker`` (``hooks=``), on every rank.

    Decisions go to ``decisions`` and, on rank 0, to ``on_decision`` (the worker records them
    with the fleet controller). After a hung decision rank 0 calls ``exit_fn(HUNG_EXIT_CODE)``
    (default ``os._exit``) so that Ray Train restarts the group.
    """

    def __init__(self, *, slow_rank_policy: SlowRankPolicy | None = None, hang_timeout_s: float | None = 120.0,
                 hang_step_factor: float = 10.0, poll_s: float = 1.0,
                 on_decision: Callable[[Any], None] | None = None, exit_fn: Callable[[int], None] = os._exit) -> None:
        self.slow_rank_policy, self.hang_timeout_s = slow_rank_policy, hang_timeout_s
        self.hang_step_factor, self.poll_s = hang_step_factor, poll_s
        self.on_decision, self.exit_fn = on_decision, exit_fn
        self.decisions: list[Any] = []
        self.rank = 0
        self._progress = (-1, 0)  # (0-based step last started, sequence number)
        self._slowest_step_s = 0.0
        self._watching = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)  # settings only: events and threads live on the rank
        for key in ("_watching", "_stop", "_thread"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._watching, self._stop, self._thread = threading.Event(), threading.Event(), None

    # -- hooks ------------------------------------------------------------------------------
    def on_start(self, *, rank: int, world_size: int, plan: Any, step: int, state_fn: Any, load_fn: Any) -> None:
        self.rank, self.world_size = rank, world_size
        if self.hang_timeout_s is None or world_size < 2:
            return
        store = _default_store()
        if store is None:
            print("rayfleet health: no c10d store; hung-collective checks are off", flush=True)
            return
        self._thread = threading.Thread(target=self._heartbeat, args=(store,), name="rayfleet-health", daemon=True)
        self._thread.start()

    def before_step(self, step: int) -> None:
        self._progress = (step, self._progress[1] + 1)

    def after_step(self, step: int, *, metrics: Mapping[str, Any], sample_ids: tuple[int, ...], state_fn: Any,
                   load_fn: Any) -> None:
        self._progress = (self._progress[0], self._progress[1] + 1)  # alive, still at the step it started
        self._slowest_step_s = max(self._slowest_step_s, max(metrics.get("step_time_s_per_rank") or [0.0]))
        self._watching.set()
        compute = metrics.get("compute_time_s_per_rank")
        if self.slow_rank_policy is not None and compute:
            for decision in self.slow_rank_policy.observe(step + 1, dict(enumerate(compute))):
                self._decide(decision)

    def on_end(self, summary: Any, *, state_fn: Any) -> None:
        self._stop.set()

    # -- hung collectives --------------------------------------------------------------------
    def timeout_s(self) -> float:
        return max(float(self.hang_timeout_s or 0.0), self.hang_step_factor * self._slowest_step_s)

    def _heartbeat(self, store: Any) -> None:
        seen: dict[int, tuple[str, float]] = {}  # rank -> (entry, rank 0's clock when it changed)
        while not self._stop.wait(self.poll_s):
            step, seq = self._progress
            try:
                store.set(_KEY.format(rank=self.rank), f"{step},{seq}")
                if self.rank != 0 or not self._watching.is_set():
                    continue
                now = time.monotonic()
                for rank in range(self.world_size):
                    key = _KEY.format(rank=rank)
                    entry = store.get(key).decode() if store.check([key]) else "-1,0"
                    if seen.get(rank, ("", 0.0))[0] != entry:
                        seen[rank] = (entry, now)
            except Exception as exc:  # noqa: BLE001 - the store went away: the group is ending
                print(f"rayfleet health: heartbeat stopped ({exc})", flush=True)
                return
            decision = decide_hung_collective(
                now_s=now, rank_to_last_progress_s={r: t for r, (_, t) in seen.items()},
                rank_to_last_step={r: int(e.split(",")[0]) for r, (e, _) in seen.items()},
                timeout_s=self.timeout_s())
            if decision is not None:
                self._decide(decision)
                time.sleep(1.0)  # let the recorded event leave this process
                self.exit_fn(HUNG_EXIT_CODE)
                return

    def _decide(self, decision: Any) -> None:
        self.decisions.append(decision)
        if self.on_decision is not None and self.rank == 0:
            self.on_decision(decision)


def _default_store() -> Any:
    """The default process group's c10d store (private in torch, stable since 1.x), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialized, or the API moved
        return None
