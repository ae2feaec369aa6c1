"""Expert (and expert-tensor) parallelism applied to a training model: keep this rank's experts, or
its hidden units of them, and install the dispatcher.

The exchanges themselves (``ExpertParallelDispatcher``: all-to-all dispatch and combine, FP8 on
the wire, overlap; ``ExpertTensorParallelDispatcher``: the all-gather / reduce-scatter around
ETP-sharded expert GEMMs) are in ``rayfleet.models``; this module only slices a model for them.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from rayfleet.errors import SpecError
from rayfleet.jobs.parallel.context import A2AStats
from rayfleet.models.expert_parallel import ExpertParallelDispatcher
from rayfleet.models.expert_tensor_parallel import ETPControl, ExpertTensorParallelDispatcher
from rayfleet.models.moe import GroupedExperts, MoELayer

__all__ = ["ExpertParallelDispatcher", "apply_expert_parallel", "apply_expert_tensor_parallel", "ETP_SHARD_DIM"]

# The hidden-unit dim of each expert weight: w1/w3 [E, H, dim] column-parallel, w2 [E, dim, H]
# row-parallel. Checkpoint layouts and full-tensor gathers read it.
ETP_SHARD_DIM = {"w1": 1, "w3": 1, "w2": 2}


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


def _slice_hidden_units(experts: GroupedExperts, etp_rank: int, etp_size: int) -> None:
    for name, dim in ETP_SHARD_DIM.items():
        full = getattr(experts, name)
        part = full.shape[dim] // etp_size
        kept = full.detach().narrow(dim, etp_rank * part, part).clone()
        setattr(experts, name, nn.Parameter(kept, requires_grad=full.requires_grad))
    # FP8 delayed-scaling weight histories stay per expert ([E_local]): each ETP rank tracks the
    # amax of its own shard, as a TP-sharded FP8 linear does.


def apply_expert_tensor_parallel(model: nn.Module, *, group: dist.ProcessGroup, etp_rank: int, etp_size: int,
                                 control: ETPControl = "none") -> int:
    """Keep this ETP rank's hidden units of every local expert and wrap each MoE layer's dispatcher
    (after :func:`apply_expert_parallel`, if any) so its experts run split over ``group``;
    returns layers done. ``control`` is the BROKEN ON PURPOSE variant of the tests."""
    done = 0
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        hidden = module.experts.w1.shape[1]
        if hidden % etp_size:
            raise SpecError("plan.etp", etp_size, f"does not divide the experts' hidden size {hidden}",
                            "choose etp dividing moe_ffn_hidden_size")
        _slice_hidden_units(module.experts, etp_rank, etp_size)
        module.dispatcher = ExpertTensorParallelDispatcher(module.dispatcher, group=group, etp_size=etp_size,
                                                           etp_rank=etp_rank, control=control)
        done += 1
    return done
