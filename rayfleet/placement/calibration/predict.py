"""The cost model on a published run: its prediction, its rank in the planner's search, and the
term-by-term gap to the planner's top plan (units: tokens/s per GPU, seconds).

What recipes do not publish per row (recompute mode, Adam moment dtype) is the fastest choice
that fits memory, as their authors tuned for; a published plan that does not fit the memory
model is an error of the model, reported as such rather than skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rayfleet.errors import SpecError
from rayfleet.placement.calibration.runs import PublishedRun
from rayfleet.placement.cost_model import GIB, PlanCost, balanced_plan, evaluate_plan, plan_memory
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.plan import RECOMPUTE_OPTIONS, ParallelPlan
from rayfleet.placement.planner import search_plans
from rayfleet.placement.search_space import JobGoal, SearchSpace
from rayfleet.platform.catalogue import get_accelerator

__all__ = ["RunPrediction", "predict_run", "PlanRanking", "RECIPE_SPACE", "rank_published_plan", "STEP_TERMS",
           "GapBreakdown", "explain_gap"]


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
