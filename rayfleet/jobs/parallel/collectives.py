"""The step's collectives on a model laid out by :func:`~rayfleet.jobs.parallel.apply.parallelize_model`.

After backward, ``finalize_gradients`` adds the reductions FSDP cannot express (TP-sum of
the replicated parameters each TP peer uses for its own heads only, such as q/k norms, and of
the MoE layer's replicated parameters when TP peers split its tokens; expert gradients when
experts are not FSDP-wrapped; the CP-sum of every gradient the CP ranks replicate, since they
saw distinct tokens of the same samples), then ``clip_grad_norm_`` computes the global norm over
parameters that live on different meshes without double counting replicas.
``sync_expert_load``, ``full_grad`` and ``full_state_dict`` gather what metrics, tests and
exports read; ``pipeline_forward_backward`` runs one step's micro-batches (``plan.pp > 1``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from rayfleet.jobs.parallel.apply import SHARD_PLACEMENTS, experts_fsdp_sharded, is_expert_param, local_tensor
from rayfleet.jobs.parallel.context import ParallelContext
from rayfleet.jobs.parallel.expert_parallel import ETP_SHARD_DIM
from rayfleet.models.moe import MoELayer

__all__ = ["finalize_gradients", "full_grad", "clip_grad_norm_", "sync_expert_load", "full_state_dict",
           "pipeline_forward_backward"]


@torch.no_grad()
def finalize_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    """Reductions after backward that FSDP2 does not do (see the module docstring)."""
    experts_unwrapped = ctx.experts_apart and not experts_fsdp_sharded(ctx)
    moe_prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, MoELayer))
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = local_tensor(param.grad)
        if is_expert_param(name) and ctx.experts_apart:
            if not experts_unwrapped and ctx.edp_size != ctx.dp_size:
                grad.mul_(ctx.edp_size / ctx.dp_size)  # FSDP averaged over EDP; the loss scale assumes DP
            if experts_unwrapped:
                if ctx.edp_size > 1:
                    dist.all_reduce(grad, group=ctx.group("edp"))
                if ctx.dp_size > 1:
                    grad.div_(ctx.dp_size)
        elif name in ctx.tp_partial_grads or (ctx.moe_token_split and name.startswith(moe_prefixes)):
            dist.all_reduce(grad, group=ctx.group("tp"))
        if ctx.plan.cp > 1 and not (is_expert_param(name) and ctx.experts_apart):
            # Routed experts under EP/ETP were summed over EDP above, which spans the CP ranks.
            dist.all_reduce(grad, group=ctx.group("cp"))


@torch.no_grad()
def full_grad(model: nn.Module, name: str, ctx: ParallelContext) -> torch.Tensor:
    """Collective: the whole gradient of parameter ``name`` (all shards, all experts), on every rank."""
    param = dict(model.named_parameters())[name]
    if param.grad is None:
        raise ValueError(f"parameter {name!r} has no gradient")
    grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    if is_expert_param(name):
        grad = _gather_experts(name, grad, ctx)
    return grad.detach().cpu().clone()


def _gather_experts(name: str, value: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Collective over ETP then EP: the whole ``[E, ...]`` routed-expert tensor from this rank's part
    (hidden units of ``w1``/``w2``/``w3`` over ETP, experts over EP). Other expert tensors (FP8
    scaling state) are per expert, not per hidden unit: this ETP rank's copy stands for the group."""
    if value.dim() == 0:
        return value
    dim = ETP_SHARD_DIM.get(name.rpartition(".")[2])
    if ctx.etp_size > 1 and dim is not None:
        parts = [torch.empty_like(value) for _ in range(ctx.etp_size)]
        dist.all_gather(parts, value.contiguous(), group=ctx.group("etp"))
        value = torch.cat(parts, dim=dim)
    if ctx.ep_size > 1:
        parts = [torch.empty_like(value) for _ in range(ctx.ep_size)]
        dist.all_gather(parts, value.contiguous(), group=ctx.group("ep"))
        value = torch.cat(parts)
    return value


def _replicas(name: str, param: torch.Tensor, ctx: ParallelContext) -> int:
    """How many ranks of this pipeline stage hold the same local gradient shard as this one."""
    distinct = ctx.ep_size * ctx.etp_size if is_expert_param(name) and ctx.experts_apart else 1
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, SHARD_PLACEMENTS):
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
        local = local_tensor(param.grad)
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
        return load
    if ctx.dp_size > 1:
        dist.all_reduce(load, group=ctx.group("dp"))
    if ctx.plan.cp > 1:
        dist.all_reduce(load, group=ctx.group("cp"))
    return load


def full_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor] | None:
    """Collective: the unsharded state dict (all experts, all stages), on rank 0; None elsewhere."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        value = local_tensor(value)
        if is_expert_param(name):
            value = _gather_experts(name, value, ctx)
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
