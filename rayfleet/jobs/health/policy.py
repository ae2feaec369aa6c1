"""Health policies of a training job: slow ranks, hung collectives, NaN / loss spikes.

Pure: no Ray, clock or I/O. Callers pass step times, timestamps and losses in; the policies
return frozen decisions with a ``cause`` string that the controller records as an event and
carries out (cordon the node and re-form the job, restart the worker group, roll back).

Design decisions:
- Slow rank: compare each rank's step time with the *median across ranks of the same step*
  (the ratio cancels what slows everyone: a bigger batch, a checkpoint, a shared hiccup), then
  flag a rank when the median of its ratio over the last ``window`` steps exceeds
  ``threshold`` and at least ``min_slow_fraction`` of those steps were individually slow. A
  median over a window ignores one-off stalls (GC, page faults) that a mean or a max would flag,
  and a persistently slow rank crosses it once half the window is slow: with ``window=10`` it is
  flagged ≈ 5–6 steps after it turns slow, well within the 20-step goal.
  Feed *compute* time per rank (before the collective wait): in synchronous training the
  collective makes every rank's wall-clock step equal to the slowest one's.
- Hung collective: a rank whose last progress is older than ``timeout_s`` has stalled. The
  suspects are the ranks behind the others (lowest last step), else those silent longest; the
  decision restarts the group (a hung NCCL/gloo collective cannot be cancelled in place).
- Loss: NaN/inf, or a loss above ``spike_factor`` × the running median of recent healthy
  losses (after ``warmup_steps``), decides a rollback to the newest snapshot taken *before* the
  anomalous step: the update of that step already used the bad gradients. Anomalous losses are
  kept out of the running window so that a spike cannot raise its own baseline.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal, Mapping

__all__ = [
    "SlowRankDecision", "HungCollectiveDecision", "RollbackDecision", "SlowRankPolicy",
    "decide_hung_collective", "LossAnomalyPolicy",
]


@dataclass(frozen=True)
class SlowRankDecision:
    """Cordon the node of ``rank`` and re-form the job without it."""

    step: int
    rank: int
    ratio: float  # median over the window of (rank step time / median step time)
    cause: str
    action: Literal["cordon_and_reform"] = "cordon_and_reform"


@dataclass(frozen=True)
class HungCollectiveDecision:
    """Restart the worker group; ``suspect_ranks`` are the likely culprits (for cordoning)."""

    stalled_ranks: tuple[int, ...]
    suspect_ranks: tuple[int, ...]
    max_age_s: float
    cause: str
    action: Literal["restart_group"] = "restart_group"


@dataclass(frozen=True)
class RollbackDecision:
    """Restore the newest snapshot whose step is <= ``restore_at_most_step``."""

    step: int
    loss: float
    restore_at_most_step: int
    cause: str
    action: Literal["rollback"] = "rollback"


class SlowRankPolicy:
    """Flags ranks whose step time stays above ``threshold`` × the per-step median.

    Mutates only its window of ratios; each rank is flagged once (until :meth:`forget`).
    """

    def __init__(self, *, threshold: float = 1.3, window: int = 10, min_slow_fraction: float = 0.5) -> None:
        if threshold <= 1.0 or window < 3 or not 0.0 < min_slow_fraction <= 1.0:
            raise ValueError("need threshold > 1, window >= 3 and 0 < min_slow_fraction <= 1")
        self.threshold, self.window, self.min_slow_fraction = threshold, window, min_slow_fraction
        self._rank_to_ratios: dict[int, deque[float]] = {}
        self._flagged: set[int] = set()

    def observe(self, step: int, rank_to_step_s: Mapping[int, float]) -> list[SlowRankDecision]:
        """One step's times (seconds, per rank, >= 2 ranks). Returns the ranks newly flagged."""
        if len(rank_to_step_s) < 2:
            return []
        median = statistics.median(rank_to_step_s.values())
        if median <= 0:
            return []
        decisions = []
        for rank, seconds in sorted(rank_to_step_s.items()):
            ratios = self._rank_to_ratios.setdefault(rank, deque(maxlen=self.window))
            ratios.append(seconds / median)
            if rank in self._flagged or len(ratios) < self.window:
                continue
            window_ratio = statistics.median(ratios)
            slow_fraction = sum(r > self.threshold for r in ratios) / len(ratios)
            if window_ratio > self.threshold and slow_fraction >= self.min_slow_fraction:
                self._flagged.add(rank)
                decisions.append(SlowRankDecision(
                    step=step, rank=rank, ratio=window_ratio,
                    cause=(f"rank {rank} step time {window_ratio:.2f}x the median over the last "
                           f"{self.window} steps (threshold {self.threshold:.2f}x; "
                           f"{slow_fraction:.0%} of those steps slow)")))
        return decisions

    def forget(self, rank: int) -> None:
        """Drop a rank's history (it left the job, or came back on another node)."""
        self._rank_to_ratios.pop(rank, None)
        self._flagged.discard(rank)


def decide_hung_collective(*, now_s: float, rank_to_last_progress_s: Mapping[int, float],
                           rank_to_last_step: Mapping[int, int], timeout_s: float) -> HungCollectiveDecision | None:
    """Restart decision when any rank made no progress for more than ``timeout_s``, else None.

    ``rank_to_last_progress_s``: when each rank last reported progress (any clock, same as ``now_s``).
    """
    ages = {rank: now_s - t for rank, t in rank_to_last_progress_s.items()}
    stalled = tuple(sorted(rank for rank, age in ages.items() if age > timeout_s))
    if not stalled:
        return None
    steps = {rank: rank_to_last_step.get(rank, -1) for rank in ages}
    lowest = min(steps.values())
    if lowest < max(steps.values()):
        suspects = tuple(sorted(rank for rank, s in steps.items() if s == lowest))
        why = f"ranks {list(suspects)} stopped at step {lowest} while others reached {max(steps.values())}"
    else:
        oldest = max(ages.values())
        suspects = tuple(sorted(rank for rank, age in ages.items() if age == oldest))
        why = f"all ranks at step {lowest}; ranks {list(suspects)} silent longest"
    max_age = max(ages[r] for r in stalled)
    return HungCollectiveDecision(
        stalled_ranks=stalled, suspect_ranks=suspects, max_age_s=max_age,
        cause=f"no progress for {max_age:.1f} s > timeout {timeout_s:.1f} s on ranks {list(stalled)}: {why}")


class LossAnomalyPolicy:
    """Rollback decisions on a non-finite loss or a spike above ``spike_factor`` × running median."""

    def __init__(self, *, spike_factor: float = 3.0, window: int = 50, warmup_steps: int = 10) -> None:
        if spike_factor <= 1.0 or window < 1 or warmup_steps < 1:
            raise ValueError("need spike_factor > 1, window >= 1, warmup_steps >= 1")
        self.spike_factor, self.warmup_steps = spike_factor, warmup_steps
        self._healthy: deque[float] = deque(maxlen=window)

    def observe(self, step: int, loss: float) -> RollbackDecision | None:
        """One step's (global) loss. Returns a rollback decision or None; healthy losses are kept."""
        if not math.isfinite(loss):
            return RollbackDecision(step=step, loss=loss, restore_at_most_step=step - 1,
                                    cause=f"loss is {loss} at step {step}")
        if len(self._healthy) >= self.warmup_steps:
            baseline = statistics.median(self._healthy)
            if baseline > 0 and loss > self.spike_factor * baseline:
                return RollbackDecision(
                    step=step, loss=loss, restore_at_most_step=step - 1,
                    cause=(f"loss spike at step {step}: {loss:.4g} > {self.spike_factor:g} x running "
                           f"median {baseline:.4g} of the last {len(self._healthy)} healthy steps"))
        self._healthy.append(loss)
        return None

    def reset(self) -> None:
        """Forget the baseline (after a rollback the same steps are replayed)."""
        self._healthy.clear()
