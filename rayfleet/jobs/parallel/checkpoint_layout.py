"""The routed experts' checkpoint layout: one ``[E, ...]`` DTensor per key over the (ep, edp[, etp]) mesh.

Without it every EP rank would save its own E/ep experts under the same key and shape, and DCP
would keep one of them; ``from_checkpoint_layout`` puts restored tensors back in the layout
:func:`~rayfleet.jobs.parallel.apply.parallelize_model` gave each parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from rayfleet.jobs.parallel.apply import experts_fsdp_sharded, is_expert_param, local_tensor
from rayfleet.jobs.parallel.context import ParallelContext
from rayfleet.jobs.parallel.expert_parallel import ETP_SHARD_DIM

__all__ = ["to_checkpoint_layout", "from_checkpoint_layout"]


def _expert_keys(state: dict[str, Any]) -> list[str]:
    return [k for k in state if is_expert_param(k)]


def to_checkpoint_layout(model_sd: dict[str, Any], optim_sd: dict[str, Any], ctx: ParallelContext) -> None:
    """In place: express routed-expert tensors (params and their optimizer states) as DTensors of
    the whole ``[E, ...]`` tensor over the (ep, edp) mesh, sharing this rank's storage. Under ETP
    the mesh has a third dim, ``etp``, over which ``w1``/``w3`` are split on dim 1 and ``w2`` on
    dim 2 (their hidden units); other expert tensors (FP8 scaling state) are replicated over it.

    Without it every EP rank would save its own E/ep experts under the same key and shape, and
    DCP would keep one of them. No-op without expert parallelism.
    """
    if ctx.expert_ckpt_mesh is None:
        return
    mesh = ctx.expert_ckpt_mesh
    edp = Shard(0) if experts_fsdp_sharded(ctx) else Replicate()

    def wrap(key: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        placements: tuple[Any, ...] = (Shard(0), edp)
        if mesh.ndim == 3:
            dim = ETP_SHARD_DIM.get(key.rpartition(".")[2])
            placements += (Replicate() if dim is None else Shard(dim),)
        return DTensor.from_local(local_tensor(value), mesh, placements, run_check=False)

    for key in _expert_keys(model_sd):
        model_sd[key] = wrap(key, model_sd[key])
    for key in _expert_keys(optim_sd.get("state", {})):
        optim_sd["state"][key] = {k: wrap(key, v) for k, v in optim_sd["state"][key].items()}


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
