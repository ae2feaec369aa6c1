"""Fitting the cost model's efficiency constants to the published runs marked ``fit``.

Only the efficiency constants move (GEMM and attention efficiency, the small-GEMM knee, the
contention of the EP all-to-all overlap, ...: :data:`FITTED_FIELDS`), by coordinate search
minimising the worst relative error; the held-out runs check the result. ``CostParams()``'s
defaults are the output of that fit (see ``benchmarks/placement.py --calibration --refit``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from rayfleet.errors import SpecError
from rayfleet.placement.calibration.predict import predict_run
from rayfleet.placement.calibration.runs import PublishedRun
from rayfleet.placement.cost_params import CostParams

__all__ = ["FITTED_FIELDS", "fit_efficiency"]

# The constants the fit may move, with the grid it searches (everything else is physics or bytes).
FITTED_FIELDS: dict[str, tuple[float, ...]] = {
    "gemm_efficiency": tuple(round(0.30 + 0.01 * i, 2) for i in range(56)),
    "attention_efficiency": tuple(round(0.20 + 0.02 * i, 2) for i in range(26)),
    "gemm_rows_at_half_efficiency": (16.0, 32.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0),
    "ep_overlap_contention": tuple(round(0.05 * i, 2) for i in range(13)),
    "tp_overlap_fraction": tuple(round(0.05 * i, 2) for i in range(19)),
    "gemm_width_at_half_efficiency": (0.0, 64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 1536.0),
    "moe_permute_bytes": tuple(float(b) for b in range(0, 129, 4)),
}


def _score(runs: Sequence[PublishedRun], params: CostParams) -> tuple[float, float]:
    errors = [math.log(predict_run(r, params).tokens_per_s_per_gpu / r.tokens_per_s_per_gpu) for r in runs]
    return max(abs(e) for e in errors), sum(e * e for e in errors)


def fit_efficiency(runs: Sequence[PublishedRun], start: CostParams = CostParams(), *, rounds: int = 3,
                   fields: Sequence[str] | None = None) -> CostParams:
    """Coordinate search over :data:`FITTED_FIELDS` (or the named ``fields``) minimising the
    worst |log(predicted / measured)| (then the sum of squares) over ``runs``."""
    if not runs:
        raise SpecError("runs", 0, "nothing to fit", "mark some published runs `fit: true`")
    unknown = sorted(set(fields or ()) - set(FITTED_FIELDS))
    if unknown:
        raise SpecError("fields", unknown, "not fitted constants", f"use some of {sorted(FITTED_FIELDS)}")
    grids = {k: v for k, v in FITTED_FIELDS.items() if fields is None or k in fields}
    best, score = start, _score(runs, start)
    for _ in range(rounds):
        improved = False
        for name, grid in grids.items():
            for value in grid:
                trial = replace(best, **{name: value})
                s = _score(runs, trial)
                if s < score:
                    best, score, improved = trial, s, True
        if not improved:
            break
    return best
