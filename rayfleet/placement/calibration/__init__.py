"""Calibration of the cost model against published training runs.

Design decisions:
- The measurements live in ``published_runs.yaml`` beside this module (source, hardware, model,
  plan, measured tokens/s per GPU), so the evidence is reviewed with the code it constrains.
- A run's plan is taken as published (degrees, micro-batch, ZeRO stage); what recipes do not
  publish per row (recompute mode, Adam moment dtype) is the fastest choice that fits memory,
  as their authors tuned for. A published plan that does not fit the memory model is an error
  of the model, reported as such rather than skipped.
- :func:`fit_efficiency` fits only the efficiency constants (GEMM and attention efficiency, the
  small-GEMM knee, the contention of the EP all-to-all overlap) on the runs marked ``fit`` by coordinate search
  minimising the worst relative error; the held-out runs check the result. ``CostParams()``'s
  defaults are the output of that fit (see ``benchmarks/placement.py --calibration --refit``).

Units: tokens/s per GPU, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from rayfleet.errors import SpecError
from rayfleet.placement.cost_model import GIB, PlanCost, balanced_plan, evaluate_plan, plan_memory
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.plan import RECOMPUTE_OPTIONS, ParallelPlan, validate_plan
from rayfleet.placement.planner import search_plans
from rayfleet.placement.search_space import JobGoal, SearchSpace
from rayfleet.platform.catalogue import get_accelerator

__all__ = ["PublishedRun", "RunPrediction", "PlanRanking", "GapBreakdown", "load_published_runs", "predict_run",
           "rank_published_plan", "explain_gap", "fit_efficiency", "PUBLISHED_RUNS_PATH", "FITTED_FIELDS",
           "RECIPE_SPACE", "STEP_TERMS"]

PUBLISHED_RUNS_PATH = Path(__file__).with_name("published_runs.yaml")
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


class _PlanInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    zero_stage: int = 1
    ep_overlap: bool = True
    ep_dedup: bool = True
    tp_overlap: bool = True


class _RunInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    source: str
    hardware: str
    model: str
    seq_len: int
    global_batch_sequences: int
    precision: str
    plan: _PlanInput
    tokens_per_s_per_gpu: float
    fit: bool = False


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement: ``plan`` (recompute left to the model) of ``model`` on
    ``plan.world_size`` accelerators of type ``hardware`` ran at ``tokens_per_s_per_gpu``."""

    id: str
    source: str
    hardware: str
    model: ModelSpec
    plan: ParallelPlan
    tokens_per_s_per_gpu: float
    fit: bool

    @property
    def num_gpus(self) -> int:
        return self.plan.world_size

    @property
    def step_time_s(self) -> float:
        return self.model.global_batch_tokens / (self.tokens_per_s_per_gpu * self.num_gpus)


@dataclass(frozen=True)
class RunPrediction:
    """The cost model's prediction for a published run; ``error`` = predicted / measured - 1."""

    run: PublishedRun
    cost: PlanCost

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.cost.tokens_per_s / self.cost.plan.world_size

    @property
    def error(self) -> float:
        return self.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu - 1


def load_published_runs(path: str | Path = PUBLISHED_RUNS_PATH) -> tuple[PublishedRun, ...]:
    """The runs in ``path`` (YAML), validated; errors name the run and the field."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    out = []
    for i, raw in enumerate(data.get("runs", [])):
        try:
            run = _RunInput.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            raise SpecError(f"runs[{i}]." + ".".join(str(p) for p in first["loc"]), first.get("input"), first["msg"],
                            f"fix {Path(path).name}") from None
        model = preset(run.model, seq_len=run.seq_len, global_batch_sequences=run.global_batch_sequences,
                       precision=run.precision)
        p = run.plan
        width = p.tp * p.cp * p.pp
        if p.num_gpus % width:
            raise SpecError(f"runs[{i}].plan.num_gpus", p.num_gpus, f"is not a multiple of tp*cp*pp={width}",
                            "check the published degrees")
        plan = ParallelPlan(tp=p.tp, pp=p.pp, cp=p.cp, vpp=p.vpp, ep=p.ep, etp=p.etp, dp=p.num_gpus // width,
                            micro_batch_size=p.micro_batch_size, zero_stage=p.zero_stage, ep_overlap=p.ep_overlap,
                            ep_dedup=p.ep_dedup, tp_overlap=p.tp_overlap)
        try:  # uneven splits are balanced by the cost model: validate with placeholder boundaries
            validate_plan(replace(plan, stage_starts=tuple(range(plan.pp))), model,
                          scaleup_domain_size=get_accelerator(run.hardware).scaleup_domain_size)
        except SpecError as err:
            why_fix = str(err).split(": ", 1)[-1]
            why, _, fix = why_fix.rpartition(". Fix: ")
            raise SpecError(f"runs[{i}] ({run.id}).{err.field}", err.value, why, fix) from None
        out.append(PublishedRun(run.id, run.source, get_accelerator(run.hardware).name, model, plan,
                                run.tokens_per_s_per_gpu, run.fit))
    return tuple(out)


def predict_run(run: PublishedRun, params: CostParams = CostParams()) -> RunPrediction:
    """The fastest recompute mode / Adam moment dtype for the published plan that fits memory."""
    accel = get_accelerator(run.hardware)
    best: PlanCost | None = None
    worst_gib = 0.0
    for recompute in RECOMPUTE_OPTIONS:
        for dtype in ("fp32", "bf16"):
            plan = balanced_plan(run.model, replace(run.plan, recompute=recompute, optimizer_dtype=dtype), accel, params)
            mem, _, usable = plan_memory(run.model, plan, accel, params=params)
            if mem.total > usable:
                worst_gib = max(worst_gib, mem.total / GIB)
                continue
            cost = evaluate_plan(run.model, plan, accel, params=params)
            if best is None or cost.step_time_s < best.step_time_s:
                best = cost
    if best is None:
        raise SpecError(f"calibration run {run.id}", run.plan.describe(),
                        f"the memory model says the published plan does not fit ({worst_gib:.1f} GiB needed even "
                        "with the lightest setting)", "fix the memory model: the plan ran")
    return RunPrediction(run, best)


@dataclass(frozen=True)
class PlanRanking:
    """Where the published plan lands in the planner's search at the published size."""

    rank: int | None  # 1-based among the planner's top_k shapes, None when not among them
    published_step_s: float
    top_step_s: float
    top_plan: ParallelPlan

    @property
    def gap_to_top(self) -> float:
        """Predicted published step / predicted best step - 1 (0 when the published is the top)."""
        return self.published_step_s / self.top_step_s - 1


# What the published recipes' framework (Megatron-Core) chooses from: its distributed optimizer
# (ZeRO-1) or FSDP (ZeRO-3), with FP32 Adam states by default.
RECIPE_SPACE = SearchSpace(zero_stages=(1, 3), optimizer_dtypes=("fp32",))


def rank_published_plan(run: PublishedRun, params: CostParams = CostParams(), *, top_k: int = 3,
                        space: SearchSpace = RECIPE_SPACE) -> PlanRanking:
    """Search the published size and report the published shape's rank (shape = tp, cp, pp, dp,
    ep, etp) among the planner's ``top_k`` and its predicted gap to the top plan."""
    accel = get_accelerator(run.hardware)
    capacity = FleetCapacity({accel.name: accel}, {accel.name: run.num_gpus})
    # the shapes are compared under the runtime options the run had (its dispatcher, overlaps)
    space = replace(space, ep_overlap=run.plan.ep_overlap, ep_dedup=run.plan.ep_dedup,
                    tp_overlap=run.plan.tp_overlap)
    result = search_plans(run.model, capacity, top_k=top_k, params=params, space=space,
                          goal=JobGoal.exactly(run.num_gpus))
    published = predict_run(run, params).cost
    shape = run.plan.shape()
    rank = next((r.rank for r in result.ranked if r.plan.shape() == shape), None)
    top = result.ranked[0] if result.ranked else None
    return PlanRanking(rank, published.step_time_s, top.step_time_s if top else published.step_time_s,
                       top.plan if top else published.plan)


# The step-time terms of :class:`StepTimeBreakdown`, in the order the benchmark prints them.
STEP_TERMS: tuple[str, ...] = ("compute", "tp_comm", "ep_comm", "cp_comm", "pp_p2p", "pp_bubble", "dp_comm",
                               "optimizer")


@dataclass(frozen=True)
class GapBreakdown:
    """The published plan and the planner's top at the published size, priced term by term:
    where a published plan ranks low, the term that separates the two is the one to question."""

    run_id: str
    published: PlanCost
    top: PlanCost

    def terms(self) -> tuple[tuple[str, float, float], ...]:
        """(term, published seconds per step, top's seconds per step) for each of :data:`STEP_TERMS`."""
        return tuple((t, getattr(self.published.step, t), getattr(self.top.step, t)) for t in STEP_TERMS)

    @property
    def largest_difference(self) -> str:
        """The term whose published-minus-top difference is largest in size."""
        return max(self.terms(), key=lambda t: abs(t[1] - t[2]))[0]


def explain_gap(run: PublishedRun, params: CostParams = CostParams(), *,
                space: SearchSpace = RECIPE_SPACE) -> GapBreakdown:
    """Price the published plan and the planner's top (searched as :func:`rank_published_plan`
    does, under the run's runtime options) with the same constants, for a term-by-term comparison."""
    ranking = rank_published_plan(run, params, space=space)
    top = evaluate_plan(run.model, ranking.top_plan, get_accelerator(run.hardware), params=params)
    return GapBreakdown(run.id, predict_run(run, params).cost, top)


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



