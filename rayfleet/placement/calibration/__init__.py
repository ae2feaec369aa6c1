"""Calibration of the cost model against published training runs.

Design decisions:
- The measurements live in ``published_runs.yaml`` beside this module (source, hardware, model,
  plan, measured tokens/s per GPU), so the evidence is reviewed with the code it constrains.
- A run's plan is taken as published (degrees, micro-batch, ZeRO stage); what recipes do not
  publish per row (recompute mode, Adam moment dtype) is the fastest choice that fits memory,
  as their authors tuned for. A published plan that does not fit the memory model is an error
  of the model, reported as such rather than skipped.
- Leave-one-out is cold: refitted from the pre-calibration constants without the left-out
  model (:func:`cold_leave_one_out`), regularised toward measured GEMM and attention
  efficiencies (:data:`PHYSICAL_PRIORS`); MoE rows say how their router placed tokens.
- :func:`fit_efficiency` fits only the efficiency constants (GEMM and attention efficiency, the
  small-GEMM knee, the contention of the EP all-to-all overlap) on the runs marked ``fit`` by coordinate search
  minimising the worst relative error; the held-out runs check the result. ``CostParams()``'s
  defaults are the output of that fit (see ``benchmarks/placement.py --calibration --refit``).

Units: tokens/s per GPU, seconds.

The table is read in ``runs``, priced and ranked in ``predict``, fitted in ``fit``; this package
only re-exports them.
"""

from rayfleet.placement.calibration.fit import (CORE_FITTED_FIELDS, FITTED_FIELDS, PHYSICAL_PRIORS, PRE_CALIBRATION,
                                               PRIOR_WEIGHT, LeaveOneOut, cold_leave_one_out, fit_efficiency)
from rayfleet.placement.calibration.predict import (RECIPE_SPACE, STEP_TERMS, GapBreakdown, PlanRanking,
                                                    RunPrediction, explain_gap, predict_run, rank_published_plan)
from rayfleet.placement.calibration.runs import PUBLISHED_RUNS_PATH, PublishedRun, load_published_runs

__all__ = ["PublishedRun", "RunPrediction", "PlanRanking", "GapBreakdown", "load_published_runs", "predict_run",
           "rank_published_plan", "explain_gap", "fit_efficiency", "PUBLISHED_RUNS_PATH", "FITTED_FIELDS",
           "RECIPE_SPACE", "STEP_TERMS", "CORE_FITTED_FIELDS", "PRE_CALIBRATION", "LeaveOneOut", "cold_leave_one_out",
           "PHYSICAL_PRIORS", "PRIOR_WEIGHT"]
