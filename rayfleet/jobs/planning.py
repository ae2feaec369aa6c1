"""Checks a job needs before any worker starts: the dataset, the plan, and whether it fits.

Design decisions:
- Pure except for reading the dataset manifest (one small JSON file): the driver (CLI, SDK,
  ``ray job submit`` entrypoint) calls :func:`validate_job` and only then asks Ray for
  workers, so a bad spec costs milliseconds, not a worker-group start.
- The planner reasons from shapes (:class:`rayfleet.placement.ModelSpec`); the job's
  ``MoEConfig`` is translated once by :func:`model_spec_for` so memory estimates speak of the
  very model the workers build (MLA is modelled as GQA, as ``MoEConfig`` does).
- ``plan: auto`` runs the placement search on a capacity of ``world_size`` accelerators of
  the named type (or the launcher's real :class:`FleetCapacity`, which may be mixed); an
  explicit plan is completed (``dp`` from the world size, ``micro_batch_size`` from
  ``grad_accum``), checked with :func:`validate_plan`, then priced by the memory model
  against the accelerator's HBM. A plan that does not fit says how many accelerators the
  states alone need, so the fix names a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rayfleet.errors import SpecError
from rayfleet.jobs.spec import TrainJobSpec, is_fp8_precision
from rayfleet.models.config import MoEConfig
from rayfleet.placement.cost_model import GIB, balanced_plan, plan_memory
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.planner import SearchSpace, search_plans
from rayfleet.platform.catalogue import get_accelerator
from rayfleet.storage.tokens import TokenManifest, read_manifest

__all__ = ["ResolvedJob", "model_spec_for", "check_dataset", "num_samples", "resolve_plan", "validate_job",
           "capacity_for"]


@dataclass(frozen=True)
class ResolvedJob:
    """A spec checked against its dataset and fleet: what the launcher needs to start workers."""

    spec: TrainJobSpec
    config: MoEConfig
    plan: ParallelPlan
    manifest: TokenManifest
    num_samples: int
    peak_memory_gib: float

    @property
    def world_size(self) -> int:
        return self.plan.world_size


def model_spec_for(spec: TrainJobSpec) -> ModelSpec:
    """The planner's view of the job's model at the job's sequence length and batch."""
    c = spec.model.to_config()
    return ModelSpec(
        name=spec.model.preset or "custom", num_layers=c.num_layers, hidden_size=c.dim, ffn_hidden_size=c.ffn_dim,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.resolved_head_dim,
        vocab_size=c.vocab_size, num_experts=c.num_experts if c.num_moe_layers else 0,
        top_k=c.top_k if c.num_moe_layers else 0, num_shared_experts=c.num_shared_experts if c.num_moe_layers else 0,
        moe_ffn_hidden_size=c.moe_ffn_dim if c.num_moe_layers else 0,
        first_k_dense_layers=c.num_dense_layers if c.num_moe_layers else 0,
        seq_len=spec.data.seq_len, global_batch_sequences=spec.global_batch_size,
        precision="fp8" if is_fp8_precision(spec.precision) else "bf16")


def num_samples(manifest: TokenManifest, seq_len: int) -> int:
    """Training samples of ``seq_len + 1`` tokens (inputs and shifted targets) in a dataset."""
    return max(0, (manifest.num_tokens - 1) // seq_len)


def check_dataset(spec: TrainJobSpec) -> TokenManifest:
    """The dataset's manifest; raises when it is missing, too small, or its tokens overflow the vocabulary."""
    try:
        manifest = read_manifest(spec.data.uri)
    except SpecError as err:
        raise SpecError("data.uri", spec.data.uri, "is not a token dataset (no manifest.json there)",
                        "prepare one with `rayfleet data prepare SRC --out URI`, or fix the path") from err
    except (OSError, ValueError) as err:
        raise SpecError("data.uri", spec.data.uri, f"cannot be read ({err})", "check the URI and its credentials") from None
    vocab = int(manifest.tokenizer.get("vocab_size", 0))
    config = spec.model.to_config()
    if vocab > config.vocab_size:
        raise SpecError("model.config.vocab_size", config.vocab_size,
                        f"is smaller than the dataset tokenizer's vocabulary ({vocab})",
                        f"set model.config.vocab_size >= {vocab}")
    available = num_samples(manifest, spec.data.seq_len)
    if available < spec.global_batch_size:
        raise SpecError("data.uri", spec.data.uri,
                        f"holds {available} samples of {spec.data.seq_len + 1} tokens, fewer than one global batch "
                        f"({spec.global_batch_size})", "use a larger dataset, a shorter data.seq_len or a smaller batch")
    return manifest


def capacity_for(accelerator: str, world_size: int) -> FleetCapacity:
    """A homogeneous capacity of ``world_size`` accelerators (scale-up domain capped at it)."""
    base = get_accelerator(accelerator)
    return FleetCapacity(
        accelerators={base.name: replace(base, scaleup_domain_size=_largest_divisor(world_size, base.scaleup_domain_size),
                                         accelerators_per_node=min(base.accelerators_per_node, world_size))},
        counts={base.name: world_size})


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _catalogue_entry(name: str):
    try:
        return get_accelerator(name)
    except ValueError:
        raise SpecError("plan.replica_accelerators", name, "is not in the accelerator catalogue",
                        "name catalogue types (e.g. H100, P800)") from None


def _explicit_plan(spec: TrainJobSpec, world_size: int) -> ParallelPlan:
    p = spec.plan
    assert p is not None
    dp = p.dp
    if dp is None:
        if world_size % p.replica_size:
            raise SpecError("plan", p.model_dump(exclude_none=True),
                            f"tp*cp*pp = {p.replica_size} does not divide the {world_size} workers",
                            "give degrees whose product divides resources.num_workers, or set plan.dp")
        dp = world_size // p.replica_size
    mbs = p.micro_batch_size
    if mbs is None:
        per_replica = spec.global_batch_size // dp if spec.global_batch_size % dp == 0 else 0
        if p.replica_microbatches is None and spec.grad_accum is not None and per_replica % spec.grad_accum == 0 and per_replica:
            mbs = per_replica // spec.grad_accum
        else:
            mbs = 1
    return ParallelPlan(tp=p.tp, pp=p.pp, dp=dp, cp=p.cp, ep=p.ep, etp=p.etp, micro_batch_size=mbs,
                        recompute=p.recompute, zero_stage=p.zero_stage,
                        replica_microbatches=p.replica_microbatches, replica_accelerators=p.replica_accelerators)


def _check_grad_accum(spec: TrainJobSpec, plan: ParallelPlan) -> None:
    if spec.grad_accum is None or plan.replica_microbatches is not None:
        return
    if plan.dp * plan.micro_batch_size * spec.grad_accum != spec.global_batch_size:
        raise SpecError("grad_accum", spec.grad_accum,
                        f"dp={plan.dp} x micro_batch_size={plan.micro_batch_size} x grad_accum != "
                        f"global_batch_size={spec.global_batch_size}",
                        "drop grad_accum (it is derived from the plan) or make the product match")


def _check_memory(spec: TrainJobSpec, model: ModelSpec, plan: ParallelPlan, capacity: FleetCapacity,
                  params: CostParams) -> float:
    if plan.replica_accelerators is not None:
        accel = {t: capacity.accelerators.get(t) or _catalogue_entry(t) for t in set(plan.replica_accelerators)}
    else:
        accel = capacity.accelerators[next(iter(capacity.accelerators))]
    slowest = accel if not isinstance(accel, dict) else min(accel.values(), key=lambda a: a.peak_tflops(model.precision))
    mem, type_name, usable = plan_memory(model, balanced_plan(model, plan, slowest, params), accel, params=params)
    if mem.total > usable:
        per_param = params.param_bytes + params.grad_bytes + params.optimizer_bytes
        total = spec.model.to_config().num_params().total
        at_least = math.ceil(total * per_param / usable)
        raise SpecError(
            "plan", plan.describe(),
            f"needs {mem.total / GIB:.1f} GiB per device (weights {mem.weights / GIB:.1f}, grads "
            f"{mem.gradients / GIB:.1f}, optimizer {mem.optimizer / GIB:.1f}, activations "
            f"{mem.activations / GIB:.1f}) but a {type_name} has {usable / GIB:.1f} GiB usable",
            f"use more accelerators (weights, gradients and optimizer states alone need at least {at_least} "
            f"{type_name}; set resources.num_workers), or a larger plan.ep / plan.pp"
            f"{_other_levers(plan)} so that each device holds less")
    return mem.total / GIB


def _other_levers(plan: ParallelPlan) -> str:
    levers = []
    if plan.zero_stage < 3:
        levers.append("plan.zero_stage: 3")
    if plan.recompute != "full":
        levers.append("plan.recompute: full")
    if plan.micro_batch_size > 1:
        levers.append("a smaller plan.micro_batch_size")
    return f" (or {', '.join(levers)})" if levers else ""


def resolve_plan(spec: TrainJobSpec, *, world_size: int, accelerator: str | None = None,
                 capacity: FleetCapacity | None = None, params: CostParams = CostParams(),
                 max_pp: int = 64) -> ParallelPlan:
    """The plan the job runs with on ``world_size`` accelerators.

    ``accelerator`` defaults to ``spec.resources.accelerator``; ``capacity`` (the launcher's real
    fleet, possibly mixed) overrides both. ``plan: auto`` takes the planner's fastest plan that
    satisfies ``grad_accum``; an explicit plan is completed and checked. Raises ``SpecError``.
    """
    return _resolve(spec, world_size=world_size, accelerator=accelerator, capacity=capacity, params=params,
                    max_pp=max_pp)[0]


def _resolve(spec: TrainJobSpec, *, world_size: int, accelerator: str | None, capacity: FleetCapacity | None,
             params: CostParams, max_pp: int) -> tuple[ParallelPlan, float]:
    if world_size < 1:
        raise SpecError("resources.num_workers", world_size, "must be at least 1", "ask for one or more workers")
    model = model_spec_for(spec)
    capacity = capacity or capacity_for(accelerator or spec.resources.accelerator, world_size)
    if spec.plan is not None:
        plan = _explicit_plan(spec, world_size)
        validate_plan(plan, model, world_size=world_size, scaleup_domain_size=None)
        _check_grad_accum(spec, plan)
        return plan, _check_memory(spec, model, plan, capacity, params)
    # Pipeline parallelism only when no pipeline-free plan fits: PP adds bubbles and a
    # different step structure, and at small scale the cost model's latency terms favour it
    # for reasons that do not hold on real hardware.
    # The trainer runs TP, EP, DP (FSDP2) and PP: no context or expert-tensor split. Pipeline
    # parallelism only when no pipeline-free plan fits: PP adds bubbles, and at small scale the
    # cost model's latency terms favour it for reasons that do not hold on real hardware.
    trainable = SearchSpace(max_pp=1, zero_stage=3, context_parallel=(1,), expert_tp_options="1")
    result = search_plans(model, capacity, top_k=8, params=params, space=trainable)
    if not result.ranked and max_pp > 1:
        result = search_plans(model, capacity, top_k=8, params=params, space=replace(trainable, max_pp=max_pp))
    for ranked in result.ranked:
        plan = replace(ranked.plan, stage_starts=None) if ranked.plan.pp == 1 else ranked.plan
        if spec.grad_accum is not None and plan.replica_microbatches is None:
            per_replica = spec.global_batch_size // plan.dp
            if per_replica % spec.grad_accum:
                continue
            plan = replace(plan, micro_batch_size=per_replica // spec.grad_accum)
        return plan, ranked.peak_memory_gib
    memory = [r.reason for r in result.rejected if r.reason.startswith("memory")]
    reasons = (f"{len(memory)} shapes run out of memory, e.g. {memory[0]}" if memory
               else result.rejected[0].reason if result.rejected else "no shape fits the batch")
    gbs = spec.global_batch_size
    raise SpecError("plan", "auto", f"no parallel plan fits {world_size} {'/'.join(capacity.counts)} ({reasons})",
                    f"use more accelerators (resources.num_workers), a global_batch_size divisible by the data-parallel "
                    f"degree (now {gbs}), or an explicit plan with a larger ep/pp")


def validate_job(spec: TrainJobSpec, *, world_size: int | None = None, accelerator: str | None = None,
                 capacity: FleetCapacity | None = None, params: CostParams = CostParams()) -> ResolvedJob:
    """Every pre-launch check: dataset, plan (searched or explicit), memory. Raises ``SpecError``.

    ``world_size`` defaults to ``resources.num_workers``, else the explicit plan's size.
    """
    if world_size is None:
        world_size = spec.resources.num_workers
    if world_size is None and spec.plan is not None and spec.plan.dp is not None:
        world_size = spec.plan.replica_size * spec.plan.dp
    if world_size is None:
        raise SpecError("resources.num_workers", None, "is needed to plan the job", "set resources.num_workers")
    manifest = check_dataset(spec)
    plan, peak = _resolve(spec, world_size=world_size, accelerator=accelerator, capacity=capacity,
                          params=params, max_pp=64)
    return ResolvedJob(spec=spec, config=spec.model.to_config(), plan=plan, manifest=manifest,
                       num_samples=num_samples(manifest, spec.data.seq_len), peak_memory_gib=peak)
