"""Plan search: the best feasible parallel plans for a model on a fleet -- including how many
accelerators to take -- and why the rest fail.

Design decisions:
- A candidate is a shape ``(tp, cp, ep, etp)`` x ``pp`` x ``dp``; its size ``tp*cp*pp*dp`` is
  free within :meth:`JobGoal.size_range`, so a 100,000-accelerator fleet is a budget, not an
  obligation. Per candidate the search picks micro-batch size, virtual stages, recompute, ZeRO
  stage, optimizer-state dtype and cached-activation dtype. Plans are ranked one per shape, so the list offers genuinely
  different splits.
- Branch and bound, exact with respect to the cost model: per core ``(tp, cp, ep, etp)`` the
  work of one sequence through the whole model at the most efficient micro-batch (no latency,
  no recompute) is priced once; a candidate's step can be no shorter than that work spread over
  ``pp`` stages plus the smallest interleaved fill/drain:
  ``W * (S + mbs * (pp - 1) / vpp_max) / pp`` for ``S = batch / dp`` sequences per replica.
  Candidates are visited in bound order (step time, or accelerator-seconds for "throughput"),
  and the search stops when the bound reaches the k-th best found. A memory bound (weights,
  gradients and optimizer states at the most sharding allowed, averaged over stages) rejects
  candidates before any pricing. :func:`brute_force_plans` prices everything: the test oracle.
  The bounds and the memory checks live in :mod:`rayfleet.placement.search_bounds`.
- Within a candidate: ZeRO stages and state / activation dtypes only trade communication (or
  precision) for memory (ZeRO-1 <= 2 <= 3 in time), so for each recompute mode the first rung of that ladder that
  fits is its best; recompute modes go cheapest first and stop once the lightest rung fits.
- "fastest" with a scaling-efficiency floor runs twice: first the plan with the fewest
  accelerator-seconds per step (the best tokens/s per accelerator), then the fastest plan
  within ``best / min_scaling_efficiency`` accelerator-seconds; ``min_mfu`` is the same kind of cap.
- Mixed fleets: :mod:`rayfleet.placement.mixed_fleet` for plans over all types, plus each type
  alone through this search; the better plans win.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from rayfleet.errors import SpecError
from rayfleet.placement.cost_model import GIB, PlanCost, balanced_plan, evaluate_plan
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.mixed_fleet import mixed_fleet_search
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.pipeline_schedule import dualpipe_possible, interleaving_possible, pipeline_seconds
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.search_dead_ends import size_dead_ends
from rayfleet.placement.search_results import JobSize, PlanSearchResult, RankedPlan, Rejection
from rayfleet.placement.search_bounds import (_Candidate, _fits_by_vpp, _ladder, _refine, _refined_step_bound,
                                              _static_bytes_floor, _vpps, _with_rung, _work, _work_per_sequence)
from rayfleet.placement.search_space import (JobGoal, Objective, SearchSpace, core_shapes, data_parallel_degrees,
                                             pipeline_degrees)
from rayfleet.placement.step_time_model import exposed_p2p
from rayfleet.platform.catalogue import AcceleratorSpec

__all__ = ["RankedPlan", "Rejection", "PlanSearchResult", "SearchSpace", "JobGoal", "JobSize", "search_plans",
           "brute_force_plans"]


def _key(cost: PlanCost, objective: Objective) -> tuple[float, float, tuple]:
    accel_s = cost.step_time_s * cost.plan.world_size
    main = accel_s if objective == "throughput" else cost.step_time_s
    return (main, cost.step_time_s, cost.plan.shape())


def _candidates(model: ModelSpec, accel: AcceleratorSpec, lo: int, hi: int, space: SearchSpace,
                params: CostParams) -> tuple[list[_Candidate], list[Rejection], int]:
    """Every (core, pp, dp) whose size lies in [lo, hi], with its bound, minus the shapes that
    are invalid or cannot fit memory however they are configured."""
    out: list[_Candidate] = []
    rejected: list[Rejection] = []
    num_shapes = 0
    usable = accel.hbm_gib * GIB * params.usable_memory_fraction
    gbs = model.global_batch_sequences
    for core in core_shapes(model, accel.scaleup_domain_size, space):
        width = core.tp * core.cp
        pps = pipeline_degrees(model, space, exact_world=lo if lo == hi else None, replica_width=width)
        work: float | None = None
        for pp in pps:
            dps = data_parallel_degrees(model, core, pp, lo, hi, space)
            if not dps:
                continue
            probe = ParallelPlan(tp=core.tp, cp=core.cp, pp=pp, dp=dps[0], ep=core.ep, etp=core.etp,
                                 micro_batch_size=min(space.micro_batch_sizes), stage_starts=tuple(range(pp)))
            try:
                validate_plan(probe, model, scaleup_domain_size=accel.scaleup_domain_size)
            except SpecError as err:
                num_shapes += len(dps)
                rejected.append(Rejection(f"TP{core.tp} CP{core.cp} PP{pp} EP{core.ep} ETP{core.etp}",
                                          f"{err.field.split('.')[-1]}: {err}"))
                continue
            if work is None:
                work = _work_per_sequence(model, core, accel, params, max(space.micro_batch_sizes))
            vmax = max(_vpps(model, pp, space))
            if space.dualpipe and pp > 1 and 2 * pp <= model.num_layers:
                # DualPipeV's bubble, (pp - 1)(t + B - 3W) / 2, has no floor as simple as
                # interleaving's: bound its fill/drain by zero
                vmax = math.inf
            for dp in dps:
                num_shapes += 1
                cand = _Candidate(core, pp, dp, work, gbs / dp, vmax)
                need = _static_bytes_floor(model, core, pp, dp, space, params)
                if need > usable:
                    rejected.append(Rejection(cand.describe(), f"memory: weights, gradients and optimizer states "
                                              f"alone need {need / GIB:.1f} GiB per device > {usable / GIB:.1f} GiB "
                                              f"usable on {accel.name}"))
                    continue
                out.append(cand)
    return out, rejected, num_shapes


def _configurations(model: ModelSpec, plan: ParallelPlan, fits: list[tuple[int, list[int]]],
                    ladder: list[tuple[int, str, str]], accel: AcceleratorSpec, params: CostParams,
                    exhaustive: bool, dualpipe: bool = False) -> list[ParallelPlan]:
    """:func:`_virtual_stage_choices`, plus DualPipeV at the rungs that fit without virtual
    stages when ``dualpipe`` allows it (same memory as 1F1B; priced directly)."""
    out = _virtual_stage_choices(model, plan, fits, ladder, accel, params, exhaustive)
    m = plan.num_microbatches(model.global_batch_sequences)
    # two chunks a rank: every rank of the balanced split needs two layers (the trainer refuses
    # fewer; DeepSeek-V3's 61 layers at PP16 leave the head's rank one)
    if dualpipe and dualpipe_possible(m, plan.pp) and 2 * plan.pp <= model.num_layers \
            and min(len(r) for r in plan.stage_ranges(model.num_layers)) >= 2:
        plain = [rungs for v, rungs in fits if v == 1]
        if plain:
            out += [_with_rung(plan, ladder[r], dualpipe=True) for r in (plain[0] if exhaustive else plain[0][:1])]
    return out


def _virtual_stage_choices(model: ModelSpec, plan: ParallelPlan, fits: list[tuple[int, list[int]]],
                           ladder: list[tuple[int, str, str]], accel: AcceleratorSpec, params: CostParams,
                           exhaustive: bool) -> list[ParallelPlan]:
    """The plans worth pricing among ``fits`` ((virtual stages, fitting rungs) pairs).

    Virtual stages change the pipeline term -- every stage's micro-batch time grows by one send
    per extra chunk and the fill/drain shrinks ``vpp`` times (see step_time_model) -- and, for
    MoE plans, whether the EP all-to-all can hide (only with ``vpp > 1``). So one pricing per rung
    at ``vpp = 1`` and one at the smallest ``vpp > 1`` give every ``vpp`` in closed form; only
    the winner is priced again. ``exhaustive`` returns every pair (the oracle checks the closed form)."""
    if exhaustive:
        return [_with_rung(plan, ladder[r], vpp=v)
                for v, rungs in fits for r in rungs]
    if len(fits) == 1:
        (v, (r, *_)), = fits
        return [_with_rung(plan, ladder[r], vpp=v)]
    interleaved = min((v for v, _ in fits if v > 1), default=1)
    base: dict[tuple[int, int], PlanCost] = {}
    best: tuple[float, int, int] | None = None
    for v, (r, *_) in fits:
        vb = 1 if v == 1 else interleaved
        if (r, vb) not in base:
            base[r, vb] = evaluate_plan(model, _with_rung(plan, ladder[r], vpp=vb), accel, params=params)
        t = _step_at_vpp(base[r, vb], model, v, params)
        if best is None or t < best[0]:
            best = (t, v, r)
    assert best is not None
    _, v, r = best
    return [_with_rung(plan, ladder[r], vpp=v)]


def _step_at_vpp(one: PlanCost, model: ModelSpec, vpp: int, params: CostParams) -> float:
    """``one``'s step time (priced at its own ``vpp``) with ``vpp`` virtual stages instead, for
    a ``vpp`` on the same side of 1 (the EP overlap and the send schedule do not change)."""
    step, vb = one.step, one.plan.vpp
    m = one.plan.num_microbatches(model.global_batch_sequences)
    stages = [t - exposed_p2p(step.pp_send_s, vb, c, params) + exposed_p2p(step.pp_send_s, vpp, c, params)
              for t, c in zip(step.stage_microbatch_s, step.stage_compute_s)]
    before = pipeline_seconds(step.stage_microbatch_s, num_microbatches=m, vpp=vb)
    return step.total - before + pipeline_seconds(stages, num_microbatches=m, vpp=vpp)


def _best_of(model: ModelSpec, accel: AcceleratorSpec, cand: _Candidate, space: SearchSpace, params: CostParams,
             objective: Objective, *, cutoff: float, accel_s_cap: float, exhaustive: bool, lightest: int = 0
             ) -> tuple[PlanCost | None, str | None]:
    """The best fitting configuration of ``cand`` (micro-batch, virtual stages, recompute, ZeRO,
    optimizer dtype) under ``accel_s_cap`` accelerator-seconds per step; (None, reason) if none.

    Stage boundaries are balanced once per (micro-batch, virtual stages) without recompute
    (recompute scales every layer's compute alike, so the split barely moves)."""
    c = cand.core
    best: PlanCost | None = None
    reason: str | None = None
    ladder = _ladder(space)
    usable = accel.hbm_gib * GIB * params.usable_memory_fraction
    for mbs in sorted(space.micro_batch_sizes):
        if model.global_batch_sequences % (cand.dp * mbs):
            continue
        bound = cand.key_bound(objective, mbs)
        if not exhaustive and bound >= min(cutoff, _key(best, objective)[0] if best else cutoff):
            continue
        any_fit = bounded = False
        base = ParallelPlan(tp=c.tp, cp=c.cp, pp=cand.pp, dp=cand.dp, ep=c.ep, etp=c.etp, micro_batch_size=mbs,
                            **space.runtime())
        # one split per candidate: virtual stages move it only through the EP overlap (MoE layers
        # weigh less once it hides), a second-order effect the oracle shares
        split = balanced_plan(model, base, accel, params)
        for recompute in space.recompute[lightest:]:
            if not exhaustive:  # this micro-batch and recompute's own work bound (heavier only adds)
                work = _work(model, c, accel, params, mbs, recompute)[0]
                step = cand.pipeline_floor(work, mbs)
                if step * (cand.world if objective == "throughput" else 1) >= min(
                        cutoff, _key(best, objective)[0] if best else cutoff) or step * cand.world > accel_s_cap:
                    bounded = True
                    break
            plan = split.but(recompute=recompute)
            # Megatron interleaves only a full pipeline (m >= pp): see pipeline_schedule
            vpps = _vpps(model, cand.pp, space) if interleaving_possible(
                model.global_batch_sequences // (cand.dp * mbs), cand.pp) else [1]
            # every chunk needs a layer of the balanced split, not of an even one (the trainer
            # refuses a rank with fewer layers than chunks: pipeline_chunks); DeepSeek-V3's 61
            # layers at PP2 split 32/29, so VP30 is out
            fewest = min(len(r) for r in split.stage_ranges(model.num_layers))
            vpps = [v for v in vpps if v <= fewest] or [1]
            fits = [(vpp, rungs) for vpp, rungs in _fits_by_vpp(model, plan, vpps, ladder,
                                                                 usable, params, first_only=not exhaustive) if rungs]
            if not fits:
                reason = reason or f"memory: does not fit {usable / GIB:.1f} GiB usable on {accel.name}"
                continue
            any_fit = True
            for trial in _configurations(model, plan, fits, ladder, accel, params, exhaustive, space.dualpipe):
                cost = evaluate_plan(model, trial, accel, params=params)
                if cost.step_time_s * cand.world > accel_s_cap:
                    reason = reason or "efficiency: below the scaling-efficiency / MFU floor"
                elif best is None or _key(cost, objective) < _key(best, objective):
                    best = cost
            if any(rungs[0] == 0 for _, rungs in fits) and not exhaustive:
                break  # heavier recompute only adds time once the lightest rung fits
        if not any_fit and not bounded and not exhaustive:
            break  # nothing fit: activations only grow with the micro-batch
    return best, (None if best else reason)


@dataclass
class _Search:
    found: list[PlanCost]
    rejected: list[Rejection]
    num_pruned: int = 0


def _branch_and_bound(model: ModelSpec, accel: AcceleratorSpec, cands: list[_Candidate], space: SearchSpace,
                      params: CostParams, objective: Objective, *, top_k: int, accel_s_cap: float,
                      exhaustive: bool, refined: dict | None = None) -> _Search:
    mbs_min = min(space.micro_batch_sizes)
    order = sorted(cands, key=lambda c: (c.key_bound(objective, mbs_min), c.world))
    heap: list[float] = []  # negated objective values of the best top_k
    out = _Search([], [])
    refined = {} if refined is None else refined  # candidate -> _Refined, shared by both passes
    for i, cand in enumerate(order):
        if cand.step_bound(mbs_min) * cand.world > accel_s_cap and not exhaustive:
            out.num_pruned += 1  # cannot meet the efficiency floor
            continue
        cutoff = -heap[0] / (1 + space.optimality_gap) if len(heap) >= top_k else math.inf
        if not exhaustive and cand.key_bound(objective, mbs_min) >= cutoff:
            out.num_pruned += len(order) - i
            break
        lightest = 0
        if not exhaustive:
            if cand not in refined:
                refined[cand] = _refine(model, accel, cand, space, params)
            need = refined[cand]
            if need is None:
                out.rejected.append(Rejection(cand.describe(), f"memory: does not fit {accel.hbm_gib:.0f} GiB "
                                              f"{accel.name} with any recompute, ZeRO stage or micro-batch"))
                continue
            lightest = need.lightest_recompute
            step = _refined_step_bound(model, accel, cand, need, space, params)
            if step * (cand.world if objective == "throughput" else 1) >= cutoff or step * cand.world > accel_s_cap:
                out.num_pruned += 1  # the recompute or sharding it needs makes it lose
                continue
        best, reason = _best_of(model, accel, cand, space, params, objective, cutoff=cutoff,
                                accel_s_cap=accel_s_cap, exhaustive=exhaustive, lightest=lightest)
        if best is None:
            if reason is None:
                out.num_pruned += 1  # every micro-batch size was bounded out
            else:
                out.rejected.append(Rejection(cand.describe(), reason))
            continue
        out.found.append(best)
        heapq.heappush(heap, -_key(best, objective)[0])
        if len(heap) > top_k:
            heapq.heappop(heap)
    return out


def _homogeneous(model: ModelSpec, capacity: FleetCapacity, goal: JobGoal, *, top_k: int, params: CostParams,
                 space: SearchSpace, exhaustive: bool) -> PlanSearchResult:
    (name, free), = ((t, n) for t, n in capacity.counts.items() if n)
    accel = capacity.accelerators[name]
    lo, hi = goal.size_range(free)
    if lo > free:
        raise SpecError("min_accelerators", lo, f"the fleet has only {free} free {name}",
                        "lower min_accelerators or free more of the fleet")
    cands, rejected, num_shapes = _candidates(model, accel, lo, hi, space, params)
    if not cands and not rejected:  # no shape at all: say which rule ruled out which shape
        rejected = size_dead_ends(model, accel.scaleup_domain_size, lo, hi, space)
        num_shapes = len(rejected)
    cap = math.inf
    if goal.min_mfu > 0:
        cap = model.global_batch_tokens * 3 * model.model_forward_flops_per_token() / (
            accel.peak_tflops(model.precision) * 1e12 * goal.min_mfu)
    best_rate = 0.0
    refined: dict = {}
    if goal.objective == "fastest" and goal.min_scaling_efficiency > 0 and lo < hi:
        # the floor's reference needs little precision: found within 15% of the best, an 80%
        # floor holds at >= 70% (0.8 / 1.15) of the true best, and this pass prunes earlier
        reference = replace(space, optimality_gap=max(space.optimality_gap, 0.15))
        efficient = _branch_and_bound(model, accel, cands, reference, params, "throughput", top_k=1,
                                      accel_s_cap=cap, exhaustive=exhaustive, refined=refined)
        if efficient.found:
            top = min(efficient.found, key=lambda c: _key(c, "throughput"))
            best_rate = top.tokens_per_s / top.plan.world_size
            cap = min(cap, top.step_time_s * top.plan.world_size / goal.min_scaling_efficiency)
    search = _branch_and_bound(model, accel, cands, space, params, goal.objective, top_k=top_k, accel_s_cap=cap,
                               exhaustive=exhaustive, refined=refined)
    found = sorted(search.found, key=lambda c: _key(c, goal.objective))[:top_k]
    ranked = tuple(RankedPlan(i + 1, c.plan, c) for i, c in enumerate(found))
    size = _job_size(model, ranked, goal, free, hi, best_rate, name) if ranked else None
    return PlanSearchResult(ranked, tuple(rejected + search.rejected), num_shapes, search.num_pruned, size)


def _job_size(model: ModelSpec, ranked: tuple[RankedPlan, ...], goal: JobGoal, free: int, hi: int,
              best_rate: float, name: str) -> JobSize:
    top = ranked[0]
    n = top.num_accelerators
    rate = top.tokens_per_s_per_accelerator
    plan = top.plan
    if goal.fill_fleet or goal.min_accelerators == hi:
        why = f"the job asked for exactly {n} {name}"
    elif goal.objective == "throughput":
        why = (f"most tokens/s per accelerator ({rate:,.0f}); more accelerators would add pipeline bubbles "
               f"or communication per token")
    elif n == hi:
        why = f"fastest step; it takes every accelerator it may ({'max_accelerators' if hi < free else 'the free fleet'})"
    elif plan.dp * plan.micro_batch_size == model.global_batch_sequences:
        why = (f"fastest step: the global batch of {model.global_batch_sequences} sequences feeds at most {plan.dp} "
               f"replicas of micro-batch {plan.micro_batch_size}; more accelerators per replica (TP/CP/PP) "
               + (f"would fall below {goal.min_scaling_efficiency:.0%} of the best {best_rate:,.0f} tokens/s per "
                  f"accelerator" if best_rate else "would be slower"))
    else:
        floor = f"{goal.min_scaling_efficiency:.0%} of the best {best_rate:,.0f} tokens/s per accelerator" if best_rate \
            else f"MFU >= {goal.min_mfu:.0%}"
        why = (f"fastest step that keeps {floor} ({rate:,.0f} here); larger jobs are faster only below that "
               f"(lower --min-scaling-efficiency, or set --max-accelerators, to trade efficiency for speed)")
    return JobSize(n, min(free, hi), why, best_rate)


def _merge(results: list[PlanSearchResult], objective: Objective, top_k: int) -> PlanSearchResult:
    found = sorted((r.cost for res in results for r in res.ranked), key=lambda c: _key(c, objective))[:top_k]
    ranked = tuple(RankedPlan(i + 1, c.plan, c) for i, c in enumerate(found))
    size = next((r.job_size for r in results if r.ranked and ranked and r.ranked[0].cost is ranked[0].cost), None)
    return PlanSearchResult(ranked, tuple(x for r in results for x in r.rejected), sum(r.num_shapes for r in results),
                            sum(r.num_pruned for r in results), size)


def _search(model: ModelSpec, capacity: FleetCapacity, goal: JobGoal, *, top_k: int, params: CostParams,
            space: SearchSpace, exhaustive: bool) -> PlanSearchResult:
    if top_k < 1:
        raise SpecError("top_k", top_k, "must be at least 1", "ask for one plan or more")
    if model.precision != "fp8" and space.activation_dtypes != ("bf16",):
        space = replace(space, activation_dtypes=("bf16",))  # FP8 caching needs FP8 GEMMs
    if not capacity.is_mixed:
        return _homogeneous(model, capacity, goal, top_k=top_k, params=params, space=space, exhaustive=exhaustive)
    found, rejected, shapes, pruned = mixed_fleet_search(model, capacity, top_k=top_k, params=params, space=space,
                                                         exhaustive=exhaustive)
    ranked = tuple(RankedPlan(i + 1, c.plan, c) for i, c in enumerate(sorted(found, key=lambda c: _key(c, "fastest"))))
    mixed = PlanSearchResult(ranked[:top_k], tuple(rejected), shapes, pruned,
                             JobSize(ranked[0].num_accelerators, capacity.total,
                                     "fastest step over every accelerator type together") if ranked else None)
    results = [mixed]
    if not goal.fill_fleet:
        for name, count in capacity.counts.items():
            if count:
                alone = FleetCapacity({name: capacity.accelerators[name]}, {name: count})
                results.append(_homogeneous(model, alone, goal, top_k=top_k, params=params, space=space,
                                            exhaustive=exhaustive))
    return _merge(results, goal.objective, top_k)


def search_plans(model: ModelSpec, capacity: FleetCapacity, *, top_k: int = 5, params: CostParams = CostParams(),
                 space: SearchSpace = SearchSpace(), goal: JobGoal | None = None) -> PlanSearchResult:
    """The ``top_k`` best feasible plans (one per shape) by branch and bound.

    ``goal`` ``None`` fills the free fleet exactly (a launcher given N workers); pass a
    :class:`JobGoal` to let the planner choose the size.
    """
    return _search(model, capacity, goal or JobGoal(fill_fleet=True), top_k=top_k, params=params, space=space,
                   exhaustive=False)


def brute_force_plans(model: ModelSpec, capacity: FleetCapacity, *, top_k: int = 5,
                      params: CostParams = CostParams(), space: SearchSpace = SearchSpace(),
                      goal: JobGoal | None = None) -> PlanSearchResult:
    """Every candidate x configuration priced; the oracle :func:`search_plans` must match."""
    return _search(model, capacity, goal or JobGoal(fill_fleet=True), top_k=top_k, params=params, space=space,
                   exhaustive=True)
