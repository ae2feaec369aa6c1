"""The EP all-to-all overlap model: when a schedule can hide expert-parallel all-to-alls, and what they still cost.

Split out of :mod:`rayfleet.placement.step_time_model` (which prices the whole step and
re-exports these): one model, one module. Megatron-Core's combined 1F1B
(``overlap_moe_expert_parallel_comm``) and DeepSeek's DualPipe run one micro-batch's all-to-all
beside another's compute; a deduplicating dispatcher (DeepEP, HybridEP) sends one copy per remote
scale-up domain. Pure functions of the model's shapes and the plan.

Units: seconds per layer and micro-batch on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.memory_model import layer_param_counts
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan

__all__ = ["LayerHalves", "ep_overlap_possible", "ep_exposed_all_to_all", "layer_halves", "cross_domain_share"]


def ep_overlap_possible(plan: ParallelPlan) -> bool:
    """Whether the schedule can hide one micro-batch's EP all-to-all behind another's compute.

    Megatron-Core's EP A2A overlap (``overlap_moe_expert_parallel_comm``) merges the forward of
    one micro-batch with the backward of another, layer by layer; its config asserts a
    non-interleaved schedule has no such pairs when ``pp > 1`` (it demands virtual stages) and
    that full recompute is off. DualPipe pairs chunks the same way. A plain 1F1B pipeline
    therefore pays the whole all-to-all, as does a plan that turns the overlap off
    (``plan.ep_overlap``)."""
    return plan.ep_overlap and (plan.pp == 1 or plan.vpp > 1 or plan.dualpipe) and plan.recompute != "full"


@dataclass(frozen=True)
class LayerHalves:
    """One layer's compute for one micro-batch on one device (s), split where the EP all-to-alls
    cut it: attention and MoE halves, forward and backward."""

    fwd_attn: float
    fwd_moe: float
    bwd_attn: float
    bwd_moe: float


def ep_exposed_all_to_all(dispatch_s: float, other_s: float, halves: LayerHalves,
                          params: CostParams = CostParams()) -> float:
    """Seconds the EP all-to-alls of one layer and micro-batch add to the critical path when
    the schedule overlaps them with another micro-batch (Megatron-Core's combined 1F1B,
    ``schedule_layer_1f1b``; DualPipe pairs chunks the same way).

    ``dispatch_s`` is the forward dispatch, ``other_s`` each of the three others (forward
    combine, backward dispatch and combine: BF16). The merged layer runs four steps, each one
    all-to-all on the communication stream beside one compute piece of the *other* micro-batch:

      1. backward combine   || forward attention
      2. forward dispatch   || backward MoE (experts' dgrad and wgrad)
      3. backward dispatch  || forward MoE
      4. forward combine    || backward attention

    A step lasts the longer of the two, so an all-to-all shows its excess over the piece it is
    paired with (``ep_overlap_fraction`` of that piece can hide it; 1 = the schedule as built);
    the part hidden still slows the paired compute by ``ep_overlap_contention`` of its length
    (the SMs and HBM bandwidth the communication kernels take). A cross-node exchange longer
    than a short attention step is therefore exposed even with the overlap on; an intra-node
    one hides almost entirely."""
    pairs = ((other_s, halves.fwd_attn), (dispatch_s, halves.bwd_moe), (other_s, halves.fwd_moe),
             (other_s, halves.bwd_attn))
    exposed = 0.0
    for comm, piece in pairs:
        room = params.ep_overlap_fraction * piece
        exposed += max(0.0, comm - room) + params.ep_overlap_contention * min(comm, room)
    return exposed


def layer_halves(model: ModelSpec, plan: ParallelPlan, layer: int, *, fwd: float, fwd_attn: float,
                  backward: float, recompute: float, wgrad: float) -> LayerHalves:
    """Split a layer's compute into the attention half (projections, core, their selective
    recompute, the dense weights' main-grad traffic) and the MoE half (router, experts,
    permutes, the experts' main-grad traffic): the pieces the EP overlap pairs with."""
    counts = layer_param_counts(model, plan, layer)
    bwd_attn = 2 * fwd_attn + (recompute if plan.recompute == "selective" else 0.0) \
        + wgrad * counts.dense / max(1, counts.total)
    return LayerHalves(fwd_attn, fwd - fwd_attn, bwd_attn, backward - bwd_attn)


def cross_domain_share(model: ModelSpec, ep: int, in_domain: int) -> float:
    """Bytes a deduplicating dispatcher (DeepEP, HybridEP: one copy per remote domain, fanned
    out inside it over the scale-up link) sends across domains, as a share of the routed copies
    a plain all-to-all sends there: the token's expected remote domains over its remote copies."""
    domains = max(1, ep // max(1, in_domain))
    if domains == 1:
        return 1.0
    return model.distinct_shards_per_token(domains) / model.top_k
