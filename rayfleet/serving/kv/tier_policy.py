"""KV tier policy: which queued requests' blocks to load into the engine pool now, and which
to prefetch from disk into host memory. Pure: no tensors, Ray, clock or I/O.

Design decisions:
- Loads serve the requests the scheduler can admit next (the first ``admit_window`` waiting
  requests, FCFS like the scheduler): their blocks enter the engine pool as ordinary cached
  blocks, so the scheduler's own prefix lookup hits them and nothing in the scheduler changes.
- A request's loadable run is its leading blocks up to the first block held nowhere: a block
  after a hole is useless (the prefix hit stops at the hole). Blocks already in the engine pool
  inside the run cost nothing; the others cost one free block each.
- The load budget is the pool's free blocks minus ``num_reserved_blocks`` (what running
  requests may take this step), so loading never forces a preemption. Loading evicts the
  least recently used cached blocks, which are written back to host memory, not lost.
- Prefetch looks further down the queue (``prefetch_window`` more requests) and at the part of a
  run the budget cut off: their disk-resident blocks are promoted to host memory in the
  background, so by the time those requests are admitted the load is a memory copy.

Worked example (``test_kv_tiers::test_policy_worked_example``), E = engine, H = host, D = disk,
. = nowhere; free 5, reserved 1 (budget 4), admit_window 2, prefetch_window 1:

    request 0: E E H H .    -> load blocks [0, 4): 2 loads (budget 4 -> 2)
    request 1: H D D D      -> budget 2 cuts the run to [0, 2); block 2, 3 (D) prefetched
    request 2: D H .        -> outside the admit window: block 0 (D) prefetched
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayfleet.errors import SpecError
from rayfleet.serving.kv.tiers import Tier

__all__ = ["KVTierPolicy", "LoadRun", "TierDecision"]


@dataclass(frozen=True)
class LoadRun:
    """Make blocks ``[0, num_blocks)`` of waiting request ``request_index`` engine-resident."""

    request_index: int
    num_blocks: int


@dataclass(frozen=True)
class TierDecision:
    loads: tuple[LoadRun, ...]
    prefetch: tuple[tuple[int, int], ...]  # (request_index, block_index): disk -> host memory

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.prefetch


@dataclass(frozen=True)
class KVTierPolicy:
    """``prefetch_window``: queued requests beyond the admittable ones whose disk blocks are
    promoted to host memory ahead of time."""

    prefetch_window: int = 8

    def __post_init__(self) -> None:
        if self.prefetch_window < 0:
            raise SpecError("kv_cache.prefetch_window", self.prefetch_window, "cannot be negative",
                            "pass 0 to disable prefetch, or a small count such as 8")

    def decide(self, waiting: Sequence[Sequence[Tier | None]], *, num_free_blocks: int,
               num_reserved_blocks: int, admit_window: int) -> TierDecision:
        """``waiting[i][j]``: fastest tier holding block ``j`` of the ``i``-th queued request
        (only blocks a prefix hit may cover). Returns loads (queue order) and prefetches."""
        budget = max(0, num_free_blocks - num_reserved_blocks)
        loads: list[LoadRun] = []
        prefetch: list[tuple[int, int]] = []
        for i, tiers in enumerate(waiting[:admit_window + self.prefetch_window]):
            run = 0
            while run < len(tiers) and tiers[run] is not None:
                run += 1
            loaded = 0
            if i < admit_window:
                for j in range(run):
                    if tiers[j] is not Tier.ENGINE:
                        if budget == 0:
                            break
                        budget -= 1
                    loaded = j + 1
                if any(t is not Tier.ENGINE for t in tiers[:loaded]):
                    loads.append(LoadRun(i, loaded))
            if self.prefetch_window:
                prefetch.extend((i, j) for j in range(loaded, run) if tiers[j] is Tier.DISK)
        return TierDecision(tuple(loads), tuple(prefetch))
