"""Predicted training step time of a plan on one accelerator type.

Design decisions:
- Work is priced per layer and per micro-batch on one device, then assembled into a pipeline
  by :func:`rayfleet.placement.pipeline_schedule.pipeline_seconds` (1F1B, interleaved, DualPipeV;
  with fewer micro-batches than stages the step is at least the sum of the stages), followed by
  the DP gradient reduction (partly hidden behind the last backward) and the optimizer step
  (HBM-bound). Interleaved virtual stages send ``vpp`` times as often but hide the sends behind
  the stage's compute.
- ZeRO-2 reduce-scatters gradients every micro-batch and ZeRO-3 (FSDP) also all-gathers the
  weights for its forward and its backward; prefetched a layer ahead, they hide behind that
  micro-batch's whole compute, so only the first layer's share and the excess are on the
  critical path (:func:`_sharded_exposure`).
- Hidden is not free: compute beside a DP/ZeRO collective or overlapped TP communication runs
  ~19% slower (measured, ``CostParams.collective_overlap_slowdown``), so the hidden seconds still
  cost ``s / (1 + s)`` of themselves, scaled by the carrying link's rate (:func:`overlap_slowdown_s`).
- Compute: forward FLOPs per token from :class:`ModelSpec`, x3 for forward+backward, +1 forward
  with full recompute, +attention core forward (and MLA's q/k/v up-projections) with selective
  recompute. GEMMs run at the catalogue's peak for the model's precision (FP8 or BF16) times
  ``gemm_efficiency``; fused attention and the output head stay BF16. Backward also pays the
  HBM traffic of folding each micro-batch's weight gradient into the FP32 main grads
  (:func:`wgrad_accumulation_s`), per local parameter whatever the token count. Each device
  computes ``1/(tp*cp)`` of a replica's tokens in every layer; an MoE layer's routed work and
  all-to-all run at the busiest EP rank's load (:func:`moe_load_factor`, by the model's routing).
- Communication per layer and micro-batch (sequence-parallel Megatron layout):
  TP all-gather + reduce-scatter pairs around attention, the dense MLP and the shared experts on
  the scale-up link (exposed in full when the run has no TP overlap); EP dispatch/combine
  all-to-alls (FP8 dispatch under FP8) split into the in-domain and cross-domain parts (one copy
  per remote domain with a deduplicating dispatcher); where the schedule pairs micro-batches
  (:func:`ep_overlap_possible`) each all-to-all runs beside one compute piece of the other
  micro-batch and shows its excess over that piece plus a contention cost
  (:func:`ep_exposed_all_to_all`);
  ETP gathers of dispatched tokens; CP ring K/V exchange; PP activation send/recv, on the NIC
  when stage peers sit on different nodes.
- Ranks fill scale-up domains in the ``tp, cp, dp, pp`` order (as the layout does).

The EP all-to-all overlap model lives in :mod:`rayfleet.placement.ep_overlap` (re-exported
here). Units: seconds per step unless a name says "per micro-batch".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from rayfleet.placement.cost_params import (CostParams, Link, all_to_all_time, hierarchical_allreduce_time,
                                           link_rate_share, overlap_slowdown_s, ring_time)
from rayfleet.placement.ep_overlap import (LayerHalves, cross_domain_share, ep_exposed_all_to_all,
                                           ep_overlap_possible, layer_halves)
from rayfleet.placement.memory_model import ParamCounts, layer_param_counts, num_moe_layers
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.moe_load import expert_load_factor
from rayfleet.placement.pipeline_schedule import pipeline_seconds
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.catalogue import AcceleratorSpec

__all__ = ["LayerHalves", "LayerTime", "StepTimeBreakdown", "ep_exposed_all_to_all", "ep_overlap_possible",
           "exposed_p2p", "layer_time", "layer_times", "estimate_step_time", "moe_load_factor", "overlap_slowdown_s",
           "wgrad_accumulation_s"]


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, one device: seconds by kind (forward + backward)."""

    compute: float
    backward_compute: float
    tp_comm: float
    ep_comm: float
    cp_comm: float
    # the part of backward_compute that computes weight gradients (DualPipe's W): one pass of the
    # forward GEMMs plus folding them into the main grads
    weight_grad_compute: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.ep_comm + self.cp_comm


@dataclass(frozen=True)
class StepTimeBreakdown:
    """Seconds of one optimizer step, split by cause along the critical path."""

    compute: float
    tp_comm: float
    ep_comm: float
    cp_comm: float
    pp_p2p: float
    pp_bubble: float
    dp_comm: float
    optimizer: float
    stage_microbatch_s: tuple[float, ...]
    # per stage, one micro-batch's compute (what hides interleaved sends), and one chunk's send:
    # with them the planner prices other virtual-stage counts in closed form
    stage_compute_s: tuple[float, ...] = ()
    pp_send_s: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.ep_comm + self.cp_comm + self.pp_p2p + self.pp_bubble
                + self.dp_comm + self.optimizer)

    @property
    def bottleneck(self) -> str:
        parts = {"compute": self.compute, "TP comm": self.tp_comm, "EP all-to-all": self.ep_comm,
                 "CP comm": self.cp_comm, "PP send/recv": self.pp_p2p, "PP bubble": self.pp_bubble,
                 "DP grad reduce": self.dp_comm, "optimizer": self.optimizer}
        return max(parts, key=parts.__getitem__)


def _domain(accel: AcceleratorSpec) -> int:
    return accel.scaleup_domain_size


def wgrad_accumulation_s(model: ModelSpec, plan: ParallelPlan, layer: int, accel: AcceleratorSpec,
                         params: CostParams = CostParams()) -> float:
    """HBM seconds one micro-batch's weight-gradient GEMMs of ``layer`` spend folding their
    result into the FP32 main-grad buffer, on top of their FLOP time.

    Megatron accumulates each micro-batch's weight gradient straight into the FP32 ``main_grad``
    (``gradient_accumulation_fusion``; Transformer Engine's grouped GEMM does the same for the
    experts): the GEMM's epilogue reads and writes ``wgrad_accumulation_bytes`` per local
    parameter after its reduction over the micro-batch's tokens, so that traffic follows the
    reduction rather than hiding under it, and it does not shrink with the token count. Its
    weight is ``bytes x params / (2 x rows x params / peak)``: negligible for a dense layer's
    thousands of rows, comparable to the FLOPs for a fine-grained expert fed a few hundred
    (``rows = tokens x top_k x ep / num_experts``). It is what makes keeping many experts local
    (small EP, context parallelism shrinking the rows) cost more than a FLOP count says.
    Forward and dgrad read each weight once inside their main loop (1-2 bytes per parameter)
    and stay compute-bound above ~200 rows: not priced."""
    if params.wgrad_accumulation_bytes <= 0:
        return 0.0
    counts = layer_param_counts(model, plan, layer)
    return params.wgrad_accumulation_bytes * counts.total / (accel.hbm_bandwidth_gbps * 1e9)


def moe_load_factor(model: ModelSpec, plan: ParallelPlan, tokens_per_rank: float,
                    params: CostParams = CostParams()) -> float:
    """The busiest EP rank's routed copies over the mean, under ``model.moe_routing``
    (:func:`rayfleet.placement.moe_load.expert_load_factor`); ``tokens_per_rank`` is one
    micro-batch's tokens a rank routes (after the TP sequence split)."""
    return expert_load_factor(routing=model.moe_routing, num_experts=model.num_experts, ep=plan.ep,
                              copies_per_rank=tokens_per_rank * model.top_k,
                              capacity_factor=model.moe_capacity_factor,
                              dropless_load_cv=params.dropless_expert_load_cv)


def _gemm_precision(model: ModelSpec, accel: AcceleratorSpec) -> str:
    """The precision the GEMMs really run in: FP8 training falls back to BF16 without FP8 units."""
    return "fp8" if model.precision == "fp8" and accel.peak_fp8_tflops is not None else "bf16"


def layer_time(model: ModelSpec, plan: ParallelPlan, layer: int, accel: AcceleratorSpec,
               params: CostParams = CostParams()) -> LayerTime:
    """Forward+backward time of ``layer`` for one micro-batch on one device."""
    tp = plan.tp_of_layer(layer)
    tokens = plan.micro_batch_size * model.seq_len / plan.cp  # tokens of the replica's CP shard
    h = model.hidden_size
    gemm_peak = accel.peak_tflops(model.precision) * 1e12 * params.gemm_efficiency_for(_gemm_precision(model, accel))
    attn_peak = accel.peak_bf16_tflops * 1e12 * params.attention_efficiency
    core = model.attention_core_flops_per_token()
    gemm = model.layer_forward_flops_per_token(layer) - core
    # Rows per GEMM: a full micro-batch shard for attention/dense/shared-expert GEMMs (after the
    # sequence-parallel all-gather); for routed experts the tokens a device receives, spread over
    # its local experts -- small grouped GEMMs run well below peak.
    dense_eff = tokens / (tokens + params.gemm_rows_at_half_efficiency)
    fwd_gemm = tokens * gemm / plan.tp / (gemm_peak * dense_eff)
    load = moe_load_factor(model, plan, tokens / tp, params) if model.is_moe_layer(layer) else 1.0
    if model.is_moe_layer(layer):
        # the busiest EP rank's copies (x load: moe_load) set the routed GEMMs, permutes and casts
        routed = 2.0 * model.top_k * model.expert_params()
        rows = load * tokens / tp * model.top_k * plan.etp / (model.num_experts / plan.ep)
        expert_eff = rows / (rows + params.gemm_rows_at_half_efficiency)
        fwd_gemm += tokens * routed / plan.tp / gemm_peak * (load / expert_eff - 1 / dense_eff)
        # permute / unpermute / probability scaling of every routed copy: HBM-bound, fwd + bwd
        copies = load * tokens / tp * model.top_k
        fwd_gemm += copies * h * params.moe_permute_bytes / 3 / (accel.hbm_bandwidth_gbps * 1e9)
        if _gemm_precision(model, accel) == "fp8":
            # current scaling quantises each expert GEMM's activation input per routed copy: fc1's
            # and fc2's inputs forward (hidden, width), their output gradients backward (hidden,
            # 2 x width), each read for its amax, read again and written row- and column-wise
            fwd_gemm += copies * (2 * h + 3 * model.moe_ffn_hidden_size / plan.etp) * \
                params.fp8_cast_bytes / 3 / (accel.hbm_bandwidth_gbps * 1e9)
        # the dispatch's host synchronisation (token counts) and the layer's kernel launches: a
        # fixed cost per MoE layer and micro-batch, whatever its token count
        fwd_gemm += params.moe_layer_overhead_s
    fwd_core = tokens * core / plan.tp / attn_peak
    fwd = fwd_gemm + fwd_core
    recompute = fwd if plan.recompute == "full" else fwd_core if plan.recompute == "selective" else 0.0
    if plan.recompute == "selective" and model.uses_mla:
        # the memory model's selective mode drops MLA's q/k/v (rebuilt from the saved latents),
        # so backward reruns the up-projection GEMMs too
        up = model.attention_split_params() - model.num_heads * model.head_dim * h
        recompute += tokens * 2 * up / tp / (gemm_peak * dense_eff)
    wgrad = wgrad_accumulation_s(model, plan, layer, accel, params)
    backward = 2 * fwd + recompute + wgrad
    compute = fwd + backward
    fwd_attn = tokens * 2.0 * model.attention_params() / plan.tp / (gemm_peak * dense_eff) + fwd_core
    halves = layer_halves(model, plan, layer, fwd=fwd, fwd_attn=fwd_attn, backward=backward,
                           recompute=recompute, wgrad=wgrad)

    link = Link.scaleup(accel, params)
    nic = Link.scaleout(accel, params)
    fp8 = model.precision == "fp8"
    ag_bytes = params.comm_bytes_fp8 if fp8 else params.comm_bytes_bf16
    rs_bytes = params.comm_bytes_bf16
    # One "TP pair" = all-gather before a column-parallel GEMM + reduce-scatter after the row-
    # parallel one, forward; the backward mirrors both in BF16.
    # Full recompute reruns the layer's forward collectives too (TP pair, EP dispatch/combine,
    # ETP gathers; no EP overlap then): Megatron-Bridge, "Activation Recomputation".
    rerun = 1 if plan.recompute == "full" else 0
    pair = (1 + rerun) * ring_time(tokens * h * ag_bytes, tp, link) + (3 + rerun) * ring_time(tokens * h * rs_bytes, tp, link)
    num_pairs = 1  # attention
    ep_comm = 0.0
    if model.is_moe_layer(layer):
        num_pairs += 1 if model.num_shared_experts else 0
        local = load * tokens / tp * model.top_k * h  # elements the busiest rank receives (and sends back)
        in_domain = min(plan.ep, max(1, _domain(accel) // plan.etp))
        cross = cross_domain_share(model, plan.ep, in_domain) if plan.ep_dedup else 1.0
        dispatch = all_to_all_time(local * ag_bytes, plan.ep, in_domain, link, nic, cross)
        rest = all_to_all_time(local * rs_bytes, plan.ep, in_domain, link, nic, cross)
        ep_comm = ep_exposed_all_to_all(dispatch, rest, halves, params) if ep_overlap_possible(plan) \
            else dispatch + 3 * rest + rerun * (dispatch + rest)
        if plan.etp > 1:
            gathered = local * plan.etp
            ep_comm += (1 + rerun) * ring_time(gathered * ag_bytes, plan.etp, link) \
                + (3 + rerun) * ring_time(gathered * rs_bytes, plan.etp, link)
    else:
        num_pairs += 1
    hidden = params.tp_overlap_fraction if plan.tp_overlap else 0.0
    # the hidden share still slows the GEMMs it runs beside (on the scale-up link: full rate)
    tp_comm = (1 - hidden) * num_pairs * pair + overlap_slowdown_s(hidden * num_pairs * pair, params) \
        if tp > 1 else 0.0

    cp_comm = 0.0
    if plan.cp > 1:
        if model.uses_mla:
            kv_width = model.num_heads * (2 * model.head_dim + model.rope_head_dim)
        else:
            kv_width = 2 * model.num_kv_heads * model.head_dim
        kv_bytes = tokens * kv_width / tp * params.comm_bytes_bf16
        cp_link = link if plan.tp * plan.cp <= _domain(accel) else nic
        # forward passes K/V around the ring once, backward passes K/V and dK/dV
        steps = 3 * (plan.cp - 1)
        cp_comm = (1 - params.cp_overlap_fraction) * steps * (cp_link.latency_s + kv_bytes / cp_link.bytes_per_s)
    return LayerTime(compute, backward, tp_comm, ep_comm, cp_comm, weight_grad_compute=fwd_gemm + wgrad)


def layer_times(model: ModelSpec, plan: ParallelPlan, accel: AcceleratorSpec,
                params: CostParams = CostParams()) -> tuple[LayerTime, ...]:
    """``layer_time`` of every layer, computing each distinct (kind, TP degree) once.

    Only the degrees a layer sees (tp, cp, ep, etp, micro-batch, recompute, per-layer TP) matter,
    so results are memoised on those: the planner prices one shape at many dp/pp/ZeRO choices."""
    key = ParallelPlan(tp=plan.tp, cp=plan.cp, ep=plan.ep, etp=plan.etp, micro_batch_size=plan.micro_batch_size,
                       recompute=plan.recompute, layer_tp=plan.layer_tp, dp=plan.ep * plan.etp,
                       pp=1 if ep_overlap_possible(plan) else 2,  # pp, vpp, dualpipe: only the EP overlap
                       ep_dedup=plan.ep_dedup, tp_overlap=plan.tp_overlap)
    return _layer_times(model, key, accel, params)


@lru_cache(maxsize=16384)
def _layer_times(model: ModelSpec, plan: ParallelPlan, accel: AcceleratorSpec,
                 params: CostParams) -> tuple[LayerTime, ...]:
    cache: dict[tuple[bool, int], LayerTime] = {}
    out = []
    for layer in range(model.num_layers):
        key = (model.is_moe_layer(layer), plan.tp_of_layer(layer))
        if key not in cache:
            cache[key] = layer_time(model, plan, layer, accel, params)
        out.append(cache[key])
    return tuple(out)


def edge_times(model: ModelSpec, plan: ParallelPlan, accel: AcceleratorSpec,
               params: CostParams = CostParams()) -> tuple[float, float]:
    """(embedding, output head + loss) time per micro-batch per device, forward+backward."""
    tokens = plan.micro_batch_size * model.seq_len / plan.cp
    peak = accel.peak_bf16_tflops * 1e12 * params.gemm_efficiency_for(_gemm_precision(model, accel))
    head = 3 * tokens * model.head_forward_flops_per_token() / plan.tp / peak
    if model.mtp_depth:  # DeepSeek-V3 sec. 2.2: an MTP module = one more block, a 2h->h projection, a head pass
        block = layer_time(model, plan, model.num_layers - 1, accel, params)
        head += model.mtp_depth * (head + 12 * tokens * model.hidden_size ** 2 / plan.tp / peak + block.compute
                                   + block.tp_comm + block.ep_comm + block.cp_comm)
    embed = tokens * model.hidden_size * params.activation_bytes * 2 / plan.tp / (accel.hbm_bandwidth_gbps * 1e9)
    return embed, head


def _sharded_exposure(plan: ParallelPlan, counts: ParamCounts, allreduce_s: float, compute_s: float,
                      params: CostParams, link: Link, nic: Link, domain: int, num_layers: int) -> float:
    """Exposed ZeRO-2/3 communication of one micro-batch: half the all-reduce (the gradient
    reduce-scatter) plus, for ZeRO-3, two weight all-gathers, less what hides behind its compute.

    The collectives are issued layer by layer and prefetched one layer ahead on their own stream
    (FSDP, Megatron-FSDP), so they run beside the whole micro-batch's compute: with ``L`` equal
    layers the pipeline ``c + (L-1) max(c, p) + p`` (``c``, ``p``: one layer's communication and
    compute) exposes the first layer's share plus what the communication exceeds the compute by,
    ``comm / L + (L-1)/L x max(0, comm - compute)``. A flat ``dp_overlap_fraction`` of the compute
    (the end-of-step ZeRO-1 reduction's rule) left 20% of every micro-batch unable to hide
    anything, which priced a NIC-bound FSDP run ~5 s too slow."""
    comm = allreduce_s / 2
    if plan.zero_stage >= 3:
        group = plan.dp * plan.cp
        comm += 2 * ring_time(counts.total * params.param_bytes, group,
                              link if group * plan.tp <= domain else nic)
    layers = max(1, num_layers)
    exposed = comm / layers + (layers - 1) / layers * max(0.0, comm - compute_s)
    spans = plan.dp * plan.cp * plan.tp > domain
    share = link_rate_share(nic if spans else link, link)
    return exposed + overlap_slowdown_s(comm - exposed, params, rate_share=share)


def exposed_p2p(send_s: float, vpp: int, compute_s: float, params: CostParams, *, dualpipe: bool = False) -> float:
    """Exposed pipeline send/recv of one micro-batch on a stage whose micro-batch compute is
    ``compute_s``: each of the ``vpp`` chunks sends its activation forward and its gradient back.

    The plain 1F1B schedule sends synchronously (Megatron-Bridge batches the sends instead), so
    all of it is exposed; the interleaved schedule posts them asynchronously behind the next
    chunk's compute (``overlap_p2p_comm``, which Megatron-Bridge turns on exactly when there are
    virtual stages), hiding up to ``p2p_overlap_fraction`` of that compute -- the same bounded
    form as the EP and DP overlaps, so a stage with little compute still pays for its sends.
    DualPipe(V) sends for its two chunks and overlaps them the same way."""
    chunks = 2 if dualpipe else vpp
    total = 2 * chunks * send_s
    if chunks == 1:
        return total
    return max(0.0, total - params.p2p_overlap_fraction * compute_s)


def estimate_step_time(model: ModelSpec, plan: ParallelPlan, accel: AcceleratorSpec, *,
                       num_microbatches: int, stage_counts: Sequence[ParamCounts],
                       params: CostParams = CostParams(), times: Sequence[LayerTime] | None = None) -> StepTimeBreakdown:
    """Step time of ``plan`` (its ``stage_starts`` already chosen) for a replica running
    ``num_microbatches`` micro-batches; ``stage_counts[s]`` = parameters per device of stage s."""
    times = times or layer_times(model, plan, accel, params)
    embed, head = edge_times(model, plan, accel, params)
    link, nic = Link.scaleup(accel, params), Link.scaleout(accel, params)
    domain = _domain(accel)
    m = num_microbatches
    ranges = plan.stage_ranges(model.num_layers)

    send = 0.0  # one chunk's activation (or gradient) to the next stage
    if plan.pp > 1:
        tokens = plan.micro_batch_size * model.seq_len / plan.cp
        act = tokens * model.hidden_size / plan.tp * params.activation_bytes
        pp_link = nic if plan.tp * plan.cp * plan.dp >= domain else link
        send = pp_link.latency_s + act / pp_link.bytes_per_s

    stage_t, parts, p2ps = [], [], []
    for s, layers in enumerate(ranges):
        if plan.layer_tp is None:
            num_moe = num_moe_layers(model, layers)
            kinds = [(times[layers.start], len(layers) - num_moe), (times[layers.stop - 1], num_moe)]
        else:
            kinds = [(times[i], 1) for i in layers]
        comp = sum(t.compute * n for t, n in kinds) + (embed if s == 0 else 0.0) + (head if s == plan.pp - 1 else 0.0)
        tp_c = sum(t.tp_comm * n for t, n in kinds)
        ep_c = sum(t.ep_comm * n for t, n in kinds)
        cp_c = sum(t.cp_comm * n for t, n in kinds)
        bwd = sum(t.backward_compute * n for t, n in kinds)
        wgt = sum(t.weight_grad_compute * n for t, n in kinds)
        p2p = exposed_p2p(send, plan.vpp, comp, params, dualpipe=plan.dualpipe) if plan.pp > 1 else 0.0
        stage_t.append(comp + tp_c + ep_c + cp_c + p2p)
        parts.append((comp, tp_c, ep_c, cp_c, bwd, wgt))
        p2ps.append(p2p)

    slowest = max(range(plan.pp), key=stage_t.__getitem__)
    pipeline = pipeline_seconds(stage_t, num_microbatches=m, vpp=plan.vpp, dualpipe=plan.dualpipe,
                                stage_backward_s=[p[4] for p in parts], stage_weight_grad_s=[p[5] for p in parts])
    comp, tp_c, ep_c, cp_c, *_ = parts[slowest]
    steady = m * stage_t[slowest]

    tail = 0.0
    for s in range(plan.pp):
        counts = stage_counts[s]
        dense_group, expert_group = plan.dp * plan.cp, plan.edp
        dp_t = hierarchical_allreduce_time(counts.dense * params.grad_reduce_bytes, dense_group,
                                           min(dense_group, max(1, domain // plan.tp)), link, nic)
        dp_t += hierarchical_allreduce_time(counts.expert * params.grad_reduce_bytes, expert_group,
                                            min(expert_group, max(1, domain // (plan.ep * plan.etp))), link, nic)
        exposed = max(0.0, dp_t - params.dp_overlap_fraction * parts[s][4])
        spans = dense_group * plan.tp > domain
        exposed += overlap_slowdown_s(dp_t - exposed, params, rate_share=link_rate_share(nic if spans else link, link))
        if plan.zero_stage >= 2:  # never cheaper than ZeRO-1: the same bytes, more often
            exposed = max(exposed, m * _sharded_exposure(plan, counts, dp_t, parts[s][0], params, link, nic, domain,
                                                         len(ranges[s])))
        shard = (counts.dense / (dense_group if plan.zero_stage >= 1 else 1)
                 + counts.expert / (expert_group if plan.zero_stage >= 1 else 1))
        opt = shard * params.optimizer_bytes_touched / (accel.hbm_bandwidth_gbps * 1e9)
        if exposed + opt > tail:
            tail, dp_part, opt_part = exposed + opt, exposed, opt
    if tail == 0.0:
        dp_part = opt_part = 0.0
    return StepTimeBreakdown(
        compute=m * comp, tp_comm=m * tp_c, ep_comm=m * ep_c, cp_comm=m * cp_c,
        pp_p2p=m * p2ps[slowest], pp_bubble=pipeline - steady,
        dp_comm=dp_part, optimizer=opt_part, stage_microbatch_s=tuple(stage_t),
        stage_compute_s=tuple(p[0] for p in parts), pp_send_s=send,
    )
