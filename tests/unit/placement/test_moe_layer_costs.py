"""The MoE layer's non-FLOP costs and ZeRO-3's prefetched collectives (issue 27, calibration).

Regressions named after what they fixed:
- a "narrow expert" knee priced a per-routed-element cost at the GEMM peak, so a BF16 run (half
  the FP8 peak) paid it twice: the ModelZoo FSDP EP8 BF16 row was 30% too slow;
- ZeRO-3's per-layer gathers could hide behind only ``dp_overlap_fraction`` (0.8) of a micro-
  batch's compute, so a NIC-bound FSDP run was priced ~5 s too slow.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.placement.cost_params import CostParams, Link
from rayfleet.placement.memory_model import ParamCounts
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.step_time_model import _sharded_exposure, layer_time
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")
MOE = ModelSpec(name="moe", num_layers=8, hidden_size=2048, ffn_hidden_size=8192, num_heads=16, num_kv_heads=8,
                vocab_size=32000, num_experts=64, top_k=4, moe_ffn_hidden_size=1024, seq_len=4096,
                global_batch_sequences=256)
PLAN = ParallelPlan(tp=1, dp=8, ep=8)


def _moe_layer(model: ModelSpec) -> int:
    return next(i for i in range(model.num_layers) if model.is_moe_layer(i))


def test_per_copy_moe_cost_is_memory_bound_not_priced_at_the_gemm_peak() -> None:
    """The per-routed-copy bytes cost the same HBM seconds in a BF16 run as in an FP8 run less
    FP8's casts; a FLOP-priced knee would cost a BF16 run twice the FP8 seconds."""
    layer = _moe_layer(MOE)
    bf16, fp8 = replace(MOE, precision="bf16"), replace(MOE, precision="fp8")
    base = CostParams(moe_permute_bytes=0.0, moe_layer_overhead_s=0.0, fp8_cast_bytes=0)
    with_bytes = replace(base, moe_permute_bytes=128.0)
    extra = {m.precision: layer_time(m, PLAN, layer, H100, with_bytes).compute - layer_time(m, PLAN, layer, H100, base).compute
             for m in (bf16, fp8)}
    assert extra["bf16"] > 0 and extra["bf16"] == pytest.approx(extra["fp8"])
    # FP8's casts are per copy too, and absent from a BF16 run
    casts = replace(base, fp8_cast_bytes=6)
    assert layer_time(bf16, PLAN, layer, H100, casts).compute == pytest.approx(
        layer_time(bf16, PLAN, layer, H100, base).compute)
    assert layer_time(fp8, PLAN, layer, H100, casts).compute > layer_time(fp8, PLAN, layer, H100, base).compute


def test_moe_layer_overhead_is_per_micro_batch_not_per_token() -> None:
    """Forward pays it once, backward twice: 3x per layer and micro-batch at any micro-batch size."""
    layer = _moe_layer(MOE)
    for mbs in (1, 4):
        plan = replace(PLAN, micro_batch_size=mbs)
        off = layer_time(MOE, plan, layer, H100, CostParams(moe_layer_overhead_s=0.0)).compute
        on = layer_time(MOE, plan, layer, H100, CostParams(moe_layer_overhead_s=0.001)).compute
        assert on - off == pytest.approx(0.003)


def test_zero3_prefetch_exposes_the_first_layer_and_the_excess() -> None:
    """Worked example: L = 4 layers, all-gathers + reduce-scatter of one micro-batch 2 s on a
    NIC, compute 3 s. Prefetched one layer ahead: 0.5 (first layer's share) + 3/4 x max(0, 2 - 3)
    = 0.5 s exposed; with 6 s of comm, 1.5 + 3/4 x 3 = 3.75 s. The old rule,
    max(0, comm - 0.8 x compute), gave 0 and 3.6 s: no first-layer cost, and never hid more
    than 80% of the compute."""
    plan = ParallelPlan(tp=1, dp=16, zero_stage=3)
    nic = Link(bytes_per_s=1e9, latency_s=0.0)
    # the prefetch's shape alone: the slowdown of the compute it hides behind is
    # test_overlap_slowdown.py's worked example
    params = CostParams(param_bytes=2, collective_overlap_slowdown=0.0)
    def exposed(comm_s: float, compute_s: float) -> float:
        # half the all-reduce (the reduce-scatter) and two all-gathers of a quarter each
        gather_bytes = comm_s / 4 / (15 / 16) * 1e9
        counts = ParamCounts(dense=int(gather_bytes / 2), expert=0)
        return _sharded_exposure(plan, counts, allreduce_s=comm_s, compute_s=compute_s, params=params,
                                 link=nic, nic=nic, domain=8, num_layers=4)
    assert exposed(2.0, 3.0) == pytest.approx(0.5, rel=1e-3)
    assert exposed(6.0, 3.0) == pytest.approx(1.5 + 0.75 * 3.0, rel=1e-3)
