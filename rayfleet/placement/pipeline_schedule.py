"""Seconds one replica's pipeline takes to run its micro-batches: 1F1B, interleaved 1F1B and
DualPipeV, priced from per-stage micro-batch times.

Design decisions:
- Inputs are per stage (rank of the pipeline) and per micro-batch: ``stage_s[s]`` is stage
  ``s``'s forward+backward seconds for one micro-batch (its communication included), over all
  its layers; with ``vpp`` virtual stages a rank runs ``vpp`` chunks of ``stage_s[s] / vpp``.
- 1F1B and interleaved 1F1B (Megatron; Narayanan et al. 2021, section 2.2): with ``pp`` stages of
  ``t`` seconds and ``m`` micro-batches the step takes

      max(m, pp) * t + (min(m, pp) - 1) * t / vpp                                   (1)

  With ``m >= pp`` that is ``m * t + (pp - 1) * t / vpp``: the pipeline is full and the bubble
  fraction is Megatron's ``(pp - 1) / (vpp * m)``. With ``m < pp`` there are too few micro-batches
  to fill it: each one still crosses every stage, forward then backward, so the step is at least
  ``pp * t`` (the sum of the stages), and virtual stages shorten only the ``m - 1`` slots the later
  micro-batches trail the first by (a chunk is ``t / vpp`` long); with one micro-batch the step is
  ``pp * t`` whatever ``vpp`` is. Uneven stages generalise both bounds (``t_max`` = slowest stage):
  ``max(m * t_max + (sum - t_max) / vpp, sum + (m - 1) * t_max / vpp)``, which is (1) when the
  stages are equal and exactly ``m * t_max + sum - t_max`` without virtual stages.
- Megatron runs the interleaved schedule only with ``m >= pp``: micro-batches go round the ranks
  in groups of ``microbatch_group_size_per_vp_stage``, which defaults to ``pp``
  (``ModelParallelConfig.__post_init__``; older releases asked ``m % pp == 0``). The planner
  therefore offers ``vpp > 1`` only there (:func:`interleaving_possible`); (1) still prices the
  rest honestly.
- DualPipeV (deepseek-ai/DualPipe, ``dualpipev.py``): each of ``pp`` ranks holds two half-stage
  chunks (the V: chunk 0 going down, chunk 1 coming back), 1x parameters, and needs
  ``m >= 2 * pp`` (its ``step`` asserts ``num_chunks >= num_ranks * 2``). Its bubble is the
  README's ``(PP/2 - 1)(F&B + B - 3W)`` with ``PP = 2 * pp`` half-stage chunks: in whole-stage
  seconds ``(pp - 1) * (t + B - 3W) / 2``, where ``B`` is a stage's backward and ``W`` its
  weight-gradient part (zero-bubble splitting moves ``W`` into the gaps) and ``F&B`` -- one
  forward and one backward chunk whose communications overlap -- is their sum ``t``: the
  computations themselves still run one after the other (DeepSeek-V3 report, figure 4). With
  ``F = W`` and ``B = 2F`` that is ``(pp - 1) * F``: a third of 1F1B's ``(pp - 1) * 3F``, not
  the half that two interleaved virtual stages give. DualPipe proper (two directions, 2x
  parameters) is not offered: DualPipeV has the same bubble per rank at half the weights.

Units: seconds, per replica and optimizer step unless a name says "per micro-batch".
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["dualpipe_possible", "interleaving_possible", "pipeline_seconds"]


def interleaving_possible(num_microbatches: int, pp: int) -> bool:
    """Whether the interleaved schedule runs ``num_microbatches`` per replica over ``pp`` stages:
    Megatron's ``m >= pp``, and the rounds of ``pp`` torch's ``ScheduleInterleaved1F1B`` (what
    ``rayfleet train`` runs) splits them into (``m`` a multiple of ``m // pp``; see
    ``pipeline_chunks.check_microbatches``)."""
    return pp > 1 and num_microbatches >= pp and num_microbatches % (num_microbatches // pp) == 0


def dualpipe_possible(num_microbatches: int, pp: int) -> bool:
    """Whether DualPipeV runs ``num_microbatches`` per replica over ``pp`` ranks (``m >= 2 * pp``)."""
    return pp > 1 and num_microbatches >= 2 * pp


def pipeline_seconds(stage_s: Sequence[float], *, num_microbatches: int, vpp: int = 1, dualpipe: bool = False,
                     stage_backward_s: Sequence[float] = (), stage_weight_grad_s: Sequence[float] = ()) -> float:
    """Seconds from the first forward to the last backward of one replica's step.

    Args:
        stage_s: per stage, one micro-batch's forward+backward seconds on that rank (all its
            chunks, exposed communication included); ``len(stage_s) == pp``.
        num_microbatches: ``m``, micro-batches per replica per step (>= 1).
        vpp: virtual stages per rank (interleaved 1F1B); 1 for plain 1F1B.
        dualpipe: DualPipeV instead (``vpp`` must be 1); needs ``stage_backward_s`` and
            ``stage_weight_grad_s`` (per stage, one micro-batch's backward seconds and the
            weight-gradient part of them).

    Returns the pipeline's seconds: ``m`` times the slowest stage plus the bubble.
    """
    m, pp = num_microbatches, len(stage_s)
    assert m >= 1 and pp >= 1 and vpp >= 1, (m, pp, vpp)
    slow = max(stage_s)
    total = sum(stage_s)
    if dualpipe:
        assert vpp == 1 and len(stage_backward_s) == len(stage_weight_grad_s) == pp
        i = max(range(pp), key=stage_s.__getitem__)
        others_b = sum(stage_backward_s) - stage_backward_s[i]
        others_w = sum(stage_weight_grad_s) - stage_weight_grad_s[i]
        return m * slow + max(0.0, (total - slow) + others_b - 3 * others_w) / 2
    full = m * slow + (total - slow) / vpp
    starved = total + (m - 1) * slow / vpp
    return max(full, starved)
