"""The cost model's front door: memory + step time of one plan, with the dynamic PP split.

Design decisions:
- Pure: a plan, a model spec and catalogue entries in, a frozen :class:`PlanCost` out.
- When a plan has no ``stage_starts``, the stages are balanced on this very cost model's
  per-layer times (embedding and head included) before pricing, so "dynamic PP split" and
  "step time" can never disagree.
- Mixed fleets: every DP replica runs on one accelerator type (``plan.replica_accelerators``)
  with its own number of micro-batches (``plan.replica_microbatches``); the step ends when the
  slowest replica group finishes, and each type's memory is checked against its own HBM.

Units: bytes, seconds, tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.memory_model import (MemoryBreakdown, all_stage_activation_bytes, all_stage_param_counts,
                                              stage_static_bytes)
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.pipeline_split import balance_stages
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.step_time_model import (StepTimeBreakdown, edge_times, ep_overlap_possible, estimate_step_time,
                                                layer_times)
from rayfleet.platform.catalogue import AcceleratorSpec

__all__ = ["PlanCost", "evaluate_plan", "plan_memory", "balanced_plan", "slowest_accelerator", "GIB"]

GIB = float(1 << 30)


@dataclass(frozen=True)
class PlanCost:
    """Predicted cost of a plan.

    Attributes:
        plan: the plan priced (with ``stage_starts`` filled in).
        memory: the device closest to its HBM limit (largest ``total / usable HBM``).
        memory_accelerator: that device's accelerator type.
        usable_memory_bytes: the HBM a plan may fill on that device.
        step: step-time breakdown of the slowest replica group.
        tokens_per_s: global batch tokens / step time.
        mfu: model FLOPs (6 x active params x tokens + attention) / (step time x fleet peak).
    """

    plan: ParallelPlan
    memory: MemoryBreakdown
    memory_accelerator: str
    usable_memory_bytes: float
    step: StepTimeBreakdown
    tokens_per_s: float
    mfu: float

    @property
    def step_time_s(self) -> float:
        return self.step.total

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory_bytes

    @property
    def peak_memory_gib(self) -> float:
        return self.memory.total / GIB


def _accelerators(plan: ParallelPlan, accelerator: AcceleratorSpec | Mapping[str, AcceleratorSpec]
                  ) -> list[tuple[AcceleratorSpec, int]]:
    """Distinct (accelerator, micro-batches per replica) groups of the plan's DP replicas."""
    if isinstance(accelerator, AcceleratorSpec) and plan.replica_accelerators is None:
        counts = plan.replica_microbatches or (None,)
        return [(accelerator, c) for c in sorted(set(counts), key=lambda c: c or 0)]
    types = plan.replica_accelerators or ((accelerator.name,) * plan.dp if isinstance(accelerator, AcceleratorSpec)
                                          else ())
    table = {accelerator.name: accelerator} if isinstance(accelerator, AcceleratorSpec) else dict(accelerator)
    counts = plan.replica_microbatches or (None,) * plan.dp
    return [(table[t], c) for t, c in sorted(set(zip(types, counts)), key=lambda tc: (tc[0], tc[1] or 0))]


def balanced_plan(model: ModelSpec, plan: ParallelPlan, accelerator: AcceleratorSpec,
                  params: CostParams = CostParams()) -> ParallelPlan:
    """``plan`` with ``stage_starts`` minimising the slowest stage on ``accelerator``."""
    if plan.stage_starts is not None:
        return plan
    if plan.pp == 1:
        return plan.but(stage_starts=(0,))
    # layer times do not depend on dp or ZeRO, and on vpp only through the EP overlap: memoise
    # the split on what they depend on (the planner balances one shape at many dp degrees)
    key = (model, plan.tp, plan.cp, plan.ep, plan.etp, plan.micro_batch_size, plan.recompute, plan.layer_tp,
           plan.pp, ep_overlap_possible(plan), plan.ep_dedup, plan.tp_overlap, accelerator, params)
    starts = _SPLITS.get(key)
    if starts is None:
        times = layer_times(model, plan, accelerator, params)
        embed, head = edge_times(model, plan, accelerator, params)
        costs = [t.total for t in times]
        costs[0] += embed
        costs[-1] += head
        if len(_SPLITS) > 65536:
            _SPLITS.clear()
        starts = _SPLITS[key] = balance_stages(costs, plan.pp)
    return plan.but(stage_starts=starts)


_SPLITS: dict[tuple, tuple[int, ...]] = {}


def plan_memory(model: ModelSpec, plan: ParallelPlan, accelerator: AcceleratorSpec | Mapping[str, AcceleratorSpec],
                *, params: CostParams = CostParams()) -> tuple[MemoryBreakdown, str, float]:
    """(fullest device's memory, its accelerator type, its usable bytes) for a plan whose
    ``stage_starts`` are set; cheaper than :func:`evaluate_plan` (no step time)."""
    counts = all_stage_param_counts(model, plan)
    default_m = plan.num_microbatches(model.global_batch_sequences)
    worst: tuple[MemoryBreakdown, str, float] | None = None
    worst_ratio = -1.0
    ranges = plan.stage_ranges(model.num_layers)
    for accel, m in _accelerators(plan, accelerator):
        usable = accel.hbm_gib * GIB * params.usable_memory_fraction
        # what stage_memory sums, with every stage's activations from one memoised call
        acts = all_stage_activation_bytes(model, plan, num_microbatches=m or default_m, params=params)
        for s in range(plan.pp):
            weights, grads, optim = stage_static_bytes(model, plan, counts[s], len(ranges[s]), params=params)
            total = weights + grads + optim + acts[s]
            if total / usable > worst_ratio:
                worst = (MemoryBreakdown(s, weights, grads, optim, acts[s]), accel.name, usable)
                worst_ratio = total / usable
    assert worst is not None
    return worst


def slowest_accelerator(model: ModelSpec, plan: ParallelPlan,
                        accelerator: AcceleratorSpec | Mapping[str, AcceleratorSpec]) -> AcceleratorSpec:
    """The plan's slowest accelerator type: the one the pipeline split is balanced for."""
    return min((g[0] for g in _accelerators(plan, accelerator)), key=lambda a: a.peak_tflops(model.precision))


def evaluate_plan(model: ModelSpec, plan: ParallelPlan, accelerator: AcceleratorSpec | Mapping[str, AcceleratorSpec],
                  *, params: CostParams = CostParams()) -> PlanCost:
    """Price ``plan`` (assumed valid: see :func:`rayfleet.placement.plan.validate_plan`).

    ``accelerator`` is the catalogue entry of a homogeneous fleet, or a name -> entry map for
    the types named in ``plan.replica_accelerators``.
    """
    groups = _accelerators(plan, accelerator)
    plan = balanced_plan(model, plan, slowest_accelerator(model, plan, accelerator), params)
    counts = all_stage_param_counts(model, plan)
    default_m = plan.num_microbatches(model.global_batch_sequences)
    worst_mem, worst_type, worst_usable = plan_memory(model, plan, accelerator, params=params)
    worst_step: StepTimeBreakdown | None = None
    for accel, m in groups:
        step = estimate_step_time(model, plan, accel, num_microbatches=m or default_m, stage_counts=counts,
                                  params=params)
        if worst_step is None or step.total > worst_step.total:
            worst_step = step
    assert worst_step is not None

    tokens = model.global_batch_tokens
    model_flops = tokens * 3 * model.model_forward_flops_per_token()
    if plan.replica_accelerators is None and isinstance(accelerator, AcceleratorSpec):
        fleet_peak = plan.world_size * accelerator.peak_tflops(model.precision) * 1e12
    else:
        table = accelerator if not isinstance(accelerator, AcceleratorSpec) else {accelerator.name: accelerator}
        per_replica = plan.world_size // plan.dp
        fleet_peak = sum(per_replica * table[t].peak_tflops(model.precision) * 1e12 for t in plan.replica_accelerators)
    return PlanCost(plan=plan, memory=worst_mem, memory_accelerator=worst_type, usable_memory_bytes=worst_usable,
                    step=worst_step, tokens_per_s=tokens / worst_step.total,
                    mfu=model_flops / (worst_step.total * fleet_peak))
