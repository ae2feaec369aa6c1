"""Named constants of the cost model, and the link/collective primitives it prices with.

Design decisions:
- Hardware numbers (peak FLOP/s, HBM, link and NIC bandwidth, NVLink-domain size) come only from
  :mod:`rayfleet.platform.catalogue`; everything else the model assumes (efficiencies, byte
  widths, overlap, latencies) is a field of :class:`CostParams`, so a calibration run can
  replace them and a reader can see every assumption in one place.
- Collectives use the alpha-beta model: ``latency + bytes / (bandwidth * efficiency)`` with the
  ring volumes ``(n-1)/n`` for all-gather/reduce-scatter and all-to-all. A group that spans
  scale-up domains is priced hierarchically: the in-domain part on the scale-up link, the rest
  on the per-rail NIC (one NIC per accelerator, so rail-aligned rings run in parallel).

Units: bytes, seconds, GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.platform.catalogue import AcceleratorSpec

# Measured (docs/planner-calibration.md, calibration/routing_pairs.py): relative spread of per-expert
# loads under a learned dropless router, from runs that differ only in their routing (1.82 until
# full recompute paid its rerun all-to-all: the pairs' MoE share grew, the median fell to 1.7336).
DROPLESS_EXPERT_LOAD_CV = 1.73

__all__ = ["CostParams", "Link", "ring_time", "hierarchical_allreduce_time", "all_to_all_time", "overlap_slowdown_s",
           "link_rate_share"]


@dataclass(frozen=True)
class CostParams:
    """Every non-hardware constant of the cost model.

    The efficiency constants (GEMM and attention efficiency, the small-GEMM knee, MoE permute
    bytes and per-layer overhead, the EP overlap's contention, TP overlap) are fitted to published H100 runs by
    :func:`rayfleet.placement.calibration.fit_efficiency` (table: ``calibration/published_runs.yaml``).

    Attributes:
        gemm_efficiency: fraction of the catalogue's dense peak that large GEMMs reach.
        bf16_gemm_efficiency: the same for a model trained in BF16. A measured, not fitted,
            constant: large BF16 GEMMs on H100 SXM reach ~710-720 of 989 TFLOP/s (cuBLAS; see
            docs/planner-calibration.md for the sources). ``gemm_efficiency`` is fitted on FP8
            training runs and carries what FP8 adds per GEMM (the current-scaling amax and cast
            kernels, FP8 reaching a smaller share of its doubled peak), so it cannot be reused
            for BF16 runs: one constant for both made every BF16 row ~30% too slow.
        gemm_rows_at_half_efficiency: a GEMM with this many rows (tokens) runs at half of
            ``gemm_efficiency`` (efficiency x rows / (rows + this)); it is what makes many small
            local experts (small EP) slower than a few well-fed ones.
        moe_permute_bytes: HBM bytes moved per element of every routed token copy per MoE layer
            (permute, unpermute, probability scaling, the dispatcher's buffers, the grouped GEMMs'
            own operand traffic; forward and backward), memory-bound. It replaced a "narrow
            expert" knee that scaled the expert GEMMs' FLOP time by ``1 + 1536 / ffn_width``:
            that extra is ``6 x tokens x top_k x hidden x 1536`` FLOPs whatever the width, i.e.
            a per-routed-element cost like this one, but priced at the GEMM peak, so it doubled
            when a run trained in BF16 (half the FP8 peak) and made BF16 MoE rows ~30% too slow.
        moe_layer_overhead_s: seconds of one MoE layer's forward per micro-batch that do not
            scale with its tokens (backward pays twice, recompute once more): a dropless dispatch
            synchronises the host on the received token counts before the expert GEMMs can be
            launched, so the layer's launches are exposed; plans with many small micro-batches
            (TP4 with MBS 1, deep interleaving) pay it most.
        attention_efficiency: fraction of the BF16 peak that fused attention reaches.
        param_bytes: bytes per stored weight (BF16 master copy on device for FP8 too).
        grad_bytes: bytes per gradient (FP32 main grads, as Megatron keeps them).
        optimizer_bytes: FP32 master weight + Adam m and v, bytes per parameter.
        optimizer_bytes_bf16: the same with BF16 moments (``plan.optimizer_dtype == "bf16"``).
        fp8_primary_weights: FP8 training keeps the weights only in FP8 (row- and column-wise
            copies; the FP32 master lives in the optimizer states), as Megatron-Bridge's FP8
            recipes do (``fp8_param_gather``): no BF16 copy on the device. The embedding, head and
            norms stay BF16, which is the same two bytes.
        fp8_weight_cache_bytes: FP8 training caches each GEMM weight in FP8 in both row- and
            column-wise layouts (Transformer Engine), bytes per parameter.
        fp8_cast_bytes: HBM bytes per element that FP8 current scaling moves to quantise a GEMM's
            activation input (read for the amax, read again, written row- and column-wise:
            2 + 2 + 1 + 1). Priced for the routed experts' inputs (per copy, where they are a
            share of the FLOPs that grows as experts narrow); a dense GEMM's casts are
            ``1 / hidden`` of its FLOPs and are left in ``gemm_efficiency``.
        activation_bytes: bytes per saved activation element (BF16).
        fp8_activation_bytes: bytes per Linear/SwiGLU input saved with ``activation_dtype ==
            "fp8"`` (the per-tile scales add well under 1%).
        comm_bytes_bf16 / comm_bytes_fp8: bytes per element on the wire for activations in each
            precision (FP8 dispatch and TP all-gathers; reductions and combines stay BF16).
        grad_reduce_bytes: bytes per element of the DP gradient reduce-scatter.
        logits_bytes: bytes per element of the output logits (FP32 for a stable loss).
        link_efficiency / nic_efficiency: achieved fraction of the scale-up link and NIC bandwidth.
            NIC 0.9 (was 0.8): DeepEP's published normal-kernel figures on 400 Gb/s CX7 NICs
            (~50 GB/s) reach 43-58 GB/s across nodes (github.com/deepseek-ai/DeepEP,
            docs/legacy.md), and a NIC-bound FSDP run (ModelZoo Qwen3-235B EP8: 12 transfers of
            64 GB per step, 14.8 s at line rate, in a 17.6 s step) needs >= 0.84 even if every
            byte hid behind compute.
        intra_latency_s / inter_latency_s: per-collective latency inside / across domains.
        dp_overlap_fraction: fraction of the last micro-batch's backward that hides the ZeRO-0/1
            gradient reduction (ZeRO-2/3's per-layer collectives are prefetched beside the whole
            micro-batch: ``step_time_model._sharded_exposure``).
        collective_overlap_slowdown: how much slower compute runs while a DP/ZeRO collective
            (NCCL all-gather, reduce-scatter, all-reduce) runs beside it on another stream: the
            collective's kernels hold SMs (an all-gather launches ~24 blocks on H100's 132 SMs,
            which also pushes a one-wave GEMM into a second wave) and HBM bandwidth. Measured,
            not fitted: 0.189 on average over GPT/LLaMA layers on A100/H100/MI250/MI210
            (arXiv 2507.03114, "Characterizing Compute-Communication Overlap in GPU-Accelerated
            Distributed Deep Learning", max 0.40). A collective hidden for ``p`` seconds behind
            compute therefore adds ``p x s / (1 + s)`` seconds to it
            (:func:`overlap_slowdown_s`).
        dropless_expert_load_cv: relative spread of per-expert loads under a trained dropless
            router, which sets how much busier than the mean the busiest EP rank is
            (:mod:`rayfleet.placement.moe_load`). Measured, not fitted: the median over published
            forced-balance / dropless pairs of one plan (``calibration/routing_pairs.py``).
        ep_overlap_fraction: share of the compute piece (of another micro-batch) that Megatron-
            Core's combined 1F1B schedule (or DualPipe) pairs with each EP all-to-all, behind which
            that all-to-all hides: 1 = the schedule as built (each all-to-all shows only its excess
            over its piece, see ``step_time_model.ep_exposed_all_to_all``); 0 = no hiding.
        ep_overlap_contention: seconds a hidden all-to-all still adds per second hidden: the
            communication kernels take SMs (DeepSeek-V3: 20 of 132, 0.15) and HBM bandwidth from
            the compute they run beside, and the two streams synchronise four times a layer.
        p2p_overlap_fraction: share of a stage's micro-batch compute behind which the interleaved
            schedule hides its pipeline sends (``overlap_p2p_comm``; the plain 1F1B schedule hides none).
        cp_overlap_fraction: fraction of ring-attention K/V exchange hidden behind attention.
        tp_overlap_fraction: fraction of TP all-gathers / reduce-scatters hidden behind the GEMMs
            (Transformer Engine's userbuffer overlap).
        wgrad_accumulation_bytes: HBM bytes per local parameter that each micro-batch's weight-
            gradient GEMM reads and writes in the FP32 main-grad buffer (Megatron's
            ``gradient_accumulation_fusion``: 4 read + 4 written); 0 ignores that traffic.
        optimizer_bytes_touched: HBM bytes read+written per parameter by the Adam step.
        usable_memory_fraction: share of HBM a plan may fill (allocator, context, buffers).
    """

    gemm_efficiency: float = 0.52
    bf16_gemm_efficiency: float = 0.72
    gemm_rows_at_half_efficiency: float = 512.0
    moe_permute_bytes: float = 128.0
    moe_layer_overhead_s: float = 0.0004
    fp8_cast_bytes: int = 6
    attention_efficiency: float = 0.42
    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    optimizer_bytes_bf16: int = 8
    fp8_weight_cache_bytes: int = 2
    fp8_primary_weights: bool = True
    activation_bytes: int = 2
    fp8_activation_bytes: int = 1
    comm_bytes_bf16: int = 2
    comm_bytes_fp8: int = 1
    grad_reduce_bytes: int = 2
    logits_bytes: int = 4
    link_efficiency: float = 0.75
    nic_efficiency: float = 0.9
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 25e-6
    dp_overlap_fraction: float = 0.8
    collective_overlap_slowdown: float = 0.19
    dropless_expert_load_cv: float = DROPLESS_EXPERT_LOAD_CV
    ep_overlap_fraction: float = 1.0
    ep_overlap_contention: float = 0.45
    cp_overlap_fraction: float = 0.5
    p2p_overlap_fraction: float = 0.8
    tp_overlap_fraction: float = 0.9
    wgrad_accumulation_bytes: int = 8
    optimizer_bytes_touched: int = 36
    usable_memory_fraction: float = 0.9


    def gemm_efficiency_for(self, precision: str) -> float:
        """Large-GEMM efficiency (of the dense peak in ``precision``) of a model trained in ``precision``."""
        return self.bf16_gemm_efficiency if precision == "bf16" else self.gemm_efficiency

    def weight_bytes(self, precision: str) -> int:
        """Device bytes per stored weight for a model trained in ``precision``."""
        if precision != "fp8":
            return self.param_bytes
        return self.fp8_weight_cache_bytes + (0 if self.fp8_primary_weights else self.param_bytes)


@dataclass(frozen=True)
class Link:
    """Effective bandwidth (bytes/s) and latency (s) of one accelerator's link of one kind."""

    bytes_per_s: float
    latency_s: float

    @classmethod
    def scaleup(cls, accel: AcceleratorSpec, params: CostParams) -> "Link":
        return cls(accel.intra_node_link_gbps * 1e9 * params.link_efficiency, params.intra_latency_s)

    @classmethod
    def scaleout(cls, accel: AcceleratorSpec, params: CostParams) -> "Link":
        return cls(accel.nic_gbps * 1e9 * params.nic_efficiency, params.inter_latency_s)


def ring_time(total_bytes: float, group: int, link: Link) -> float:
    """All-gather or reduce-scatter of ``total_bytes`` (the gathered size) over ``group`` ranks."""
    if group <= 1:
        return 0.0
    return link.latency_s + (group - 1) / group * total_bytes / link.bytes_per_s


def hierarchical_allreduce_time(total_bytes: float, group: int, in_domain: int, intra: Link, inter: Link) -> float:
    """All-reduce (= reduce-scatter + all-gather) of ``total_bytes`` per rank over ``group`` ranks,
    ``in_domain`` of which share a scale-up domain: in-domain stage on the link, then the
    ``group / in_domain`` domains exchange ``1 / in_domain`` of the bytes each over their rails."""
    if group <= 1:
        return 0.0
    in_domain = max(1, min(in_domain, group))
    across = group // in_domain
    return 2 * ring_time(total_bytes, in_domain, intra) + 2 * ring_time(total_bytes / in_domain, across, inter)


def all_to_all_time(bytes_per_rank: float, group: int, in_domain: int, intra: Link, inter: Link,
                    cross_share: float = 1.0) -> float:
    """All-to-all where each rank sends ``bytes_per_rank`` spread evenly over ``group`` ranks,
    ``in_domain`` of which (itself included) share its scale-up domain; the two parts run in
    parallel on different links, so the slower one sets the time. ``cross_share`` scales the
    bytes leaving the domain (a deduplicating dispatcher sends a token once per remote domain)."""
    if group <= 1:
        return 0.0
    in_domain = max(1, min(in_domain, group))
    share = bytes_per_rank / group
    t_intra = (in_domain - 1) * share / intra.bytes_per_s + (intra.latency_s if in_domain > 1 else 0.0)
    t_inter = (group - in_domain) * share * cross_share / inter.bytes_per_s + (
        inter.latency_s if group > in_domain else 0.0)
    return max(t_intra, t_inter)


def link_rate_share(carrier: Link, scaleup: Link) -> float:
    """The rate a collective moves bytes through this device's memory, as a share of the
    scale-up link's (the rate the slowdown was measured at)."""
    return min(1.0, carrier.bytes_per_s / scaleup.bytes_per_s)


def overlap_slowdown_s(hidden_s: float, params: CostParams, *, rate_share: float = 1.0) -> float:
    """Seconds a collective hidden for ``hidden_s`` behind compute still adds to that compute.

    While a collective runs, the compute beside it runs ``1 + s`` times slower, ``s =
    params.collective_overlap_slowdown x rate_share`` (NCCL's kernels hold SMs and HBM
    bandwidth; ``s`` was measured for collectives on the scale-up link, and one carried by the
    NIC moves ``rate_share`` = NIC / scale-up bytes per second through the device, so it takes
    that share of the SMs' copy work and HBM traffic). Compute of ``c >= p`` seconds with a
    collective of ``p`` seconds beside it takes ``p + (c - p / (1 + s)) = c + p x s / (1 + s)``:
    the hidden collective costs ``s / (1 + s)`` of itself. Worked example
    (tests/unit/placement/test_overlap_slowdown.py): ``s`` 0.19, 1 s hidden on NVLink -> 0.1597 s;
    on a 45 GB/s NIC beside a 337.5 GB/s NVLink (share 2/15) -> 0.0247 s.

    Charged for the DP gradient reduction (ZeRO-1: behind the last backward), ZeRO-2/3's
    prefetched collectives and the hidden share of TP communication; the EP all-to-all's overlap
    has its own fitted ``ep_overlap_contention``; pipeline sends and the CP ring exchange
    (point-to-point, a few SMs) are not charged."""
    s = params.collective_overlap_slowdown * rate_share
    return max(0.0, hidden_s) * s / (1 + s)
