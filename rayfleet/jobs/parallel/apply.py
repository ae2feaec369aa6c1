"""Parallelization applied from outside the model, in a fixed order.

The order (``parallelize_model``), as in torchtitan, and why:
1. Expert parallelism first: it *removes* parameters (each rank keeps E/ep experts), so the
   wrappers after it only ever see the local experts.
1b. Expert-tensor parallelism (``plan.etp > 1``) next, for the same reason: each rank keeps
   1/etp of every local expert's hidden units (``w1``/``w3`` columns, ``w2`` rows), and the MoE
   layer's dispatcher is wrapped to all-gather rows over ETP before the experts and
   reduce-scatter their partial outputs after (``models.expert_tensor_parallel``).
2. Tensor parallelism (DTensor) second: it turns attention/dense weights into TP-sharded
   DTensors, which FSDP2 then shards again over DP (2-D FSDP+TP).
2b. Context parallelism (``plan.cp > 1``) swaps each attention's core for a load-balanced CP
   one, K/V all-gathered (``context_parallel``) or on a ring (``context_parallel_ring``,
   ``comm.cp_exchange: ring``); it adds no parameters, so its place between TP and
   FSDP only keeps it beside the other attention change.
3. FSDP2 last, per transformer block then the root: over DP for everything but the routed
   experts; the experts are sharded over EDP (the ranks holding copies of the same experts)
   and their gradients rescaled from FSDP's EDP average to a DP average, because each EDP copy
   sees the tokens of its whole EP group (see ``context`` for ``grad_divide_factor``).
0. Before all of them, pipeline parallelism (``plan.pp > 1``) cuts the model down to this rank's
   virtual stages (one for 1F1B, ``vpp`` interleaved, two for DualPipeV; ``pipeline``), so every
   later wrapper sees only their modules; the loop then runs each step's micro-batches through
   the plan's schedule (``pipeline_forward_backward``). Each virtual stage the schedule calls is
   an FSDP2 root of its own.

The step's collectives that follow this layout are in :mod:`rayfleet.jobs.parallel.collectives`,
the experts' checkpoint layout in :mod:`rayfleet.jobs.parallel.checkpoint_layout`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from rayfleet.jobs.parallel.context import ParallelContext
from rayfleet.jobs.parallel.context_parallel import ContextParallelAttention, apply_context_parallel
from rayfleet.jobs.parallel.context_parallel_ring import RingAttention
from rayfleet.jobs.parallel.expert_parallel import apply_expert_parallel, apply_expert_tensor_parallel
from rayfleet.jobs.parallel.pipeline import (PipelineChunks, PipelineRunner, PipelineStageModule, split_stages,
                                             stage_roots)
from rayfleet.jobs.parallel.tensor_parallel import apply_tensor_parallel, split_moe_tokens
from rayfleet.models.moe import MoELayer

__all__ = ["parallelize_model", "apply_recompute", "is_expert_param", "experts_fsdp_sharded", "local_tensor",
           "SHARD_PLACEMENTS"]

_EXPERT_MARK = ".experts."
# FSDP2 shards an already TP-sharded dim with _StridedShard, which is not a Shard subclass
# (and whose is_shard() is False): both mean "distinct data on each rank of that mesh dim".
SHARD_PLACEMENTS = (Shard, _StridedShard)


def is_expert_param(name: str) -> bool:
    """Whether parameter (or state-dict key) ``name`` belongs to the routed experts."""
    return _EXPERT_MARK in f".{name}."


def experts_fsdp_sharded(ctx: ParallelContext) -> bool:
    """Whether the routed experts are FSDP-sharded over EDP (else FSDP ignores them)."""
    return ctx.experts_apart and ctx.dp_size > 1 and ctx.edp_size > 1


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def parallelize_model(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Apply EP, ETP, TP, CP, FSDP2 to ``model`` (materialized, FP8-converted or not), in that order."""
    plan = ctx.plan
    # 0. pipeline stage: keep only this stage's modules (before anything allocates shards)
    stages = plan.virtual_stages(model.config.num_layers) if plan.pp > 1 else ()
    if plan.pp > 1:
        model = split_stages(model, stages=stages, pp_rank=ctx.pp_rank)
    # 1. expert parallel
    if ctx.ep_size > 1:
        apply_expert_parallel(model, group=ctx.group("ep"), ep_rank=ctx.ep_rank, ep_size=ctx.ep_size,
                              stats=ctx.a2a, fp8=ctx.fp8_dispatch, overlap=ctx.a2a_overlap,
                              misroute=ctx.misroute_experts)
    # 1b. expert tensor parallel: hidden units of the local experts over the ETP group
    if ctx.etp_size > 1:
        apply_expert_tensor_parallel(model, group=ctx.group("etp"), etp_rank=ctx.etp_rank, etp_size=ctx.etp_size,
                                     control=ctx.etp_control)  # type: ignore[arg-type]
    # 2. tensor parallel
    if ctx.tp_size > 1:
        # params used by this peer's heads only (q/k norms): finalize_gradients sums them over TP
        ctx.tp_partial_grads = apply_tensor_parallel(model, tp_mesh=ctx.submesh("tp"))
        if ctx.moe_token_split:
            split_moe_tokens(model, group=ctx.group("tp"), tp_rank=ctx.tp_rank, tp=ctx.tp_size)
    # 2b. context parallel: attention across the CP group (the loop feeds each rank its chunks)
    if ctx.cp_size > 1:
        core = RingAttention if ctx.cp_exchange == "ring" else ContextParallelAttention
        attend = core(group=ctx.group("cp"), cp_rank=ctx.cp_rank, cp=ctx.cp_size,
                      control=ctx.cp_control)  # type: ignore[arg-type]
        apply_context_parallel(model, attend=attend, cp_rank=ctx.cp_rank, cp=ctx.cp_size)
    # Activation recompute before FSDP, so FSDP's hooks wrap the recomputing forward (the
    # recompute then re-gathers parameters like any forward). Module names stay unchanged.
    if plan.recompute != "none":
        apply_recompute(model, mode=plan.recompute)
    # 3. FSDP2 over data parallel (ZeRO-3 when zero_stage == 3, else params stay gathered)
    if ctx.dp_size > 1:
        reshard = plan.zero_stage >= 3
        dp_mesh = ctx.submesh("dp")
        ignored = {p for n, p in model.named_parameters() if is_expert_param(n)} \
            if ctx.experts_apart and not experts_fsdp_sharded(ctx) else None
        blocks = model.blocks() if isinstance(model, (PipelineStageModule, PipelineChunks)) \
            else list(getattr(model, "layers", []))
        for block in blocks:
            if experts_fsdp_sharded(ctx):
                for module in block.modules():
                    if isinstance(module, MoELayer):
                        # FSDP averages over EDP; finalize_gradients rescales to the DP average.
                        # (set_gradient_divide_factor(dp) would need PREMUL_SUM, which gloo lacks.)
                        fully_shard(module.experts, mesh=ctx.submesh("edp"), reshard_after_forward=reshard)
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
        for root in stage_roots(model):
            fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
    if plan.pp > 1:
        ctx.pipeline = PipelineRunner(model, stage_indices=[s.index for s in stages if s.rank == ctx.pp_rank],
                                      num_stages=len(stages), dualpipe=plan.dualpipe, device=ctx.device,
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
