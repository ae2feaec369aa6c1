"""Fitting the cost model's efficiency constants to the published runs marked ``fit``, and the
out-of-sample check of that fit.

Only the efficiency constants move (GEMM and attention efficiency, the small-GEMM knee, the
contention of the EP all-to-all overlap, the MoE layer's per-copy bytes and fixed overhead, ...:
:data:`FITTED_FIELDS`), by coordinate search minimising the worst relative error; the held-out
runs check the result. ``CostParams()``'s defaults are the output of that fit on every fit row,
from :data:`PRE_CALIBRATION` and regularised toward :data:`PHYSICAL_PRIORS` as the leave-one-out
fits are (see ``benchmarks/placement.py --calibration --refit``).

Design decisions:
- Leave-one-out is *cold* (:func:`cold_leave_one_out`): each left-out run is predicted by a fit
  that starts from :data:`PRE_CALIBRATION` -- the constants before any run was fitted -- and sees
  no run of the left-out model. Starting from the all-data optimum instead lets a coordinate
  search stop where it began, so the "out of sample" error was the in-sample one for most rows.
- The fitted constants are physics with a shape, not per-row factors: a per-routed-element
  HBM cost (``moe_permute_bytes``) and a per-MoE-layer fixed cost (``moe_layer_overhead_s``)
  replaced a "narrow expert" GEMM knee that was a per-routed-element cost priced at the GEMM
  peak (so it doubled for BF16 runs, see ``CostParams``). The coordinate search visits the
  fields in :data:`FITTED_FIELDS`' order and is path dependent: with the overhead before the
  per-copy bytes it stopped, in one trial, at an optimum with twice the worst fit-row error.
- Seven constants against six fit rows can match anything; :data:`CORE_FITTED_FIELDS` is the
  subset small enough (fewer than half the fit rows) to be identified by them, the rest held at
  their pre-calibration values. Both fits are reported; neither is tuned to meet a goal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from rayfleet.errors import SpecError
from rayfleet.placement.calibration.predict import predict_run
from rayfleet.placement.calibration.runs import PublishedRun
from rayfleet.placement.cost_params import CostParams

__all__ = ["FITTED_FIELDS", "CORE_FITTED_FIELDS", "PRE_CALIBRATION", "PHYSICAL_PRIORS", "PRIOR_WEIGHT", "LeaveOneOut",
           "fit_efficiency", "cold_leave_one_out"]

# The constants the fit may move, with the grid it searches (everything else is physics or bytes).
FITTED_FIELDS: dict[str, tuple[float, ...]] = {
    "gemm_efficiency": tuple(round(0.30 + 0.01 * i, 2) for i in range(56)),
    "attention_efficiency": tuple(round(0.20 + 0.02 * i, 2) for i in range(26)),
    "gemm_rows_at_half_efficiency": (16.0, 32.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0),
    "ep_overlap_contention": tuple(round(0.05 * i, 2) for i in range(13)),
    "tp_overlap_fraction": tuple(round(0.05 * i, 2) for i in range(19)),
    "moe_permute_bytes": tuple(float(b) for b in range(0, 129, 4)),
    "moe_layer_overhead_s": tuple(round(0.0001 * i, 4) for i in range(0, 21)),
}


# The constants before calibration (issue 20's starting point): the physical guesses every
# cold fit starts from -- no efficiency knee, no EP overlap contention, no TP overlap. Measured
# constants are not fitted and keep their CostParams values here too (BF16 GEMM efficiency,
# NIC efficiency, the slowdown of compute beside a hidden collective).
PRE_CALIBRATION = CostParams(gemm_efficiency=0.5, gemm_rows_at_half_efficiency=128.0, attention_efficiency=0.35,
                             ep_overlap_fraction=0.8, ep_overlap_contention=0.0, tp_overlap_fraction=0.0,
                             moe_layer_overhead_s=0.0, moe_permute_bytes=0.0)

# Fewer than half the fit rows: the GEMM efficiency (every row) and the EP overlap's contention
# (the MoE rows with the overlap on).
CORE_FITTED_FIELDS: tuple[str, ...] = ("gemm_efficiency", "ep_overlap_contention")


# Physical measurements the fitted constants are pulled toward (a regularised fit): a constant
# may leave its measured value only where the rows pay for it. Sources (public microbenchmarks
# on H100 SXM, figures as recalled from them, see docs/planner-calibration.md):
# - gemm_efficiency 0.60: large FP8 GEMMs reach ~1,200-1,300 of 1,979 TFLOP/s (cuBLASLt /
#   Transformer Engine; SemiAnalysis' H100/H200/MI300X training benchmark, GEMM section), less
#   the current-scaling amax and cast kernels an FP8 training GEMM adds;
# - attention_efficiency 0.45: FlashAttention-3 (arXiv 2407.08608) reaches up to 740 TFLOP/s
#   BF16 forward (75%) on H100; causal head-dim-128 forward ~60% and backward ~45-50%, i.e.
#   ~0.45-0.5 of peak over forward + backward (backward is 2.5x the forward FLOPs).
PHYSICAL_PRIORS: dict[str, float] = {"gemm_efficiency": 0.60, "attention_efficiency": 0.45}
# Weight of the squared log-distance to the priors against the worst |log error|: a constant
# 20% off its prior costs as much as 3.3% more worst error.
PRIOR_WEIGHT = 1.0


def _score(runs: Sequence[PublishedRun], params: CostParams,
           priors: Mapping[str, float] | None = None) -> tuple[float, float]:
    errors = [math.log(predict_run(r, params).tokens_per_s_per_gpu / r.tokens_per_s_per_gpu) for r in runs]
    penalty = PRIOR_WEIGHT * sum(math.log(getattr(params, k) / v) ** 2 for k, v in (priors or {}).items())
    return max(abs(e) for e in errors) + penalty, sum(e * e for e in errors)


def fit_efficiency(runs: Sequence[PublishedRun], start: CostParams = CostParams(), *, rounds: int = 3,
                   fields: Sequence[str] | None = None, priors: Mapping[str, float] | None = None) -> CostParams:
    """Coordinate search over :data:`FITTED_FIELDS` (or the named ``fields``) minimising the
    worst |log(predicted / measured)| (then the sum of squares) over ``runs``; with ``priors``
    (e.g. :data:`PHYSICAL_PRIORS`) plus :data:`PRIOR_WEIGHT` x the squared log-distance of
    those constants to their measured values."""
    if not runs:
        raise SpecError("runs", 0, "nothing to fit", "mark some published runs `fit: true`")
    unknown = sorted(set(fields or ()) - set(FITTED_FIELDS))
    if unknown:
        raise SpecError("fields", unknown, "not fitted constants", f"use some of {sorted(FITTED_FIELDS)}")
    grids = {k: v for k, v in FITTED_FIELDS.items() if fields is None or k in fields}
    best, score = start, _score(runs, start, priors)
    for _ in range(rounds):
        improved = False
        for name, grid in grids.items():
            for value in grid:
                trial = replace(best, **{name: value})
                s = _score(runs, trial, priors)
                if s < score:
                    best, score, improved = trial, s, True
        if not improved:
            break
    return best


@dataclass(frozen=True)
class LeaveOneOut:
    """One run predicted by a cold fit on the others: ``error`` = predicted / measured - 1;
    ``fitted_on`` the run ids the fit saw."""

    run_id: str
    error: float
    fitted_on: tuple[str, ...]


def cold_leave_one_out(runs: Sequence[PublishedRun], *, fields: Sequence[str] | None = None,
                       start: CostParams = PRE_CALIBRATION, rounds: int = 3,
                       priors: Mapping[str, float] | None = None) -> tuple[LeaveOneOut, ...]:
    """Every run of ``runs`` predicted by :func:`fit_efficiency` from ``start`` on the ``fit``
    runs of *other* models (a row of the same model in another container is the same evidence).
    Fits that see the same runs are shared, so held-out rows of one model cost one fit. With
    ``priors`` the fit is regularised toward them (the start is still ``start``)."""
    fits: dict[tuple[str, ...], CostParams] = {}
    out = []
    for run in runs:
        others = [r for r in runs if r.fit and r.model.name != run.model.name]
        key = tuple(r.id for r in others)
        if key not in fits:
            fits[key] = fit_efficiency(others, start, rounds=rounds, fields=fields, priors=priors)
        out.append(LeaveOneOut(run.id, predict_run(run, fits[key]).error, key))
    return tuple(out)
