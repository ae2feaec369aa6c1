"""Per-device memory of a plan: weights, gradients, optimizer states and activations.

Design decisions:
- Parameter counts per device are exact element counts of the sharded tensors (the unit test
  builds the same shards on the meta device and compares bytes): attention ``q/o`` and dense
  MLPs split ``1/tp`` (column/row parallel), GQA ``k/v`` split ``1/tp`` while ``tp`` divides the
  KV heads and one KV head per rank beyond that, MLA down-projections, norms and routers
  replicated, routed experts ``num_experts/ep`` per rank each split ``1/etp``, shared experts
  ``1/tp``, vocabulary-parallel embedding and head (rows rounded up to a multiple of ``tp``).
- Dense parameters (everything but routed experts) are sharded by the distributed optimizer over
  ``dp * cp`` ranks, routed experts over ``edp`` (Megatron's two optimizer groups). ZeRO-1 shards
  optimizer states, ZeRO-2 also gradients, ZeRO-3 (FSDP) also the weights -- and the FP8 weight
  copies with them (FSDP2 all-gathers FP8 weights), plus the two layers' worth of unsharded
  weights that prefetching keeps gathered.
- Adam's moments are FP32 (12 bytes a parameter with the FP32 master) or BF16 (8 bytes).
- Activations per layer and micro-batch follow Korthikanti et al. (sequence parallel, flash
  attention: no ``s^2`` term), counting the tensors saved for backward. 1F1B keeps
  ``min(pp - stage, num_microbatches)`` micro-batches in flight on a stage, times
  ``1 + (pp - 1) / (pp * vpp)`` with ``vpp`` virtual stages (interleaved 1F1B starts more
  micro-batches before the first backward); full recompute keeps only each layer's input plus
  one layer's working set.

Units: elements for counts, bytes for memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan, even_stage_starts

__all__ = ["ParamCounts", "MemoryBreakdown", "stage_param_counts", "all_stage_param_counts", "stage_memory",
           "stage_static_bytes", "stage_activation_bytes", "all_stage_activation_bytes", "estimate_memory",
           "layer_activation_bytes"]


@dataclass(frozen=True)
class ParamCounts:
    """Parameters held by one device of a stage, elements. ``expert`` = routed experts only."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device of pipeline stage ``stage``."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_moe_layers(model: ModelSpec, layers: range) -> int:
    """MoE layers among ``layers`` (they are the tail ``[first_k_dense_layers, L)``)."""
    if not model.is_moe:
        return 0
    return max(0, layers.stop - max(layers.start, model.first_k_dense_layers))


def attention_params_per_rank(model: ModelSpec, tp: int) -> int:
    """Attention weights one TP rank holds (norms excluded)."""
    if model.uses_mla:
        return model.attention_replicated_params() + model.attention_split_params() // tp
    h, hd = model.hidden_size, model.head_dim
    kv_heads = model.num_kv_heads // tp if model.num_kv_heads % tp == 0 else 1
    return 2 * h * model.num_heads * hd // tp + 2 * h * kv_heads * hd


def layer_param_counts(model: ModelSpec, plan: ParallelPlan, layer: int) -> ParamCounts:
    tp = plan.tp_of_layer(layer)
    dense = attention_params_per_rank(model, tp) + model.norm_params_per_layer()
    expert = 0
    if model.is_moe_layer(layer):
        dense += model.router_params() + model.num_shared_experts * model.expert_params() // tp
        expert = model.num_experts // plan.ep * model.expert_params() // plan.etp
    else:
        dense += model.dense_mlp_params() // tp
    return ParamCounts(dense, expert)


def stage_param_counts(model: ModelSpec, plan: ParallelPlan, stage: int) -> ParamCounts:
    """Parameters on one device of ``stage`` (embedding on the first stage, head on the last)."""
    return all_stage_param_counts(model, plan)[stage]


def all_stage_param_counts(model: ModelSpec, plan: ParallelPlan) -> tuple[ParamCounts, ...]:
    """:func:`stage_param_counts` of every stage."""
    # Only the sharding degrees and the split matter: memoise on them, since the planner asks
    # again for every micro-batch size and recompute mode of a shape (a plain tuple key:
    # building a canonical plan per call cost more than the counting)
    starts = plan.stage_starts or even_stage_starts(model.num_layers, plan.pp)
    key = (model, plan.tp, plan.pp, plan.ep, plan.etp, plan.layer_tp, starts)
    hit = _COUNTS.get(key)
    if hit is None:
        if len(_COUNTS) > 65536:
            _COUNTS.clear()
        hit = _COUNTS[key] = _all_counts(model, ParallelPlan(tp=plan.tp, pp=plan.pp, ep=plan.ep, etp=plan.etp,
                                                             dp=plan.ep * plan.etp, layer_tp=plan.layer_tp,
                                                             stage_starts=starts))
    return hit


_COUNTS: dict[tuple, tuple[ParamCounts, ...]] = {}


@lru_cache(maxsize=16384)
def _all_counts(model: ModelSpec, plan: ParallelPlan) -> tuple[ParamCounts, ...]:
    return tuple(_stage_param_counts(model, plan, s) for s in range(plan.pp))


def _stage_param_counts(model: ModelSpec, plan: ParallelPlan, stage: int) -> ParamCounts:
    layers = plan.stage_ranges(model.num_layers)[stage]
    if plan.layer_tp is None:
        # Two layer kinds only: count them instead of looping (the planner calls this a lot).
        num_moe = num_moe_layers(model, layers)
        num_dense = len(layers) - num_moe
        d = layer_param_counts(model, plan, 0) if num_dense else ParamCounts(0, 0)
        m = layer_param_counts(model, plan, model.num_layers - 1) if num_moe else ParamCounts(0, 0)
        dense, expert = num_dense * d.dense + num_moe * m.dense, num_dense * d.expert + num_moe * m.expert
    else:
        counts = [layer_param_counts(model, plan, i) for i in layers]
        dense, expert = sum(c.dense for c in counts), sum(c.expert for c in counts)
    vocab_rows = _ceil_div(model.vocab_size, plan.tp)
    if stage == 0:
        dense += vocab_rows * model.hidden_size
    if stage == plan.pp - 1:
        dense += vocab_rows * model.hidden_size + model.hidden_size
        if model.mtp_depth:  # each MTP module: one more last-layer block and a 2h -> h projection
            block = layer_param_counts(model, plan, model.num_layers - 1)
            dense += model.mtp_depth * (block.dense + 2 * model.hidden_size ** 2 // plan.tp)
            expert += model.mtp_depth * block.expert
    return ParamCounts(dense, expert)


def layer_activation_bytes(model: ModelSpec, plan: ParallelPlan, layer: int, params: CostParams) -> float:
    """Bytes one device saves for backward for one layer and one micro-batch.

    ``plan.recompute == "selective"`` recomputes norms, SwiGLU activations and (MLA) the q/k/v
    up-projections, so their outputs are not saved (DeepSeek-V3 section 3.2.3 / 3.3.3; Megatron's
    ``recompute_modules=["layernorm", "mla_up_proj", "moe_act"]``); Megatron's ``core_attn``
    saves nothing more under flash attention, so it prices as "none"; "full" is handled by the
    caller. Worked example: ``tests/unit/placement/test_recompute_memory.py``.
    Three kinds of tensors: those kept in BF16 (residual streams, attention's q/k/v and output,
    which flash attention saves itself); inputs used only by a Linear operator, which FP8
    training saves FP8-cast (Transformer Engine keeps the quantized input for the weight
    gradient); and SwiGLU's inputs, BF16 unless ``plan.activation_dtype == "fp8"`` (DeepSeek-V3
    section 3.3 caches them in FP8 too)."""
    tp = plan.tp_of_layer(layer)
    tokens = plan.micro_batch_size * model.seq_len / plan.cp
    h, nh, hd = model.hidden_size, model.num_heads, model.head_dim
    selective = plan.recompute == "selective"
    norm_out = 0 if selective else h
    act = 0 if selective else 1
    if model.uses_mla:
        # selective recompute rebuilds q/k/v from the saved latents (the "up-projection")
        qkv = 0 if selective else nh * (2 * (hd + model.rope_head_dim) + hd)
        linear_in = model.q_lora_rank + model.kv_lora_rank + model.rope_head_dim
    else:
        qkv, linear_in = (nh + 2 * model.num_kv_heads) * hd, 0
    keep = 2 * h + qkv + nh * hd  # residual into attention and into the MLP; q/k/v; core out
    linear_in += 2 * norm_out  # the two norms' outputs (q/k/v and MLP inputs)
    if model.is_moe_layer(layer):
        k, f, shared = model.top_k, model.moe_ffn_hidden_size, model.num_shared_experts
        # dispatched tokens (fc1 input) and activation outputs (fc2 input); routing
        # probabilities are applied inside the expert, so the expert output is not kept.
        linear_in += k * h + (k + shared) * f * act
        swiglu_in = 2 * (k + shared) * f
    else:
        linear_in += model.ffn_hidden_size * act
        swiglu_in = 2 * model.ffn_hidden_size
    fp8 = model.precision == "fp8"
    linear_bytes = params.fp8_activation_bytes if fp8 else params.activation_bytes
    swiglu_bytes = params.fp8_activation_bytes if plan.activation_dtype == "fp8" else params.activation_bytes
    return tokens * (keep * params.activation_bytes + linear_in * linear_bytes + swiglu_in * swiglu_bytes) / tp


def stage_static_bytes(model: ModelSpec, plan: ParallelPlan, counts: ParamCounts, num_stage_layers: int, *,
                       params: CostParams = CostParams(), zero_stage: int | None = None,
                       optimizer_dtype: str | None = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes on one device holding ``counts``;
    ``zero_stage`` / ``optimizer_dtype`` override the plan's (the planner tries several)."""
    dense_shard = plan.dp * plan.cp
    expert_shard = plan.edp
    z = plan.zero_stage if zero_stage is None else zero_stage
    dtype = plan.optimizer_dtype if optimizer_dtype is None else optimizer_dtype

    def sharded(bytes_per: int, on: bool) -> float:
        if not on:
            return float(counts.total * bytes_per)
        return counts.dense * bytes_per / dense_shard + counts.expert * bytes_per / expert_shard

    weight_bytes = params.weight_bytes(model.precision)
    weights = sharded(weight_bytes, z >= 3)
    if z >= 3:  # prefetch keeps the current and the next layer gathered
        weights += 2 * counts.total / max(1, num_stage_layers) * weight_bytes
    grads = sharded(params.grad_bytes, z >= 2)
    optim = sharded(params.optimizer_bytes if dtype == "fp32" else params.optimizer_bytes_bf16, z >= 1)
    return weights, grads, optim


def stage_activation_bytes(model: ModelSpec, plan: ParallelPlan, stage: int, *, num_microbatches: int,
                           params: CostParams = CostParams()) -> float:
    """Activations one device of ``stage`` holds at its peak (1F1B, see the module docstring)."""
    layers = plan.stage_ranges(model.num_layers)[stage]
    if plan.layer_tp is None:  # memoised on plain values: plans differing in dp share the answer
        return _stage_acts(model, plan.tp, plan.cp, plan.micro_batch_size, plan.recompute, plan.vpp, plan.pp,
                           min(plan.pp - stage, num_microbatches), layers.start, layers.stop,
                           stage == plan.pp - 1, params, plan.activation_dtype)
    in_flight = min(plan.pp - stage, num_microbatches)
    if plan.vpp > 1:
        in_flight *= 1 + (plan.pp - 1) / (plan.pp * plan.vpp)
    tokens = plan.micro_batch_size * model.seq_len / plan.cp
    if plan.layer_tp is None:
        kinds = _layer_kinds(model, layers.start, layers.stop)
        per_layer = [_layer_acts(model, plan.tp, plan.cp, plan.micro_batch_size, plan.recompute, moe, params,
                                 plan.activation_dtype) for moe, _ in kinds]
        counts = [n for _, n in kinds]
    else:
        per_layer = [layer_activation_bytes(model, plan, i, params) for i in layers]
        counts = [1] * len(layers)
    if plan.recompute == "full":
        checkpoint = tokens * model.hidden_size / plan.tp * params.activation_bytes
        acts = in_flight * len(layers) * checkpoint + max(per_layer)
    else:
        acts = in_flight * sum(b * n for b, n in zip(per_layer, counts))
    if stage == plan.pp - 1:
        # logits and their gradient for the micro-batch being finished (vocab-parallel)
        acts += (1 + model.mtp_depth) * 2 * tokens * _ceil_div(model.vocab_size, plan.tp) * params.logits_bytes
        acts += model.mtp_depth * in_flight * (checkpoint if plan.recompute == "full" else per_layer[-1])
    return acts


def all_stage_activation_bytes(model: ModelSpec, plan: ParallelPlan, *, num_microbatches: int,
                               params: CostParams = CostParams(), vpp: int | None = None,
                               activation_dtype: str | None = None) -> tuple[float, ...]:
    """:func:`stage_activation_bytes` of every stage (memoised on plain values); ``vpp`` /
    ``activation_dtype`` override the plan's (the planner tries several)."""
    vpp = plan.vpp if vpp is None else vpp
    act = plan.activation_dtype if activation_dtype is None else activation_dtype
    if plan.layer_tp is not None:
        plan = replace(plan, vpp=vpp, activation_dtype=act)
        return tuple(stage_activation_bytes(model, plan, s, num_microbatches=num_microbatches, params=params)
                     for s in range(plan.pp))
    # in flight is min(pp - stage, m): m beyond pp changes nothing
    return _all_stage_acts(model, plan.tp, plan.cp, plan.micro_batch_size, plan.recompute, vpp, plan.pp,
                           min(num_microbatches, plan.pp), plan.stage_starts or even_stage_starts(model.num_layers,
                                                                                                   plan.pp),
                           params, act)


@lru_cache(maxsize=65536)
def _all_stage_acts(model: ModelSpec, tp: int, cp: int, mbs: int, recompute: str, vpp: int, pp: int, m: int,
                    starts: tuple[int, ...], params: CostParams, act_dtype: str) -> tuple[float, ...]:
    stops = starts[1:] + (model.num_layers,)
    return tuple(_stage_acts(model, tp, cp, mbs, recompute, vpp, pp, min(pp - s, m), starts[s], stops[s],
                             s == pp - 1, params, act_dtype) for s in range(pp))


@lru_cache(maxsize=65536)
def _stage_acts(model: ModelSpec, tp: int, cp: int, mbs: int, recompute: str, vpp: int, pp: int, in_flight: int,
                start: int, stop: int, last: bool, params: CostParams, act_dtype: str = "bf16") -> float:
    scale = 1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0
    tokens = mbs * model.seq_len / cp
    kinds = _layer_kinds(model, start, stop)
    per_layer = [_layer_acts(model, tp, cp, mbs, recompute, moe, params, act_dtype) for moe, _ in kinds]
    mtp = model.mtp_depth if last else 0  # each MTP module holds one more last-layer block
    if recompute == "full":
        acts = in_flight * scale * (stop - start + mtp) * tokens * model.hidden_size / tp * params.activation_bytes \
            + max(per_layer)
    else:
        acts = in_flight * scale * (sum(b * n for b, (_, n) in zip(per_layer, kinds)) + mtp * per_layer[-1])
    if last:
        acts += (1 + model.mtp_depth) * 2 * tokens * _ceil_div(model.vocab_size, tp) * params.logits_bytes
    return acts


@lru_cache(maxsize=65536)
def _layer_kinds(model: ModelSpec, start: int, stop: int) -> tuple[tuple[bool, int], ...]:
    """(is MoE, layers of that kind) present in layers [start, stop), dense first."""
    num_moe = num_moe_layers(model, range(start, stop))
    return tuple((moe, n) for moe, n in ((False, stop - start - num_moe), (True, num_moe)) if n)


@lru_cache(maxsize=65536)
def _layer_acts(model: ModelSpec, tp: int, cp: int, mbs: int, recompute: str, moe: bool, params: CostParams,
                act_dtype: str = "bf16") -> float:
    # the planner asks for the same two layer kinds thousands of times
    layer = model.num_layers - 1 if moe else 0
    return layer_activation_bytes(model, ParallelPlan(tp=tp, cp=cp, micro_batch_size=mbs, recompute=recompute,
                                                      activation_dtype=act_dtype), layer, params)


def stage_memory(model: ModelSpec, plan: ParallelPlan, stage: int, *, num_microbatches: int,
                 params: CostParams = CostParams(), counts: ParamCounts | None = None) -> MemoryBreakdown:
    """Memory of one device of ``stage`` running ``num_microbatches`` per step (1F1B)."""
    counts = counts or stage_param_counts(model, plan, stage)
    layers = plan.stage_ranges(model.num_layers)[stage]
    weights, grads, optim = stage_static_bytes(model, plan, counts, len(layers), params=params)
    acts = stage_activation_bytes(model, plan, stage, num_microbatches=num_microbatches, params=params)
    return MemoryBreakdown(stage, weights, grads, optim, acts)


def _representatives(model: ModelSpec, plan: ParallelPlan, layers: range) -> list[int]:
    if plan.layer_tp is not None:
        return list(layers)
    # one layer of each kind present in the stage (dense layers come first)
    kinds: dict[bool, int] = {}
    for i in (layers.start, layers.stop - 1):
        kinds.setdefault(model.is_moe_layer(i), i)
    return list(kinds.values())


def _representative_counts(model: ModelSpec, plan: ParallelPlan, layers: range) -> list[int]:
    if plan.layer_tp is not None:
        return [1] * len(layers)
    reps = _representatives(model, plan, layers)
    num_moe = num_moe_layers(model, layers)
    return [num_moe if model.is_moe_layer(i) else len(layers) - num_moe for i in reps]


def estimate_memory(model: ModelSpec, plan: ParallelPlan, *, params: CostParams = CostParams(),
                    num_microbatches: int | None = None) -> MemoryBreakdown:
    """The worst (largest) stage's per-device memory."""
    m = num_microbatches if num_microbatches is not None else plan.num_microbatches(model.global_batch_sequences)
    return max((stage_memory(model, plan, s, num_microbatches=m, params=params) for s in range(plan.pp)),
               key=lambda b: b.total)
