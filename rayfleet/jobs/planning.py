"""The job side of planning: the dataset check, and the one translation of a spec into placement's terms.

Design decisions:
- Pure except for reading the dataset manifest (one small JSON file): the job's entry (CLI, SDK,
  ``ray job submit`` entrypoint) calls :func:`validate_job` / :func:`check_dataset` once and only
  then asks Ray for workers, so a bad spec costs milliseconds, not a worker-group start.
- :func:`plan_inputs` is the only place a ``TrainJobSpec`` becomes placement's vocabulary: the
  model's shapes (:class:`rayfleet.placement.ModelSpec`, MLA modelled as GQA as ``MoEConfig``
  does, so memory estimates speak of the very model the workers build), the requested degrees
  and the batch. Everything after it (the launcher, the elastic driver) holds the frozen
  :class:`PlanInputs` and asks :func:`rayfleet.placement.resolve.resolve_plan` for a plan at a
  world size; placement never sees a job spec.
- ``plan: auto`` plans on a capacity of ``world_size`` accelerators of the named type (or the
  caller's real :class:`FleetCapacity`, which may be mixed); the rules for explicit and
  searched plans, and the memory check, are placement's (``placement/resolve.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.errors import SpecError
from rayfleet.jobs.spec import TrainJobSpec, is_fp8_precision
from rayfleet.models.config import MoEConfig
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.resolve import PlanRequest, RequestedPlan, ResolvedPlan, homogeneous_capacity, resolve_plan
from rayfleet.storage.tokens import TokenManifest, read_manifest

__all__ = ["ResolvedJob", "PlanInputs", "plan_inputs", "model_spec_for", "check_dataset", "check_eval_dataset",
           "num_samples", "job_plan", "validate_job", "world_size_of"]


@dataclass(frozen=True)
class ResolvedJob:
    """A spec checked against its dataset and fleet (the driver's pre-submit answer)."""

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
        # MLA and group-limited routing change attention's weights and activations and the
        # dispatch's fan-out: without them a DeepSeek-V3 config was priced as GQA (issue 28)
        q_lora_rank=c.q_lora_rank if c.kv_lora_rank else 0, kv_lora_rank=c.kv_lora_rank,
        rope_head_dim=c.rope_head_dim if c.kv_lora_rank else 0,
        num_expert_groups=c.router_num_groups if c.num_moe_layers else 1,
        expert_groups_per_token=c.router_topk_groups if c.num_moe_layers and c.router_num_groups > 1 else 0,
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
    if spec.eval is not None:
        check_eval_dataset(spec, manifest)
    return manifest


def check_eval_dataset(spec: TrainJobSpec, train: TokenManifest) -> TokenManifest:
    """The validation split's manifest: same tokenizer as ``train``, enough samples for ``eval.batches``."""
    assert spec.eval is not None
    uri = spec.eval.uri
    try:
        manifest = read_manifest(uri)
    except SpecError as err:
        raise SpecError("eval.uri", uri, "is not a token dataset (no manifest.json there)",
                        "point it at a validation split, e.g. the val/ folder `rayfleet data prepare --source "
                        "shakespeare --out URI` writes") from err
    except (OSError, ValueError) as err:
        raise SpecError("eval.uri", uri, f"cannot be read ({err})", "check the URI and its credentials") from None
    if manifest.tokenizer != train.tokenizer:
        raise SpecError("eval.uri", uri, f"uses tokenizer {manifest.tokenizer.get('name')!r}, not the training "
                        f"data's {train.tokenizer.get('name')!r} (or a different vocabulary)",
                        "validate on a split prepared together with data.uri")
    needed, available = spec.eval.batches * spec.global_batch_size, num_samples(manifest, spec.data.seq_len)
    if available < needed:
        raise SpecError("eval.batches", spec.eval.batches,
                        f"needs {needed} samples of {spec.data.seq_len + 1} tokens but {uri} holds {available}",
                        f"set eval.batches <= {max(1, available // spec.global_batch_size)}")
    return manifest


@dataclass(frozen=True)
class PlanInputs:
    """A job's planning request in placement's terms, made once from its spec (:func:`plan_inputs`).

    ``num_workers`` is the spec's fixed size (``None``: from the plan, or the free fleet);
    ``accelerator`` the type a homogeneous job runs on.
    """

    model: ModelSpec
    accelerator: str
    global_batch_size: int
    grad_accum: int | None = None
    explicit: RequestedPlan | None = None
    num_workers: int | None = None

    @property
    def replica_size(self) -> int:
        """Accelerators of one model replica (1 when the plan is searched)."""
        return self.explicit.replica_size if self.explicit is not None else 1

    @property
    def accelerator_types(self) -> frozenset[str]:
        """The kinds of accelerator the job runs on (a mixed plan names several)."""
        mixed = self.explicit.replica_accelerators if self.explicit is not None else None
        return frozenset(mixed or (self.accelerator,))

    def request(self, world_size: int, *, params: CostParams = CostParams(), max_pp: int = 64) -> PlanRequest:
        return PlanRequest(world_size=world_size, global_batch_size=self.global_batch_size,
                           grad_accum=self.grad_accum, explicit=self.explicit, max_pp=max_pp, params=params)


def plan_inputs(spec: TrainJobSpec) -> PlanInputs:
    """The one translation of a job spec into what placement plans from."""
    p = spec.plan
    explicit = None if p is None else RequestedPlan(
        tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp, micro_batch_size=p.micro_batch_size,
        recompute=p.recompute, zero_stage=p.zero_stage, replica_microbatches=p.replica_microbatches,
        replica_accelerators=p.replica_accelerators, vpp=p.vpp, dualpipe=p.dualpipe)
    return PlanInputs(model=model_spec_for(spec), accelerator=spec.resources.accelerator,
                      global_batch_size=spec.global_batch_size, grad_accum=spec.grad_accum, explicit=explicit,
                      num_workers=spec.resources.num_workers)


def world_size_of(inputs: PlanInputs) -> int | None:
    """The job's size when it fixes one: ``resources.num_workers``, else the explicit plan's size."""
    if inputs.num_workers is not None:
        return inputs.num_workers
    if inputs.explicit is not None and inputs.explicit.dp is not None:
        return inputs.explicit.replica_size * inputs.explicit.dp
    return None


def job_plan(inputs: PlanInputs, *, world_size: int, accelerator: str | None = None,
             capacity: FleetCapacity | None = None, params: CostParams = CostParams(),
             max_pp: int = 64) -> ResolvedPlan:
    """The plan the job runs with on ``world_size`` accelerators (``placement.resolve_plan``).

    ``accelerator`` defaults to the job's; ``capacity`` (a real fleet, possibly mixed) overrides
    both. Raises ``SpecError``.
    """
    if world_size < 1:
        raise SpecError("resources.num_workers", world_size, "must be at least 1", "ask for one or more workers")
    capacity = capacity or homogeneous_capacity(accelerator or inputs.accelerator, world_size)
    return resolve_plan(inputs.model, inputs.request(world_size, params=params, max_pp=max_pp), capacity)


def validate_job(spec: TrainJobSpec, *, world_size: int | None = None, accelerator: str | None = None,
                 capacity: FleetCapacity | None = None, params: CostParams = CostParams()) -> ResolvedJob:
    """Every pre-launch check: dataset, plan (searched or explicit), memory. Raises ``SpecError``.

    ``world_size`` defaults to ``resources.num_workers``, else the explicit plan's size.
    """
    inputs = plan_inputs(spec)
    if world_size is None:
        world_size = world_size_of(inputs)
    if world_size is None:
        raise SpecError("resources.num_workers", None, "is needed to plan the job", "set resources.num_workers")
    manifest = check_dataset(spec)
    resolved = job_plan(inputs, world_size=world_size, accelerator=accelerator, capacity=capacity, params=params)
    if spec.eval is not None and resolved.plan.pp > 1:
        raise SpecError("eval", spec.eval.model_dump(), f"validation does not run pipeline-parallel plans yet "
                        f"(the plan has pp={resolved.plan.pp})", "use a plan with pp: 1, or drop eval")
    return ResolvedJob(config=spec.model.to_config(), plan=resolved.plan, manifest=manifest,
                       num_samples=num_samples(manifest, spec.data.seq_len), peak_memory_gib=resolved.peak_memory_gib)
