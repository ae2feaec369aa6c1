"""Parallelization applied from outside the model, in a fixed order, plus the step's collectives.

The order (``parallelize_model``), as in torchtitan, and why:
1. Expert parallelism first: it *removes* parameters (each rank keeps E/ep experts), so the
   wrappers after it only ever see the local experts.
2. Tensor parallelism (DTensor) second: it turns attention/dense weights into TP-sharded
   DTensors, which FSDP2 then shards again over DP (2-D FSDP+TP).
3. FSDP2 last, per transformer block then the root: over DP for everything but the routed
   experts; the experts are sharded over EDP (the ranks holding copies of the same experts)
   and their gradients rescaled from FSDP's EDP average to a DP average, because each EDP copy
   sees the tokens of its whole EP group (see ``context`` for ``grad_divide_factor``).
0. Before all of them, pipeline parallelism (``plan.pp > 1``) cuts the model down to this rank's
   stage (``pipeline``), so every later wrapper sees only the stage's modules; the loop then
   runs each step's micro-batches through 1F1B (``pipeline_forward_backward``).

After backward, ``finalize_gradients`` adds the reductions FSDP cannot express (TP-sum of
the MoE layer's replicated parameters when TP peers split its tokens; expert gradients when
experts are not FSDP-wrapped), then ``clip_grad_norm_`` computes the global norm over
parameters that live on different meshes without double counting replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from rayfleet.errors import SpecError
from rayfleet.jobs.parallel.context import A2AStats, ParallelContext, build_parallel_context
from rayfleet.jobs.parallel.expert_parallel import ExpertParallelDispatcher, apply_expert_parallel
from rayfleet.jobs.parallel.pipeline import PipelineRunner, PipelineStageModule, split_stage
from rayfleet.jobs.parallel.tensor_parallel import apply_tensor_parallel, split_moe_tokens
from rayfleet.models.moe import MoELayer

__all__ = [
    "A2AStats", "ParallelContext", "ExpertParallelDispatcher", "build_parallel_context", "parallelize_model",
    "apply_recompute", "to_checkpoint_layout", "from_checkpoint_layout", "finalize_gradients", "full_grad", "clip_grad_norm_", "sync_expert_load", "full_state_dict", "pipeline_forward_backward",
]

_EXPERT_MARK = ".experts."
# FSDP2 shards an already TP-sharded dim with _StridedShard, which is not a Shard subclass
# (and whose is_shard() is False): both mean "distinct data on each rank of that mesh dim".
_SHARDS = (Shard, _StridedShard)


def _is_expert(name: str) -> bool:
    return _EXPERT_MARK in f".{name}."


def _fsdp_experts(ctx: ParallelContext) -> bool:
    return ctx.ep_size > 1 and ctx.dp_size > 1 and ctx.edp_size > 1


def parallelize_model(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Apply EP, TP, FSDP2 to ``model`` (materialized, FP8-converted or not), in that order."""
    plan = ctx.plan
    # 0. pipeline stage: keep only this stage's modules (before anything allocates shards)
    if plan.pp > 1:
        model = split_stage(model, stage=ctx.pp_rank, num_stages=plan.pp,
                            layer_ranges=plan.stage_ranges(model.config.num_layers))
    # 1. expert parallel
    if ctx.ep_size > 1:
        apply_expert_parallel(model, group=ctx.group("ep"), ep_rank=ctx.ep_rank, ep_size=ctx.ep_size,
                              stats=ctx.a2a, fp8=ctx.fp8_dispatch, overlap=ctx.a2a_overlap,
                              misroute=ctx.misroute_experts)
    # 2. tensor parallel
    if ctx.tp_size > 1:
        apply_tensor_parallel(model, tp_mesh=ctx.submesh("tp"))
        if ctx.moe_token_split:
            split_moe_tokens(model, group=ctx.group("tp"), tp_rank=ctx.tp_rank, tp=ctx.tp_size)
    # Activation recompute before FSDP, so FSDP's hooks wrap the recomputing forward (the
    # recompute then re-gathers parameters like any forward). Module names stay unchanged.
    if plan.recompute != "none":
        apply_recompute(model, mode=plan.recompute)
    # 3. FSDP2 over data parallel (ZeRO-3 when zero_stage == 3, else params stay gathered)
    if ctx.dp_size > 1:
        reshard = plan.zero_stage >= 3
        dp_mesh = ctx.submesh("dp")
        experts_apart = ctx.ep_size > 1
        ignored = {p for n, p in model.named_parameters() if _is_expert(n)} \
            if experts_apart and not _fsdp_experts(ctx) else None
        blocks = model.blocks() if isinstance(model, PipelineStageModule) else list(getattr(model, "layers", []))
        for block in blocks:
            if _fsdp_experts(ctx):
                for module in block.modules():
                    if isinstance(module, MoELayer):
                        # FSDP averages over EDP; finalize_gradients rescales to the DP average.
                        # (set_gradient_divide_factor(dp) would need PREMUL_SUM, which gloo lacks.)
                        fully_shard(module.experts, mesh=ctx.submesh("edp"), reshard_after_forward=reshard)
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
    if plan.pp > 1:
        ctx.pipeline = PipelineRunner(model, stage=ctx.pp_rank, num_stages=plan.pp, device=ctx.device,
                                      group=ctx.group("pp"))
    return model


def apply_recompute(model: nn.Module, *, mode: str) -> int:
    """Recompute activations in backward: whole blocks (``full``) or attention (``selective``)."""
    from rayfleet.models.layers import Attention
    from rayfleet.models.transformer import TransformerBlock

    kind = TransformerBlock if mode == "full" else Attention
    done = 0
    for module in model.modules():
        if isinstance(module, kind):
            forward = module.forward

            def checkpointed(*args: Any, _forward=forward, **kwargs: Any) -> Any:
                return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            module.forward = checkpointed
            done += 1
    return done


def _expert_keys(state: dict[str, Any]) -> list[str]:
    return [k for k in state if _is_expert(k)]


def to_checkpoint_layout(model_sd: dict[str, Any], optim_sd: dict[str, Any], ctx: ParallelContext) -> None:
    """In place: express routed-expert tensors (params and their optimizer states) as DTensors of
    the whole ``[E, ...]`` tensor over the (ep, edp) mesh, sharing this rank's storage.

    Without it every EP rank would save its own E/ep experts under the same key and shape, and
    DCP would keep one of them. No-op without expert parallelism.
    """
    if ctx.expert_ckpt_mesh is None:
        return
    mesh = ctx.expert_ckpt_mesh
    edp = Shard(0) if _fsdp_experts(ctx) else Replicate()

    def wrap(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return DTensor.from_local(_local(value), mesh, (Shard(0), edp), run_check=False)

    for key in _expert_keys(model_sd):
        model_sd[key] = wrap(model_sd[key])
    for key in _expert_keys(optim_sd.get("state", {})):
        optim_sd["state"][key] = {k: wrap(v) for k, v in optim_sd["state"][key].items()}


def from_checkpoint_layout(model_sd: dict[str, Any], optim_sd: dict[str, Any], model: nn.Module,
                           ctx: ParallelContext) -> None:
    """In place: the inverse of ``to_checkpoint_layout`` (back to each parameter's own layout)."""
    if ctx.expert_ckpt_mesh is None:
        return
    params = dict(model.named_parameters())

    def unwrap(key: str, value: Any) -> Any:
        if not isinstance(value, DTensor) or value.device_mesh is not ctx.expert_ckpt_mesh:
            return value
        param = params.get(key)
        local = value.to_local()
        if isinstance(param, DTensor):
            return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
        return local

    for key in _expert_keys(model_sd):
        model_sd[key] = unwrap(key, model_sd[key])
    for key in _expert_keys(optim_sd.get("state", {})):
        optim_sd["state"][key] = {k: unwrap(key, v) for k, v in optim_sd["state"][key].items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def finalize_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    """Reductions after backward that FSDP2 does not do (see the module docstring)."""
    experts_unwrapped = ctx.ep_size > 1 and not _fsdp_experts(ctx)
    moe_prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, MoELayer))
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = _local(param.grad)
        if _is_expert(name) and ctx.ep_size > 1:
            if not experts_unwrapped and ctx.edp_size != ctx.dp_size:
                grad.mul_(ctx.edp_size / ctx.dp_size)  # FSDP averaged over EDP; the loss scale assumes DP
            if experts_unwrapped:
                if ctx.edp_size > 1:
                    dist.all_reduce(grad, group=ctx.group("edp"))
                if ctx.dp_size > 1:
                    grad.div_(ctx.dp_size)
        elif ctx.moe_token_split and name.startswith(moe_prefixes):
            dist.all_reduce(grad, group=ctx.group("tp"))


@torch.no_grad()
def full_grad(model: nn.Module, name: str, ctx: ParallelContext) -> torch.Tensor:
    """Collective: the whole gradient of parameter ``name`` (all shards, all experts), on every rank."""
    param = dict(model.named_parameters())[name]
    if param.grad is None:
        raise ValueError(f"parameter {name!r} has no gradient")
    grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    if _is_expert(name) and ctx.ep_size > 1:
        parts = [torch.empty_like(grad) for _ in range(ctx.ep_size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group("ep"))
        grad = torch.cat(parts)
    return grad.detach().cpu().clone()


def _replicas(name: str, param: torch.Tensor, ctx: ParallelContext) -> int:
    """How many ranks of this pipeline stage hold the same local gradient shard as this one."""
    distinct = ctx.ep_size if _is_expert(name) and ctx.ep_size > 1 else 1
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, _SHARDS):
                distinct *= param.device_mesh.size(dim)
    stage = ctx.world_size // ctx.plan.pp
    assert stage % distinct == 0, (name, stage, distinct)
    return stage // distinct


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
    """Global L2 norm of all gradients (every rank gets the same value); scales them to ``max_norm``."""
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    grads = []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        local = _local(param.grad)
        grads.append(local)
        total += local.double().pow(2).sum() / _replicas(name, param, ctx)
    if ctx.world_size > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm != float("inf") and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm.float()


def sync_expert_load(load: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum per-layer expert loads ``[L, E]`` over the ranks that saw distinct tokens."""
    if ctx.moe_token_split:
        dist.all_reduce(load, group=ctx.stage_group)
    elif ctx.dp_size > 1:
        dist.all_reduce(load, group=ctx.group("dp"))
    return load


def full_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor] | None:
    """Collective: the unsharded state dict (all experts, all stages), on rank 0; None elsewhere."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        value = _local(value)
        if _is_expert(name) and ctx.ep_size > 1 and value.dim() >= 1:
            parts = [torch.empty_like(value) for _ in range(ctx.ep_size)]
            dist.all_gather(parts, value.contiguous(), group=ctx.group("ep"))
            value = torch.cat(parts)
        out[name] = value.detach().cpu()
    if ctx.plan.pp > 1:  # every stage's first rank sends its stage to rank 0
        holder = ctx.tp_rank == 0 and ctx.dp_rank == 0
        stages: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(stages, out if holder else None)
        out = {k: v for stage in stages if stage for k, v in stage.items()}
    return out if ctx.rank == 0 else None


def pipeline_forward_backward(model: nn.Module, ctx: ParallelContext, *, inputs: list[torch.Tensor],
                              targets: list[torch.Tensor], loss_fn: Any) -> None:
    """One step's micro-batches through this rank's pipeline stage (1F1B), forward and backward."""
    if ctx.pipeline is None:
        raise RuntimeError("pipeline_forward_backward needs a model parallelized with plan.pp > 1")
    ctx.pipeline.forward_backward(inputs=inputs, targets=targets, loss_fn=loss_fn)
