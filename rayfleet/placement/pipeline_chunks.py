"""Which layers each virtual pipeline stage runs, and which pipeline rank runs it: plain 1F1B,
interleaved 1F1B (``vpp`` chunks a rank) and DualPipeV (two chunks a rank, in a V).

Design decisions:
- The plan's ``stage_starts`` (or the even split) say how many layers each *rank* holds: that is
  what the planner balances and what the cost model prices (``pipeline_schedule``: a rank runs
  ``vpp`` chunks of ``stage_s[r] / vpp``). The trainer keeps those per-rank counts and splits
  each rank's count over its chunks as evenly as possible (earlier chunks take the extra
  layer); the model's layers are then dealt out in virtual-stage order, so virtual stage ``j``
  runs the next ``count(j)`` layers. With one chunk a rank this is exactly ``stage_ranges``.
- Rank of virtual stage ``j`` of ``V = pp * chunks``: interleaved ("loop" in
  ``torch.distributed.pipelining``), ``j % pp``, so rank ``r`` holds ``r, r + pp, ...``;
  DualPipeV ("v"), ``j`` going down and ``2 * pp - 1 - j`` coming back, so rank ``r`` holds
  ``r`` and ``2 * pp - 1 - r``. These are the mappings torch's ``ScheduleInterleaved1F1B`` and
  ``ScheduleDualPipeV`` assume; the tests check both against torch's own function.
- The embedding sits on virtual stage 0 (rank 0) and the head on the last virtual stage: rank
  ``pp - 1`` for 1F1B and interleaving, as the planner's balance assumes, but rank 0 for
  DualPipeV (the V comes back). The planner charges the head to the last rank's stage, so for
  DualPipeV rank 0's real cost is higher than the balance assumed (by the head's share).
- The schedules' own conditions on the micro-batch count are checked before a job starts
  (``check_microbatches``; ``resolve_plan`` and the worker call it): DualPipeV needs ``2 * pp``,
  and torch's interleaved 1F1B runs rounds of ``pp`` micro-batches (``m`` a multiple of
  ``max(1, m // pp)``); the planner's ``interleaving_possible`` asks the same, so it offers
  virtual stages only where the trainer runs them.
- A rank with fewer layers than chunks cannot run (a chunk without layers would still send and
  receive every micro-batch): refused with the field and the fix. ``validate_plan`` does not
  check it because the planner validates shapes with placeholder boundaries (one layer a stage).

Pure: plain integers in, frozen values out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from rayfleet.errors import SpecError

__all__ = ["VirtualStage", "check_microbatches", "num_chunks", "stage_rank", "virtual_stages"]


class VirtualStage(NamedTuple):
    """One virtual stage: its index in the model's order, the pipeline rank running it, its layers."""

    index: int
    rank: int
    layers: range


def num_chunks(*, vpp: int, dualpipe: bool) -> int:
    """Model chunks a pipeline rank holds: 2 with DualPipeV, else ``vpp``."""
    return 2 if dualpipe else vpp


def stage_rank(index: int, *, pp: int, dualpipe: bool) -> int:
    """The pipeline rank running virtual stage ``index``."""
    if dualpipe:
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


def virtual_stages(rank_layer_counts: Sequence[int], *, chunks: int, dualpipe: bool) -> tuple[VirtualStage, ...]:
    """Every virtual stage, in the model's order (``len == pp * chunks``).

    Args:
        rank_layer_counts: layers each pipeline rank holds (from the plan's stage starts);
            ``len == pp``.
        chunks: chunks a rank (``num_chunks``); must be 2 with ``dualpipe``.

    Example: counts ``(3, 2)``, two chunks, interleaved: rank 0 splits 3 as (2, 1) and rank 1 2
    as (1, 1); virtual stages 0..3 run on ranks 0, 1, 0, 1 with 2, 1, 1, 1 layers, i.e. layers
    ``[0, 2), [2, 3), [3, 4), [4, 5)``. DualPipeV: ranks 0, 1, 1, 0 with 2, 1, 1, 1 layers.

    Raises:
        SpecError: a rank holds fewer layers than chunks.
    """
    pp = len(rank_layer_counts)
    assert pp >= 1 and chunks >= 1 and (not dualpipe or chunks == 2), (pp, chunks, dualpipe)
    for rank, count in enumerate(rank_layer_counts):
        if count < chunks:
            field, fix = ("plan.dualpipe", "use dualpipe: false, or stage starts giving every rank two layers") \
                if dualpipe else ("plan.vpp", f"use vpp <= {min(rank_layer_counts)}, or stage starts giving every "
                                  f"rank at least {chunks} layers")
            raise SpecError(field, chunks if not dualpipe else True,
                            f"pipeline rank {rank} holds {count} layer(s), fewer than its {chunks} model chunks",
                            fix)
    # per rank: its chunks' layer counts, earlier chunks first
    split = [[count // chunks + (c < count % chunks) for c in range(chunks)] for count in rank_layer_counts]
    out, start = [], 0
    for index in range(pp * chunks):
        rank = stage_rank(index, pp=pp, dualpipe=dualpipe)
        chunk = index // pp
        size = split[rank][chunk]
        out.append(VirtualStage(index, rank, range(start, start + size)))
        start += size
    return tuple(out)


def check_microbatches(num_microbatches: int, *, pp: int, vpp: int, dualpipe: bool) -> None:
    """Raise :class:`SpecError` when the plan's schedule cannot run ``num_microbatches`` a step
    (per DP replica): torch's ``ScheduleDualPipeV`` and ``ScheduleInterleaved1F1B`` conditions."""
    m = num_microbatches
    if dualpipe and m < 2 * pp:
        raise SpecError("plan.dualpipe", True, f"DualPipeV needs at least 2*pp = {2 * pp} micro-batches per replica "
                        f"and step; this plan gives {m}",
                        "use dualpipe: false, fewer stages, or more micro-batches (a larger global batch or a smaller "
                        "micro_batch_size)")
    rounds = max(1, m // pp)
    if not dualpipe and vpp > 1 and m % rounds:
        raise SpecError("plan.vpp", vpp, f"interleaved 1F1B runs micro-batches in {rounds} rounds of pp={pp}; "
                        f"{m} micro-batches per replica and step do not split into them",
                        f"use a micro-batch count that is a multiple of pp (e.g. {rounds * pp}), or vpp: 1")
