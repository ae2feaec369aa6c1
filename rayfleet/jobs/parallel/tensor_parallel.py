"""Tensor parallelism with DTensor for attention, dense MLPs and the output layer.

Design decisions:
- Megatron's column/row split through ``parallelize_module``: ``wq, wk, wv`` and the dense
  ``w1, w3`` column-wise, ``wo`` and ``w2`` row-wise, so each block needs one all-reduce in
  forward and one in backward per sub-layer. Outputs are plain local tensors
  (``use_local_output``), so the rest of the model never sees a DTensor. The attention
  module's head counts become the local ones.
- The output layer is column-wise with a replicated output: every TP peer computes the same
  logits and loss. (A loss-parallel cross entropy would save the gather; at our vocab sizes it
  is not worth the coupling with the loop.)
- Replicated parameters that only see this peer's heads hold *partial* gradients (Megatron's
  "TP-duplicated, partially used" parameters): Qwen3's per-head ``q_norm``/``k_norm`` weights
  are shared by all heads, so each TP peer's gradient sums over its own heads only.
  ``apply_tensor_parallel`` returns their names and ``finalize_gradients`` sums them over TP.
  (Measured without the sum, tiny preset with ``qk_norm``: the TP2 q_norm gradient was 75% off
  and the loss 1.4e-4 relative off one process after 3 steps.) Rejected: making them
  ``Replicate`` DTensors so that autograd reduces their ``Partial`` gradients; the norms'
  outputs would then be DTensors that rotary and the swappable attention cores (CP, paged)
  would have to take or convert back. Every other replicated parameter sees whole, replicated
  activations (there is no sequence parallelism here: norms see every token), so its gradient
  is already the same, whole one on every peer.
- Embeddings, norms and MoE layers stay replicated over TP. With EP > 1, TP peers would send
  the same tokens to the experts twice, so each peer routes a disjoint 1/tp token slice
  (``split_moe_tokens``) and the output is all-gathered; the gather's backward takes the
  peer's own slice of the gradient, which is exact because everything downstream is
  replicated over TP, so every peer holds the same gradient; the split's backward all-gathers
  the slices' input gradients so upstream again sees the whole, identical gradient.
- Rejected: sharding the MoE router/shared experts over TP. They are small, and replicating
  them keeps the layer identical to the single-process one; their partial gradients are summed
  over TP after backward (``finalize_gradients``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rayfleet.errors import SpecError
from rayfleet.models.layers import Attention, FeedForward
from rayfleet.models.moe import MoELayer

__all__ = ["apply_tensor_parallel", "split_moe_tokens"]


def apply_tensor_parallel(model: nn.Module, *, tp_mesh: DeviceMesh) -> frozenset[str]:
    """Shard attention, dense FFNs and the output layer of ``model`` over ``tp_mesh`` (in place).

    Returns the names of the replicated parameters whose gradients are partial over TP (used
    by this peer's heads only: every attention parameter left unsharded, e.g. ``q_norm``/``k_norm``
    weights); the caller must sum their gradients over the TP group after backward.
    """
    tp = tp_mesh.size()
    partial: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            if module.num_heads % tp or module.num_kv_heads % tp:
                raise SpecError("plan.tp", tp, f"{name} has {module.num_heads} heads / {module.num_kv_heads} KV heads, "
                                "which the trainer splits evenly over TP", "use a TP degree dividing num_kv_heads")
            parallelize_module(module, tp_mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                                 "wv": ColwiseParallel(), "wo": RowwiseParallel()})
            module.num_heads //= tp
            module.num_kv_heads //= tp
            partial.update(f"{name}.{p_name}" for p_name, p in module.named_parameters()
                           if not isinstance(p, DTensor))
        elif isinstance(module, FeedForward) and not _inside_moe(model, name):
            parallelize_module(module, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                                 "w2": RowwiseParallel()})
    output = getattr(model, "output", None)
    if isinstance(output, nn.Linear):
        parallelize_module(output, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return frozenset(partial)


def _inside_moe(model: nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0]
    return bool(parent) and isinstance(model.get_submodule(parent), MoELayer)


class _GatherTokens(torch.autograd.Function):
    """All-gather equal token slices over TP; backward keeps this peer's slice of the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, tp_rank: int, tp: int) -> torch.Tensor:
        ctx.tp_rank, ctx.rows = tp_rank, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.tp_rank * ctx.rows
        return grad[start:start + ctx.rows].contiguous(), None, None, None


class _SplitTokens(torch.autograd.Function):
    """This peer's equal token slice; backward all-gathers the slices' gradients (the input is
    replicated over TP, so upstream needs the whole gradient on every peer)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, group: dist.ProcessGroup, tp_rank: int, tp: int) -> torch.Tensor:
        ctx.group, ctx.tp = group, tp
        rows = full.shape[0] // tp
        return full[tp_rank * rows:(tp_rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [torch.empty_like(grad) for _ in range(ctx.tp)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None, None, None


def split_moe_tokens(model: nn.Module, *, group: dist.ProcessGroup, tp_rank: int, tp: int) -> int:
    """Make every MoE layer run on this TP peer's 1/tp slice of its tokens; returns layers done."""
    done = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.register_forward_pre_hook(_slice_hook(group, tp_rank, tp))
            module.register_forward_hook(_gather_hook(group, tp_rank, tp))
            done += 1
    return done


def _slice_hook(group: dist.ProcessGroup, tp_rank: int, tp: int):
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] % tp:
            raise SpecError("data.seq_len", x.shape, f"tokens per micro-batch ({flat.shape[0]}) must divide by tp={tp} "
                            "when experts are split over TP peers", "use a seq_len divisible by plan.tp")
        module._rayfleet_tp_shape = x.shape
        return (_SplitTokens.apply(flat, group, tp_rank, tp), *args[1:])
    return hook


def _gather_hook(group: dist.ProcessGroup, tp_rank: int, tp: int):
    def hook(module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return _GatherTokens.apply(output, group, tp_rank, tp).reshape(module._rayfleet_tp_shape)
    return hook
