"""Plan resolution, in one place: the plan a job runs with, explicit or searched, checked against memory.

``resolve_plan(model, request, capacity)`` is the single door from "a job asks for this" to "run
this :class:`ParallelPlan`". It takes placement's own frozen types only -- the model's shapes
(:class:`ModelSpec`), a :class:`PlanRequest` (the parallelism fields a job asks for) and the
fleet's :class:`FleetCapacity` -- and returns a frozen :class:`ResolvedPlan`. Nothing here knows a
job spec: ``rayfleet.jobs.planning`` translates its ``TrainJobSpec`` into a request once.

Worked example (the unit test ``tests/unit/placement/test_resolve.py`` runs it): the ``tiny``
model at 64 tokens, 8 sequences a step, on 4 H100s.

1. Explicit plan ``ep=2`` (``dp`` open): ``dp = 4 / (tp*cp*pp) = 4``; ``micro_batch_size`` from
   ``grad_accum`` (``8 / 4 / 2 = 1``) when given, else 1; :func:`validate_plan` checks the
   degrees against the model; the memory model prices the fullest device against usable HBM.
2. The same request on an accelerator too small for it raises ``SpecError("plan", "<plan>",
   "needs X GiB per device ... but a T has Y GiB usable", "use more accelerators (... at least N
   T ...)")``: the field, the value and the fix.
3. No explicit plan: the search over what the trainer runs (:data:`TRAINABLE_SPACE`, the
   capability table's :func:`runnable_space` with ZeRO-3 as its one rung; see there why) ranks
   the shapes; the fastest that honours ``grad_accum`` wins. Pipeline parallelism is tried
   only when no pipeline-free plan fits: PP adds bubbles, and at small scale the cost model's
   latency terms favour it for reasons that do not hold on real hardware.
4. An explicit pipeline whose ``pp`` does not divide the layers (DeepSeek-V3's 61 at PP4, as
   ``rayfleet plan`` ranks it) gets the planner's own balanced ``stage_starts``
   (:func:`balanced_plan`): the job spec has no field for them, and the split the planner
   priced is the one the trainer then runs.

An explicit plan using a kind the trainer does not run (``cp: 2``) is refused by the capability
table (:mod:`rayfleet.placement.capabilities`) with its reason and fix.

Errors name the job spec's fields (``plan``, ``grad_accum``, ``resources.num_workers``): a
request mirrors those fields one to one, and users only ever write the spec.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from rayfleet.errors import SpecError
from rayfleet.placement.capabilities import refusals, require_runnable, runnable_space
from rayfleet.placement.cost_model import GIB, balanced_plan, plan_memory
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.memory_model import MemoryBreakdown
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.pipeline_chunks import check_microbatches
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.planner import search_plans
from rayfleet.placement.search_space import SearchSpace
from rayfleet.platform.catalogue import AcceleratorSpec, get_accelerator

__all__ = ["RequestedPlan", "PlanRequest", "ResolvedPlan", "resolve_plan", "homogeneous_capacity"]

# What the trainer runs, from the capability table (runnable_space): TP, CP, EP, ETP, 1F1B and
# interleaved pipelines (pipelines in the fallback, see _searched); DualPipeV only where the
# planner's own space has it (--dualpipe; the table refuses it with ZeRO-3 anyway).
# One narrowing, on purpose: ZeRO-3 is the only rung. Measured (issue 28): with the table's
# ZeRO-1/2/3 ladder the cost model moves every searched job of examples/jobs and of the tiny and
# small presets at 1-8 workers to ZeRO-1 (less all-gather traffic), and DeepSeek-V3 on 2,048 H100
# from TP2 DP1024 EP16 ZeRO-3 to TP8 DP256 EP64 ZeRO-2. The trainer runs ZeRO-1 as ZeRO-2
# (parameters stay gathered from forward through backward), so every searched job would change
# its memory and FSDP2 layout at once, while the recovery paths searched jobs take (shared-memory
# restore, DCP reshard on an elastic resize) have run at ZeRO-3 only. Explicit plans take ZeRO-1/2
# (plan.zero_stage) and `rayfleet plan` ranks them. Widening the other kinds (CP, ETP, virtual
# stages) changed none of those jobs' plans (same measurement); Mixtral-8x7B on 1,024 H100 now
# gets EP8 x ETP4 (tests/unit/cli/test_plan_train_agree.py).
TRAINABLE_SPACE = runnable_space(SearchSpace(max_pp=1, zero_stage=3))


@dataclass(frozen=True)
class RequestedPlan:
    """Explicit degrees as a job asked for them; ``dp`` / ``micro_batch_size`` ``None`` = derive."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int | None = None
    recompute: str = "none"
    zero_stage: int = 3
    replica_microbatches: tuple[int, ...] | None = None
    replica_accelerators: tuple[str, ...] | None = None
    vpp: int = 1
    dualpipe: bool = False

    @property
    def replica_size(self) -> int:
        return self.tp * self.cp * self.pp

    def given(self) -> dict:
        """The fields that were set (what an error quotes as the value)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PlanRequest:
    """What a job asks of placement: a world size, its batch, and an explicit plan or none (search).

    ``global_batch_size`` counts sequences per optimizer step; ``grad_accum`` (optional) fixes the
    micro-batches per DP replica; ``max_pp`` bounds the fallback pipeline search.
    """

    world_size: int
    global_batch_size: int
    grad_accum: int | None = None
    explicit: RequestedPlan | None = None
    max_pp: int = 64
    params: CostParams = CostParams()


@dataclass(frozen=True)
class ResolvedPlan:
    """The plan to run, its fullest device's memory (GiB) and, for a searched plan, why others lost.

    ``memory`` is the breakdown of an explicit plan's fullest device (``None`` for a searched plan,
    whose peak comes from the search's own pricing); ``rejected`` holds the search's reasons.
    """

    plan: ParallelPlan
    peak_memory_gib: float
    searched: bool
    memory: MemoryBreakdown | None = None
    rejected: tuple[str, ...] = ()


def homogeneous_capacity(accelerator: str, world_size: int) -> FleetCapacity:
    """A capacity of ``world_size`` accelerators of one type (scale-up domain and node capped at it)."""
    base = get_accelerator(accelerator)
    return FleetCapacity(
        accelerators={base.name: replace(base, scaleup_domain_size=_largest_divisor(world_size, base.scaleup_domain_size),
                                         accelerators_per_node=min(base.accelerators_per_node, world_size))},
        counts={base.name: world_size})


def resolve_plan(model: ModelSpec, request: PlanRequest, capacity: FleetCapacity) -> ResolvedPlan:
    """The plan ``request`` runs with on ``capacity`` (pure).

    An explicit plan is completed (``dp``, ``micro_batch_size``), validated and priced against
    memory; without one, the fastest trainable plan of the search is taken.

    Raises:
        SpecError: a degree that does not divide the world size, a plan the model cannot run, a
            ``grad_accum`` the plan contradicts, a plan that does not fit memory, or no plan at all
            (each naming the field, the value and the fix).
    """
    world_size = request.world_size
    if world_size < 1:
        raise SpecError("resources.num_workers", world_size, "must be at least 1", "ask for one or more workers")
    if request.explicit is not None:
        plan = _balanced_stages(model, _complete(request), capacity, request.params)
        require_runnable(plan, precision=model.precision)
        validate_plan(plan, model, world_size=world_size, scaleup_domain_size=None)
        _check_grad_accum(request, plan)
        if plan.pp > 1:  # the schedules' own conditions (pipeline_chunks): a layer a chunk, micro-batches
            plan.virtual_stages(model.num_layers)
            for m in plan.replica_microbatches or (plan.num_microbatches(model.global_batch_sequences),):
                check_microbatches(m, pp=plan.pp, vpp=plan.vpp, dualpipe=plan.dualpipe)
        memory, gib = _check_memory(model, plan, capacity, request.params)
        return ResolvedPlan(plan=plan, peak_memory_gib=gib, searched=False, memory=memory)
    return _searched(model, request, capacity)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _complete(request: PlanRequest) -> ParallelPlan:
    p, world_size, gbs = request.explicit, request.world_size, request.global_batch_size
    assert p is not None
    dp = p.dp
    if dp is None:
        if world_size % p.replica_size:
            raise SpecError("plan", p.given(),
                            f"tp*cp*pp = {p.replica_size} does not divide the {world_size} workers",
                            "give degrees whose product divides resources.num_workers, or set plan.dp")
        dp = world_size // p.replica_size
    mbs = p.micro_batch_size
    if mbs is None:
        per_replica = gbs // dp if gbs % dp == 0 else 0
        if p.replica_microbatches is None and request.grad_accum is not None and per_replica \
                and per_replica % request.grad_accum == 0:
            mbs = per_replica // request.grad_accum
        else:
            mbs = 1
    return ParallelPlan(tp=p.tp, pp=p.pp, dp=dp, cp=p.cp, ep=p.ep, etp=p.etp, micro_batch_size=mbs,
                        recompute=p.recompute, zero_stage=p.zero_stage,
                        replica_microbatches=p.replica_microbatches, replica_accelerators=p.replica_accelerators,
                        vpp=p.vpp, dualpipe=p.dualpipe)


def _balanced_stages(model: ModelSpec, plan: ParallelPlan, capacity: FleetCapacity,
                     params: CostParams) -> ParallelPlan:
    """``plan`` with the planner's balanced ``stage_starts`` when its ``pp`` does not divide the
    layers (an even split, which the trainer builds by default, does not exist there)."""
    if plan.pp == 1 or plan.stage_starts is not None or plan.pp > model.num_layers \
            or model.num_layers % plan.pp == 0:
        return plan
    slowest = min(capacity.accelerators.values(), key=lambda a: a.peak_tflops(model.precision))
    return balanced_plan(model, plan, slowest, params)


def _chunks_have_layers(plan: ParallelPlan, num_layers: int) -> bool:
    """Whether every model chunk of ``plan``'s stage split holds a layer (the planner checks its
    shapes with placeholder boundaries, so a balanced split can leave a rank fewer layers than
    chunks: the trainer refuses that)."""
    try:
        plan.virtual_stages(num_layers)
    except SpecError:
        return False
    return True


def _check_grad_accum(request: PlanRequest, plan: ParallelPlan) -> None:
    grad_accum, gbs = request.grad_accum, request.global_batch_size
    if grad_accum is None or plan.replica_microbatches is not None:
        return
    if plan.dp * plan.micro_batch_size * grad_accum != gbs:
        raise SpecError("grad_accum", grad_accum,
                        f"dp={plan.dp} x micro_batch_size={plan.micro_batch_size} x grad_accum != "
                        f"global_batch_size={gbs}",
                        "drop grad_accum (it is derived from the plan) or make the product match")


def _catalogue_entry(name: str) -> AcceleratorSpec:
    try:
        return get_accelerator(name)
    except ValueError:
        raise SpecError("plan.replica_accelerators", name, "is not in the accelerator catalogue",
                        "name catalogue types (e.g. H100, P800)") from None


def _check_memory(model: ModelSpec, plan: ParallelPlan, capacity: FleetCapacity,
                  params: CostParams) -> tuple[MemoryBreakdown, float]:
    if plan.replica_accelerators is not None:
        accel = {t: capacity.accelerators.get(t) or _catalogue_entry(t) for t in set(plan.replica_accelerators)}
    else:
        accel = capacity.accelerators[next(iter(capacity.accelerators))]
    slowest = accel if not isinstance(accel, dict) else min(accel.values(), key=lambda a: a.peak_tflops(model.precision))
    mem, type_name, usable = plan_memory(model, balanced_plan(model, plan, slowest, params), accel, params=params)
    if mem.total > usable:
        per_param = params.param_bytes + params.grad_bytes + params.optimizer_bytes
        at_least = math.ceil(model.total_params() * per_param / usable)
        raise SpecError(
            "plan", plan.describe(),
            f"needs {mem.total / GIB:.1f} GiB per device (weights {mem.weights / GIB:.1f}, grads "
            f"{mem.gradients / GIB:.1f}, optimizer {mem.optimizer / GIB:.1f}, activations "
            f"{mem.activations / GIB:.1f}) but a {type_name} has {usable / GIB:.1f} GiB usable",
            f"use more accelerators (weights, gradients and optimizer states alone need at least {at_least} "
            f"{type_name}; set resources.num_workers), or a larger plan.ep / plan.pp"
            f"{_other_levers(plan)} so that each device holds less")
    return mem, mem.total / GIB


def _other_levers(plan: ParallelPlan) -> str:
    levers = []
    if plan.zero_stage < 3:
        levers.append("plan.zero_stage: 3")
    if plan.recompute != "full":
        levers.append("plan.recompute: full")
    if plan.micro_batch_size > 1:
        levers.append("a smaller plan.micro_batch_size")
    return f" (or {', '.join(levers)})" if levers else ""


def _searched(model: ModelSpec, request: PlanRequest, capacity: FleetCapacity) -> ResolvedPlan:
    params, grad_accum, gbs = request.params, request.grad_accum, request.global_batch_size
    result = search_plans(model, capacity, top_k=8, params=params, space=TRAINABLE_SPACE)
    if not result.ranked and request.max_pp > 1:  # pipelines only when nothing pipeline-free fits
        result = search_plans(model, capacity, top_k=8, params=params,
                              space=replace(TRAINABLE_SPACE, max_pp=request.max_pp))
    rejected = tuple(r.reason for r in result.rejected)
    for ranked in result.ranked:
        plan = replace(ranked.plan, stage_starts=None) if ranked.plan.pp == 1 else ranked.plan
        if plan.pp > 1 and not _chunks_have_layers(plan, model.num_layers):
            continue
        if grad_accum is not None and plan.replica_microbatches is None:
            per_replica = gbs // plan.dp
            if per_replica % grad_accum:
                continue
            plan = replace(plan, micro_batch_size=per_replica // grad_accum)
        assert not refusals(plan, precision=model.precision), plan.describe()  # the space is the table's
        return ResolvedPlan(plan=plan, peak_memory_gib=ranked.peak_memory_gib, searched=True, rejected=rejected)
    memory = [r for r in rejected if r.startswith("memory")]
    reasons = (f"{len(memory)} shapes run out of memory, e.g. {memory[0]}" if memory
               else rejected[0] if rejected else "no shape fits the batch")
    raise SpecError("plan", "auto", f"no parallel plan fits {request.world_size} {'/'.join(capacity.counts)} ({reasons})",
                    f"use more accelerators (resources.num_workers), a global_batch_size divisible by the data-parallel "
                    f"degree (now {gbs}), or an explicit plan with a larger ep/pp")
