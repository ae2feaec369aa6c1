"""Bounds and memory checks of the plan search (:mod:`rayfleet.placement.planner`).

Design decisions:
- A candidate ``(tp, cp, ep, etp) x pp x dp`` carries the work of one sequence through the whole
  model at the most efficient micro-batch; its step can be no shorter than that work spread over
  ``pp`` stages plus the smallest interleaved fill/drain (:meth:`_Candidate.step_bound`).
- Memory is checked on a ladder of (ZeRO stage, Adam moment dtype, cached-activation dtype)
  rungs, plainest first; the check is :func:`rayfleet.placement.memory_model.stage_static_bytes`
  inlined over plain per-stage numbers (the planner's hottest loop; a unit test compares it with
  :func:`rayfleet.placement.cost_model.plan_memory`).
- :func:`_refine` finds what a candidate needs to fit at its least-memory configuration, and
  :func:`_refined_step_bound` turns that into a tighter bound (recompute work, the fullest stage,
  the least exposed ZeRO-2/3 traffic).

Units: seconds, bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate
from typing import Sequence

from rayfleet.placement.cost_model import GIB, balanced_plan
from rayfleet.placement.cost_params import CostParams, Link, hierarchical_allreduce_time, ring_time
from rayfleet.placement.memory_model import all_stage_activation_bytes, all_stage_param_counts
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan, even_stage_starts
from rayfleet.placement.search_space import CoreShape, Objective, SearchSpace
from rayfleet.placement.step_time_model import edge_times, layer_times
from rayfleet.platform.catalogue import AcceleratorSpec


@dataclass(frozen=True)
class _Candidate:
    core: CoreShape
    pp: int
    dp: int
    work_per_sequence: float  # seconds, whole model on one device, at the best micro-batch
    sequences: float  # per replica per step
    vpp_max: float  # the most fill/drain speed-up any schedule gets (inf where DualPipeV may run)

    @property
    def world(self) -> int:
        return self.core.tp * self.core.cp * self.pp * self.dp

    def pipeline_floor(self, work_per_sequence: float, mbs: int) -> float:
        """No pipeline of this candidate at micro-batch ``mbs`` (or larger) runs faster: equal
        stages of ``work_per_sequence * mbs / pp`` through ``pipeline_seconds``' formula (1), with
        the most virtual stages where interleaving runs (``m >= pp``) and none elsewhere (with
        ``m < pp`` the two branches of (1) agree at ``vpp = 1``: ``(m + pp - 1) * t``)."""
        vpp = self.vpp_max if self.sequences / mbs >= self.pp else 1
        return work_per_sequence * (self.sequences + mbs * (self.pp - 1) / vpp) / self.pp

    def step_bound(self, mbs: int) -> float:
        return self.pipeline_floor(self.work_per_sequence, mbs)

    def key_bound(self, objective: Objective, mbs: int) -> float:
        return self.step_bound(mbs) * (self.world if objective == "throughput" else 1)

    def describe(self) -> str:
        c = self.core
        return f"TP{c.tp} CP{c.cp} PP{self.pp} DP{self.dp} EP{c.ep} ETP{c.etp}"



def _vpps(model: ModelSpec, pp: int, space: SearchSpace) -> list[int]:
    """Virtual stages worth trying: those leaving 1-4 layers per chunk (what tuned recipes use:
    Llama-3 70B PP8 VP5, DeepSeek-V3 PP8 VP4, Qwen3-30B PP2 VP24), within ``space``."""
    if pp == 1:
        return [1]
    per_stage = model.num_layers / pp
    wanted = {1, 2} | {max(1, round(per_stage / k)) for k in (1, 2, 3, 4)}
    allowed = set(space.virtual_stages) | ({v for v in wanted if v > max(space.virtual_stages)}
                                            if max(space.virtual_stages) > 1 else set())
    return sorted(v for v in wanted & allowed if pp * v <= model.num_layers) or [1]


def _static_bytes_floor(model: ModelSpec, core: CoreShape, pp: int, dp: int, space: SearchSpace,
                        params: CostParams) -> float:
    """Weights + gradients + optimizer states per device averaged over stages, at the most
    sharding the space allows: no split, micro-batch or recompute choice gets below it."""
    counts = all_stage_param_counts(model, ParallelPlan(tp=core.tp, ep=core.ep, etp=core.etp))[0]
    z = max(space.zero_ladder)
    opt = min(params.optimizer_bytes if d == "fp32" else params.optimizer_bytes_bf16 for d in space.optimizer_dtypes)
    weight = params.weight_bytes(model.precision)
    edp = core.tp * core.cp * dp // (core.ep * core.etp)
    total = 0.0
    for n, shard in ((counts.dense, dp * core.cp), (counts.expert, edp)):
        total += n * (weight / (shard if z >= 3 else 1) + params.grad_bytes / (shard if z >= 2 else 1)
                      + opt / (shard if z >= 1 else 1))
    return total / pp


@lru_cache(maxsize=8192)
def _work(model: ModelSpec, core: CoreShape, accel: AcceleratorSpec, params: CostParams, mbs: int,
          recompute: str = "none") -> tuple[float, tuple[float, ...]]:
    """(whole model, prefix sums of the layers cheapest first) seconds per sequence on one device
    at micro-batch ``mbs``, latencies dropped: larger micro-batches only run GEMMs more
    efficiently, so both fall with mbs."""
    free = replace(params, intra_latency_s=0.0, inter_latency_s=0.0)
    probe = ParallelPlan(tp=core.tp, cp=core.cp, ep=core.ep, etp=core.etp, dp=core.ep * core.etp,
                         micro_batch_size=mbs, recompute=recompute)
    embed, head = edge_times(model, probe, accel, free)
    times = sorted(t.total / mbs for t in layer_times(model, probe, accel, free))
    return sum(times) + (embed + head) / mbs, tuple(accumulate(times, initial=0.0))


def _work_per_sequence(model: ModelSpec, core: CoreShape, accel: AcceleratorSpec, params: CostParams,
                       max_mbs: int) -> float:
    return _work(model, core, accel, params, max_mbs)[0]



def _ladder(space: SearchSpace) -> list[tuple[int, str, str]]:
    """(ZeRO stage, optimizer dtype, activation dtype) rungs, the plainest first: each later
    rung trades communication or precision for memory, so the first that fits is the one taken."""
    return [(z, d, a) for z in space.zero_ladder for d in space.optimizer_dtypes for a in space.activation_dtypes]


def _with_rung(plan: ParallelPlan, rung: tuple[int, str, str], **changes) -> ParallelPlan:
    return plan.but(zero_stage=rung[0], optimizer_dtype=rung[1], activation_dtype=rung[2], **changes)


def _fitting_rungs(model: ModelSpec, plan: ParallelPlan, ladder: list[tuple[int, str, str]], usable: float,
                   params: CostParams, *, first_only: bool) -> list[int]:
    """Indices of the (ZeRO stage, optimizer dtype, activation dtype) rungs under which ``plan``
    (stage_starts set) fits ``usable`` bytes on every stage."""
    return _fits_by_vpp(model, plan, (plan.vpp,), ladder, usable, params, first_only=first_only)[0][1]


def _fits_by_vpp(model: ModelSpec, plan: ParallelPlan, vpps: Sequence[int], ladder: list[tuple[int, str, str]],
                 usable: float, params: CostParams, *, first_only: bool) -> list[tuple[int, list[int]]]:
    """(virtual stages, :func:`_fitting_rungs`) for each of ``vpps``.

    The planner's hottest loop: static bytes are :func:`stage_static_bytes` inlined over plain
    per-stage numbers and computed once per rung for all ``vpps`` (virtual stages change only
    activations); activations come memoised per (vpp, dtype). The unit tests compare this
    with :func:`plan_memory`."""
    counts = all_stage_param_counts(model, plan)
    starts = plan.stage_starts or even_stage_starts(model.num_layers, plan.pp)
    layers = [b - a for a, b in zip(starts, starts[1:] + (model.num_layers,))]
    m = plan.num_microbatches(model.global_batch_sequences)
    dense_shard, expert_shard = plan.dp * plan.cp, plan.edp
    weight = params.weight_bytes(model.precision)
    dense, expert = [c.dense for c in counts], [c.expert for c in counts]
    total, per_layer = [c.total for c in counts], [c.total / max(1, n) for c, n in zip(counts, layers)]
    statics: dict[int, list[float]] = {}
    out: list[tuple[int, list[int]]] = []
    for vpp in vpps:
        acts: dict[str, tuple[float, ...]] = {}
        rungs = []
        for i, (zero, dtype, act) in enumerate(ladder):
            if act not in acts:
                acts[act] = all_stage_activation_bytes(model, plan, num_microbatches=m, params=params, vpp=vpp,
                                                       activation_dtype=act)
            if i not in statics:
                opt = params.optimizer_bytes if dtype == "fp32" else params.optimizer_bytes_bf16
                # bytes per dense / expert parameter; the unsharded ones count once in `whole`
                per_dense = per_expert = whole = 0.0
                for b, on in ((weight, zero >= 3), (params.grad_bytes, zero >= 2), (opt, zero >= 1)):
                    if on:
                        per_dense += b / dense_shard
                        per_expert += b / expert_shard
                    else:
                        whole += b
                gathered = 2 * weight if zero >= 3 else 0.0  # prefetch keeps two layers gathered
                statics[i] = [d * per_dense + e * per_expert + t * whole + g * gathered
                              for d, e, t, g in zip(dense, expert, total, per_layer)]
            if all(st + a <= usable for st, a in zip(statics[i], acts[act])):
                rungs.append(i)
                if first_only:
                    break
        out.append((vpp, rungs))
    return out


@dataclass(frozen=True)
class _Refined:
    """What a candidate needs to fit memory, found at its least-memory configuration (smallest
    micro-batch, no virtual stages): the lightest recompute mode that fits with any rung, and the
    lightest rung that fits with the heaviest recompute -- no configuration needs less."""

    lightest_recompute: int
    lightest_rung: int
    largest_mbs: tuple[int, ...]  # per recompute mode from the lightest that fits


def _refine(model: ModelSpec, accel: AcceleratorSpec, cand: _Candidate, space: SearchSpace,
            params: CostParams) -> _Refined | None:
    c = cand.core
    base = ParallelPlan(tp=c.tp, cp=c.cp, pp=cand.pp, dp=cand.dp, ep=c.ep, etp=c.etp,
                        micro_batch_size=min(space.micro_batch_sizes))
    plan = balanced_plan(model, base, accel, params)
    usable = accel.hbm_gib * GIB * params.usable_memory_fraction
    ladder = _ladder(space)
    for i, recompute in enumerate(space.recompute):
        rungs = _fitting_rungs(model, plan.but(recompute=recompute), ladder, usable, params, first_only=True)
        if rungs:
            heaviest = plan.but(recompute=space.recompute[-1])
            rung = rungs[0] if i == len(space.recompute) - 1 else \
                _fitting_rungs(model, heaviest, ladder, usable, params, first_only=True)[0]
            largest = tuple(max(space.micro_batch_sizes) for rc in space.recompute[i:])
            return _Refined(i, rung, largest)
    return None


def _refined_step_bound(model: ModelSpec, accel: AcceleratorSpec, cand: _Candidate, need: _Refined,
                        space: SearchSpace, params: CostParams) -> float:
    """No configuration of ``cand`` that fits memory steps faster than this: work at the largest
    micro-batch that fits, with the lightest recompute that fits, over a pipeline whose slowest
    stage holds at least ``ceil(L / pp)`` layers, plus the least ZeRO-2/3 exposure it needs."""
    mbs_min = min(space.micro_batch_sizes)
    fullest = -(-model.num_layers // cand.pp)
    pipeline = math.inf
    for recompute, mbs in zip(space.recompute[need.lightest_recompute:], need.largest_mbs):
        work, prefix = _work(model, cand.core, accel, params, mbs, recompute)
        pipeline = min(pipeline, max(cand.pipeline_floor(work, mbs_min),
                                     cand.sequences * prefix[fullest]))
    zero = _ladder(space)[need.lightest_rung][0]
    return pipeline + _zero_floor(model, accel, cand, zero, params, max(need.largest_mbs))


def _zero_floor(model: ModelSpec, accel: AcceleratorSpec, cand: _Candidate, zero: int, params: CostParams,
                max_mbs: int) -> float:
    """Least exposed ZeRO-2/3 communication per step of ``cand`` under ``zero``: per micro-batch
    at least ``max(0, comm - compute)`` (``step_time_model._sharded_exposure`` adds the prefetch's
    first layer), summed over micro-batches is at least the sum's
    ``max(0, m * comm - total compute)``, smallest at the largest micro-batch; the
    slowest stage is at least the mean stage (parameters / pp, work / pp)."""
    if zero < 2:
        return 0.0
    c = cand.core
    probe = ParallelPlan(tp=c.tp, cp=c.cp, pp=cand.pp, dp=cand.dp, ep=c.ep, etp=c.etp, zero_stage=zero)
    whole = all_stage_param_counts(model, probe.but(pp=1, dp=c.ep * c.etp))[0]
    dense, expert = whole.dense / cand.pp, whole.expert / cand.pp
    free = replace(params, intra_latency_s=0.0, inter_latency_s=0.0)
    link, nic = Link.scaleup(accel, free), Link.scaleout(accel, free)
    domain = accel.scaleup_domain_size
    group = cand.dp * c.cp
    comm = hierarchical_allreduce_time(dense * params.grad_reduce_bytes, group, min(group, max(1, domain // c.tp)),
                                       link, nic) / 2
    comm += hierarchical_allreduce_time(expert * params.grad_reduce_bytes, probe.edp,
                                        min(probe.edp, max(1, domain // (c.ep * c.etp))), link, nic) / 2
    if zero >= 3:
        comm += 2 * ring_time((dense + expert) * params.param_bytes, group, link if group * c.tp <= domain else nic)
    m = cand.sequences / max_mbs
    return max(0.0, m * comm - cand.sequences * cand.work_per_sequence / cand.pp)
