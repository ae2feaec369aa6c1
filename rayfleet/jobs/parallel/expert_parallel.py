"""Expert parallelism applied to a training model: keep this rank's experts, install the EP dispatcher.

The exchange itself (``ExpertParallelDispatcher``: all-to-all dispatch and combine, FP8 on the
wire, overlap) is ``rayfleet.models.expert_parallel``, the one EP implementation that training
and the wide-EP serving replica share; this module only slices a model for it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from rayfleet.jobs.parallel.context import A2AStats
from rayfleet.models.expert_parallel import ExpertParallelDispatcher
from rayfleet.models.moe import GroupedExperts, MoELayer

__all__ = ["ExpertParallelDispatcher", "apply_expert_parallel"]


def _slice_expert_state(experts: GroupedExperts, start: int, end: int) -> None:
    for name in ("w1", "w2", "w3"):
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(full.detach()[start:end].clone(), requires_grad=full.requires_grad))
    fp8_state = getattr(experts, "fp8_state", None)
    if fp8_state is not None:  # delayed-scaling histories are per expert on dim 0
        for module in fp8_state.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.dim() >= 1 and buf.shape[0] == experts.num_experts:
                    module._buffers[key] = buf[start:end].clone()
    experts.num_experts = end - start


def apply_expert_parallel(model: nn.Module, *, group: dist.ProcessGroup, ep_rank: int, ep_size: int,
                          stats: A2AStats, fp8: bool, overlap: bool, misroute: bool) -> int:
    """Keep this rank's experts and install the EP dispatcher in every MoE layer; returns layers done."""
    done = 0
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        per_rank = module.num_experts // ep_size
        _slice_expert_state(module.experts, ep_rank * per_rank, (ep_rank + 1) * per_rank)
        module.dispatcher = ExpertParallelDispatcher(group=group, ep_size=ep_size, stats=stats, fp8=fp8,
                                                     overlap=overlap, misroute=misroute)
        done += 1
    return done
