"""Cost model: each term moves the way the hardware says it should (and can be switched off)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.placement.cost_model import evaluate_plan
from rayfleet.placement.cost_params import CostParams, Link, all_to_all_time, hierarchical_allreduce_time, ring_time
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.step_time_model import LayerHalves, ep_exposed_all_to_all, layer_time
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")
MOE = ModelSpec(name="moe", num_layers=8, hidden_size=2048, ffn_hidden_size=8192, num_heads=16, num_kv_heads=8,
                vocab_size=32000, num_experts=64, top_k=4, moe_ffn_hidden_size=1024, seq_len=4096,
                global_batch_sequences=256)


def test_collective_primitives() -> None:
    link = Link(100e9, 0.0)
    assert ring_time(1e9, 1, link) == 0.0
    assert ring_time(1e9, 4, link) == pytest.approx(0.75 * 1e9 / 100e9)
    slow = Link(10e9, 0.0)
    # all in one domain: only the fast link is used
    assert all_to_all_time(8e9, 8, 8, link, slow) == pytest.approx(7e9 / 100e9)
    # spread over domains: the slow NIC dominates
    assert all_to_all_time(8e9, 8, 1, link, slow) == pytest.approx(7e9 / 10e9)
    flat = hierarchical_allreduce_time(1e9, 16, 1, link, slow)
    hier = hierarchical_allreduce_time(1e9, 16, 8, link, slow)
    assert hier < flat


def test_tp_comm_grows_with_tp_and_uses_the_link() -> None:
    t2 = layer_time(MOE, ParallelPlan(tp=2, dp=4, ep=8), 0, H100)
    t8 = layer_time(MOE, ParallelPlan(tp=8, dp=1, ep=8), 0, H100)
    assert 0 < t2.tp_comm < t8.tp_comm
    faster_link = replace(H100, intra_node_link_gbps=2 * H100.intra_node_link_gbps)
    assert layer_time(MOE, ParallelPlan(tp=8, dp=1, ep=8), 0, faster_link).tp_comm < t8.tp_comm


def test_ep_all_to_all_inside_a_node_beats_across_nodes() -> None:
    params = CostParams(ep_overlap_fraction=0.0)
    inside = layer_time(MOE, ParallelPlan(tp=1, dp=64, ep=8), 1, H100, params)
    across = layer_time(MOE, ParallelPlan(tp=1, dp=64, ep=64), 1, H100, params)
    assert inside.ep_comm < across.ep_comm
    # overlapped, each all-to-all hides behind the piece of the other micro-batch it is paired
    # with; the hidden part still costs its contention
    free = CostParams(ep_overlap_contention=0.0)
    hidden = layer_time(MOE, ParallelPlan(tp=1, dp=64, ep=64), 1, H100, free)
    assert 0.0 <= hidden.ep_comm < across.ep_comm
    assert layer_time(MOE, ParallelPlan(tp=1, dp=64, ep=64), 1, H100).ep_comm > hidden.ep_comm
    assert layer_time(MOE, ParallelPlan(tp=1, dp=64, ep=8), 1, H100, free).ep_comm == 0


def test_ep_overlap_pairs_each_all_to_all_with_one_compute_piece() -> None:
    """Worked example of Megatron's combined 1F1B step (schedule_layer_1f1b): dispatch 1 s, the
    three other all-to-alls 2 s each; the other micro-batch's attention 0.5 s forward / 1 s
    backward, MoE 1.5 s / 3 s; contention 0.2 of what hides.

      bwd combine 2 || fwd attention 0.5 -> 1.5 exposed + 0.2 x 0.5 = 1.6
      fwd dispatch 1 || bwd MoE 3        -> 0           + 0.2 x 1.0 = 0.2
      bwd dispatch 2 || fwd MoE 1.5      -> 0.5         + 0.2 x 1.5 = 0.8
      fwd combine 2 || bwd attention 1   -> 1.0         + 0.2 x 1.0 = 1.2   total 3.8 s
    """
    halves = LayerHalves(fwd_attn=0.5, fwd_moe=1.5, bwd_attn=1.0, bwd_moe=3.0)
    params = CostParams(ep_overlap_fraction=1.0, ep_overlap_contention=0.2)
    assert ep_exposed_all_to_all(1.0, 2.0, halves, params) == pytest.approx(3.8)
    # the broken variant -- all 7 s of all-to-all against the whole 6 s of compute -- hides
    # the combines behind MoE compute they never run beside
    aggregate = max(0.0, 7.0 - 6.0) + 0.2 * 6.0
    assert aggregate < 3.0
    assert ep_exposed_all_to_all(1.0, 2.0, halves, replace(params, ep_overlap_fraction=0.0)) == pytest.approx(7.0)


def test_fp8_halves_gemm_time_and_dispatch_bytes() -> None:
    plan = ParallelPlan(tp=2, dp=32, ep=16)
    bf16 = layer_time(MOE, plan, 1, H100)
    fp8 = layer_time(replace(MOE, precision="fp8"), plan, 1, H100)
    assert fp8.compute < bf16.compute
    assert fp8.tp_comm < bf16.tp_comm
    bare = CostParams(ep_overlap_fraction=0.0)  # the bytes on the wire, before any hiding
    assert layer_time(replace(MOE, precision="fp8"), plan, 1, H100, bare).ep_comm < layer_time(MOE, plan, 1, H100,
                                                                                               bare).ep_comm
    a100 = get_accelerator("A100")  # no FP8 units: FP8 falls back to BF16 speed
    assert layer_time(replace(MOE, precision="fp8"), plan, 1, a100).compute == pytest.approx(
        layer_time(MOE, plan, 1, a100).compute)


def test_recompute_trades_time_for_memory() -> None:
    costs = {rc: evaluate_plan(MOE, ParallelPlan(tp=2, pp=2, dp=16, ep=8, recompute=rc), H100)
             for rc in ("none", "selective", "full")}
    assert costs["none"].step_time_s < costs["selective"].step_time_s < costs["full"].step_time_s
    assert costs["none"].memory.total > costs["selective"].memory.total > costs["full"].memory.total


def test_pipeline_bubble_matches_1f1b_formula() -> None:
    dense = preset("llama3-8b", num_layers=8, global_batch_sequences=64)
    plan = ParallelPlan(tp=1, pp=4, dp=2, stage_starts=(0, 2, 4, 6))
    cost = evaluate_plan(dense, plan, H100)
    m = plan.num_microbatches(dense.global_batch_sequences)
    stages = cost.step.stage_microbatch_s
    expected_pipeline = sum(stages) + (m - 1) * max(stages)
    pipeline = cost.step_time_s - cost.step.dp_comm - cost.step.optimizer
    assert pipeline == pytest.approx(expected_pipeline)
    assert cost.step.pp_bubble > 0
    more_mb = evaluate_plan(dense, replace(plan, dp=1), H100)  # twice the micro-batches per replica
    assert more_mb.step.pp_bubble / more_mb.step_time_s < cost.step.pp_bubble / cost.step_time_s


def test_dp_grad_reduce_is_cheaper_on_rails_inside_a_node() -> None:
    dense = preset("llama3-8b", num_layers=8, global_batch_sequences=64)
    no_hide = CostParams(dp_overlap_fraction=0.0)
    in_node = evaluate_plan(dense, ParallelPlan(tp=1, dp=8), H100, params=no_hide)
    across = evaluate_plan(dense, ParallelPlan(tp=8, dp=8), H100, params=no_hide)
    assert in_node.step.dp_comm > 0 and across.step.dp_comm > 0
    per_byte_in = in_node.step.dp_comm / 8  # tp=1 holds 8x the gradient bytes of tp=8
    assert per_byte_in < across.step.dp_comm


def test_mixed_fleet_slowest_group_sets_the_step() -> None:
    a100, h100 = get_accelerator("A100"), get_accelerator("H100")
    dense = preset("llama3-8b", num_layers=8, global_batch_sequences=64)
    table = {"H100": h100, "A100": a100}
    even = ParallelPlan(tp=8, dp=2, replica_accelerators=("H100", "A100"), replica_microbatches=(32, 32))
    skewed = replace(even, replica_microbatches=(48, 16))
    assert evaluate_plan(dense, skewed, table).step_time_s < evaluate_plan(dense, even, table).step_time_s


def test_every_constant_is_a_named_parameter() -> None:
    dense = preset("llama3-8b", num_layers=8, global_batch_sequences=64)
    plan = ParallelPlan(tp=2, dp=8)
    base = evaluate_plan(dense, plan, H100).step_time_s
    assert evaluate_plan(dense, plan, H100, params=CostParams(bf16_gemm_efficiency=0.25)).step_time_s > base
    fp8 = replace(dense, precision="fp8")  # FP8 GEMMs use the fitted constant, BF16 ones the measured
    fp8_base = evaluate_plan(fp8, plan, H100).step_time_s
    assert evaluate_plan(fp8, plan, H100, params=CostParams(gemm_efficiency=0.25)).step_time_s > fp8_base
    assert evaluate_plan(dense, plan, H100, params=CostParams(gemm_efficiency=0.25)).step_time_s == base


def test_heterogeneous_tp_lowers_comm_of_the_layers_it_narrows() -> None:
    """Dense first layers on TP2 inside a TP8 group: less TP traffic there, more memory."""
    model = preset("deepseek-v3", num_layers=4, first_k_dense_layers=2, num_experts=16, global_batch_sequences=64)
    uniform = ParallelPlan(tp=8, dp=2, ep=16)
    mixed = replace(uniform, layer_tp=(2, 2, 8, 8))
    assert layer_time(model, mixed, 0, H100).tp_comm < layer_time(model, uniform, 0, H100).tp_comm
    assert layer_time(model, mixed, 3, H100).tp_comm == layer_time(model, uniform, 3, H100).tp_comm
    assert evaluate_plan(model, mixed, H100).memory.weights > evaluate_plan(model, uniform, H100).memory.weights
