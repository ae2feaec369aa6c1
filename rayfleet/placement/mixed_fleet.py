"""Plans for a mixed fleet (several accelerator types in one job).

Design decisions:
- Every DP replica lives on one accelerator type; a type with ``n`` free accelerators hosts
  ``n // (tp*cp*pp)`` replicas, and micro-batches go to replicas in proportion to their
  accelerators' peak FLOP/s (largest remainder), so fast replicas take more of the batch and
  all finish together. EP groups must not straddle types.
- A mixed job uses every type; the planner also offers each type on its own (see
  :mod:`rayfleet.placement.planner`), so a fleet whose mix cannot run the batch still plans.
- Branch and bound over shapes: a shape's lower bound (:class:`_Bound`) is its per-device work
  at the most efficient micro-batch spread evenly over stages plus the smallest fill/drain.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Iterator

from rayfleet.errors import SpecError
from rayfleet.placement.cost_model import GIB, PlanCost, balanced_plan, evaluate_plan, plan_memory, slowest_accelerator
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.memory_model import stage_memory, stage_param_counts
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.search_results import Rejection
from rayfleet.placement.search_space import SearchSpace, context_parallel_degrees
from rayfleet.placement.step_time_model import edge_times, layer_times

__all__ = ["mixed_fleet_search"]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _shapes(model: ModelSpec, capacity: FleetCapacity, space: SearchSpace) -> Iterator[tuple[int, int, int, int, int]]:
    """(tp, cp, pp, ep, etp) candidates; dp follows from the fleet."""
    domain = capacity.min_domain
    cps = context_parallel_degrees(model, space)
    tps = [t for t in _divisors(domain) if model.num_heads % t == 0]
    eps = _divisors(model.num_experts) if model.is_moe else [1]
    max_pp = min(model.num_layers, space.max_pp)
    for tp in tps:
        for cp in cps:
            if capacity.is_mixed:  # a type's leftover accelerators may stay idle
                pps = range(1, max_pp + 1)
            else:  # a homogeneous fleet is filled exactly, so pp divides it
                pps = [p for p in _divisors(max(1, capacity.total // (tp * cp))) if p <= max_pp] \
                    if capacity.total % (tp * cp) == 0 else []
            for pp in pps:
                for ep in eps:
                    etps = sorted({1, tp}) if space.expert_tp_options == "1_or_tp" else [1]
                    for etp in etps if model.is_moe else [1]:
                        yield tp, cp, pp, ep, etp


def _replica_layout(model: ModelSpec, capacity: FleetCapacity, replica_size: int, mbs: int
                    ) -> tuple[int, tuple[str, ...] | None, tuple[int, ...] | None] | str:
    """(dp, replica types, micro-batches per replica) or a reason string."""
    if not capacity.is_mixed:
        (type_name, count), = ((t, c) for t, c in capacity.counts.items() if c)
        if count % replica_size:
            return f"fleet size: {count} accelerators is not a multiple of tp*cp*pp={replica_size}"
        dp = count // replica_size
        if model.global_batch_sequences % (dp * mbs):
            return f"batch: global batch {model.global_batch_sequences} not divisible by dp*mbs={dp * mbs}"
        return dp, None, None
    types: list[str] = []
    for type_name in sorted(capacity.counts):
        types += [type_name] * (capacity.counts[type_name] // replica_size)
    if not types:
        return f"fleet size: no accelerator type has tp*cp*pp={replica_size} accelerators"
    total_mb = model.global_batch_sequences // mbs
    if model.global_batch_sequences % mbs or total_mb < len(types):
        return f"batch: {model.global_batch_sequences} sequences cannot feed {len(types)} replicas at mbs={mbs}"
    speeds = [capacity.accelerators[t].peak_tflops(model.precision) for t in types]
    exact = [total_mb * s / sum(speeds) for s in speeds]
    counts = [max(1, int(e)) for e in exact]
    order = sorted(range(len(types)), key=lambda i: counts[i] - exact[i])
    i = 0
    while sum(counts) != total_mb:  # largest remainder, keeping every replica >= 1
        j = order[i % len(order)]
        step = 1 if sum(counts) < total_mb else -1
        if counts[j] + step >= 1:
            counts[j] += step
        i += 1
    return len(types), tuple(types), tuple(counts)


def _build_plan(model: ModelSpec, capacity: FleetCapacity, shape: tuple[int, int, int, int, int], mbs: int,
                recompute: str, space: SearchSpace) -> ParallelPlan | str:
    tp, cp, pp, ep, etp = shape
    found = _replica_layout(model, capacity, tp * cp * pp, mbs)
    if isinstance(found, str):
        return found
    dp, types, microbatches = found
    plan = ParallelPlan(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, micro_batch_size=mbs, recompute=recompute,
                        stage_starts=tuple(range(pp)), zero_stage=space.zero_ladder[0],
                        replica_accelerators=types, replica_microbatches=microbatches, **space.runtime())
    try:
        validate_plan(plan, model, scaleup_domain_size=capacity.min_domain)
    except SpecError as err:
        return f"{err.field.split('.')[-1]}: {err}"
    if types is not None and ep * etp > tp * cp:
        group = ep * etp // (tp * cp)
        if any(types[i] != types[i - i % group] for i in range(len(types))) or len(types) % group:
            return "ep: an EP group would straddle accelerator types"
    return replace(plan, stage_starts=None)


def _accel_arg(capacity: FleetCapacity, plan: ParallelPlan):
    if plan.replica_accelerators is None:
        (name,) = [t for t, c in capacity.counts.items() if c]
        return capacity.accelerators[name]
    return capacity.accelerators


@dataclass(frozen=True)
class _Bound:
    """Lower bound on a shape's step time as a function of the micro-batch size.

    With latencies dropped, a micro-batch's work summed over stages is ``mbs * work_per_sequence``
    and the 1F1B pipeline takes ``sum_s T_s + (m - 1) max_s T_s >= W (1 + (m - 1) / pp)``, i.e.
    ``work_per_sequence * (mbs + (S - mbs) / pp)`` for ``S`` sequences per replica. Recompute,
    latency, imbalance and the DP/optimizer tail only add to it.
    """

    work_per_sequence: float
    sequences: float
    pp: int
    with_bubble: bool

    def at(self, mbs: int) -> float:
        if not self.with_bubble:
            return self.work_per_sequence * self.sequences / self.pp
        return self.work_per_sequence * (mbs + (self.sequences - mbs) / self.pp)

    @property
    def lowest(self) -> float:
        return min(self.at(1), self.work_per_sequence * self.sequences / self.pp)


def _lower_bound(model: ModelSpec, plan: ParallelPlan, capacity: FleetCapacity, params: CostParams,
                 max_mbs: int) -> _Bound:
    """No plan of this shape (any mbs <= ``max_mbs``, any recompute, any split) is faster than this.

    Work per sequence is priced at the largest micro-batch, where GEMMs are most efficient.
    """
    free = replace(params, intra_latency_s=0.0, inter_latency_s=0.0)
    probe = replace(plan, micro_batch_size=max_mbs, recompute="none", stage_starts=None)
    groups: dict[str, float] = {}
    if plan.replica_accelerators is None:
        (name,) = [t for t, c in capacity.counts.items() if c]
        groups[name] = model.global_batch_sequences / plan.dp
    else:
        for name, mb in zip(plan.replica_accelerators, plan.replica_microbatches or ()):
            # micro-batch shares are rounded per mbs; stay safely below any of them
            share = 0.9 * mb * plan.micro_batch_size
            groups[name] = min(groups.get(name, share), share)
    bounds = []
    for name, sequences in groups.items():
        accel = capacity.accelerators[name]
        embed, head = edge_times(model, probe, accel, free)
        work = (sum(t.total for t in layer_times(model, probe, accel, free)) + embed + head) / max_mbs
        bounds.append(_Bound(work, sequences, plan.pp, with_bubble=plan.replica_accelerators is None))
    return max(bounds, key=lambda b: b.lowest)


def _min_memory_fits(model: ModelSpec, plan: ParallelPlan, capacity: FleetCapacity, params: CostParams) -> str | None:
    """Reason string when no split, micro-batch size or recompute can fit; None if one may.

    Weights, gradients and optimizer states summed over stages do not depend on the split, so
    their mean over stages bounds the fullest stage from below (activations only add).
    """
    probe = replace(plan, recompute="full",
                    stage_starts=tuple(round(i * model.num_layers / plan.pp) for i in range(plan.pp)))
    static = 0.0
    for s in range(plan.pp):
        mem = stage_memory(model, probe, s, num_microbatches=1, params=params, counts=stage_param_counts(model, probe, s))
        static += mem.weights + mem.gradients + mem.optimizer
    need = static / plan.pp
    for name in set(plan.replica_accelerators or [t for t, c in capacity.counts.items() if c]):
        usable = capacity.accelerators[name].hbm_gib * GIB * params.usable_memory_fraction
        if need > usable:
            return (f"memory: weights, gradients and optimizer states alone need {need / GIB:.1f} GiB per device "
                    f"> {usable / GIB:.1f} GiB usable on {name}")
    return None


def _best_of_shape(model: ModelSpec, capacity: FleetCapacity, shape, space: SearchSpace, params: CostParams,
                   exhaustive: bool, bound: _Bound | None = None, cutoff: float = float("inf")
                   ) -> tuple[PlanCost | None, str | None]:
    """The fastest fitting (mbs, recompute) choice of ``shape``; when not ``exhaustive``, skips
    micro-batch sizes whose bound reaches ``cutoff`` and stops at the first recompute that fits."""
    best: PlanCost | None = None
    reason: str | None = None
    for mbs in sorted(space.micro_batch_sizes):
        if not exhaustive and bound is not None and bound.at(mbs) >= min(cutoff, best.step_time_s if best else cutoff):
            continue
        fitted = False
        for recompute in space.recompute:
            plan = _build_plan(model, capacity, shape, mbs, recompute, space)
            if isinstance(plan, str):
                reason = reason or plan
                break
            accel = _accel_arg(capacity, plan)
            plan = balanced_plan(model, plan, slowest_accelerator(model, plan, accel), params)
            mem, mem_type, usable = plan_memory(model, plan, accel, params=params)  # cheap: check it first
            if mem.total > usable:
                reason = reason or f"memory: {mem.total / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable on {mem_type}"
                continue
            fitted = True
            cost = evaluate_plan(model, plan, accel, params=params)
            if best is None or cost.step_time_s < best.step_time_s:
                best = cost
            if not exhaustive:
                break  # slower recompute modes cannot beat the first one that fits
        if not fitted and not exhaustive and reason and reason.startswith("memory"):
            break  # activations only grow with the micro-batch: larger ones cannot fit either
    return best, (None if best else reason)


def _describe(shape) -> str:
    tp, cp, pp, ep, etp = shape
    return f"TP{tp} CP{cp} PP{pp} EP{ep} ETP{etp}"


def mixed_fleet_search(model: ModelSpec, capacity: FleetCapacity, *, top_k: int, params: CostParams,
                       space: SearchSpace, exhaustive: bool = False
                       ) -> tuple[list[PlanCost], list[Rejection], int, int]:
    """(plans, rejections, shapes considered, shapes pruned): the ``top_k`` fastest plans that
    use every free accelerator of a mixed fleet (leftovers below one replica stay idle), by
    branch and bound; ``exhaustive`` prices every shape (the test oracle)."""
    candidates: list[tuple[_Bound, tuple, ParallelPlan]] = []
    rejected: list[Rejection] = []
    num_shapes = 0
    for shape in _shapes(model, capacity, space):
        num_shapes += 1
        plan = None
        for mbs in space.micro_batch_sizes:  # any micro-batch size that makes the shape valid
            plan = _build_plan(model, capacity, shape, mbs, "none", space)
            if not isinstance(plan, str):
                break
        if isinstance(plan, str):
            rejected.append(Rejection(_describe(shape), plan))
            continue
        if exhaustive:
            best, reason = _best_of_shape(model, capacity, shape, space, params, exhaustive=True)
            if best is None:
                rejected.append(Rejection(_describe(shape), reason or "no valid micro-batch size"))
            else:
                candidates.append((None, shape, best))  # type: ignore[arg-type]
            continue
        too_big = _min_memory_fits(model, replace(plan, micro_batch_size=1), capacity, params)
        if too_big:
            rejected.append(Rejection(_describe(shape), too_big))
            continue
        candidates.append((_lower_bound(model, plan, capacity, params, max(space.micro_batch_sizes)), shape, plan))
    if exhaustive:
        return [c[2] for c in candidates], rejected, num_shapes, 0  # type: ignore[misc]
    candidates.sort(key=lambda c: c[0].lowest)
    heap: list[float] = []  # negated step times of the best top_k
    found: list[PlanCost] = []
    pruned = 0
    for i, (bound, shape, _) in enumerate(candidates):
        cutoff = -heap[0] if len(heap) >= top_k else float("inf")
        if bound.lowest >= cutoff:
            pruned += len(candidates) - i
            break
        best, reason = _best_of_shape(model, capacity, shape, space, params, exhaustive=False, bound=bound,
                                      cutoff=cutoff)
        if best is None and reason is None:
            pruned += 1  # every micro-batch size was bounded out: feasible but slower than the top k
            continue
        if best is None:
            rejected.append(Rejection(_describe(shape), reason or "no valid micro-batch size"))
            continue
        found.append(best)
        heapq.heappush(heap, -best.step_time_s)
        if len(heap) > top_k:
            heapq.heappop(heap)
    return found, rejected, num_shapes, pruned

