"""What the training runtime does around the math: EP all-to-all overlap (only where the schedule
pairs micro-batches), interleaved pipeline sends hidden behind compute, deduplicating EP dispatch
with node-limited routing, TP overlap, FP8 primary weights, DualPipe. Each test includes the
broken variant it guards against where that is cheap."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.calibration import load_published_runs, rank_published_plan
from rayfleet.placement.cost_model import balanced_plan, evaluate_plan
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.planner import _step_at_vpp, brute_force_plans, search_plans
from rayfleet.placement.search_space import JobGoal, SearchSpace
from rayfleet.placement.step_time_model import exposed_p2p, layer_time
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")
DEEPSEEK = preset("deepseek-v3")
MOE = ModelSpec(name="moe", num_layers=12, hidden_size=2048, ffn_hidden_size=5632, num_heads=16, num_kv_heads=8,
                vocab_size=50000, num_experts=32, top_k=4, moe_ffn_hidden_size=1408, first_k_dense_layers=1,
                seq_len=4096, global_batch_sequences=256, precision="fp8")


def test_ep_overlap_needs_a_schedule_that_pairs_micro_batches() -> None:
    """Megatron-Core asserts EP A2A overlap has virtual stages when pp > 1 and no full recompute."""
    moe_layer = DEEPSEEK.num_layers - 1
    base = ParallelPlan(tp=2, pp=8, dp=64, ep=64)
    raw = layer_time(DEEPSEEK, replace(base, ep_overlap=False), moe_layer, H100).ep_comm
    plain = layer_time(DEEPSEEK, base, moe_layer, H100).ep_comm
    interleaved = layer_time(DEEPSEEK, replace(base, vpp=4), moe_layer, H100).ep_comm
    dualpipe = layer_time(DEEPSEEK, replace(base, dualpipe=True), moe_layer, H100).ep_comm
    full = layer_time(DEEPSEEK, replace(base, vpp=4, recompute="full"), moe_layer, H100).ep_comm
    no_pipeline = layer_time(DEEPSEEK, replace(base, pp=1, dp=512), moe_layer, H100).ep_comm
    assert raw > 0 and plain == raw  # 1F1B without virtual stages hides nothing
    # full recompute hides nothing either, and pays its rerun forward's dispatch and combine
    full_raw = layer_time(DEEPSEEK, replace(base, vpp=4, recompute="full", ep_overlap=False), moe_layer, H100).ep_comm
    assert full == full_raw and full > raw
    assert interleaved < raw and dualpipe == interleaved and no_pipeline == interleaved


def test_interleaved_sends_hide_behind_the_stages_compute_up_to_it() -> None:
    params = CostParams()
    send = 1e-3
    assert exposed_p2p(send, 1, 10.0, params) == pytest.approx(2 * send)  # plain 1F1B: synchronous
    assert exposed_p2p(send, 4, 10.0, params) == 0.0  # 8 sends behind 10 s of compute
    tiny = 2e-3  # a stage with almost no compute still pays for most of its sends
    assert exposed_p2p(send, 4, tiny, params) == pytest.approx(8 * send - params.p2p_overlap_fraction * tiny)
    assert exposed_p2p(send, 1, tiny, params, dualpipe=True) == pytest.approx(
        4 * send - params.p2p_overlap_fraction * tiny)


@pytest.mark.parametrize("model,plan", [
    (MOE, ParallelPlan(tp=2, pp=4, dp=2, ep=4, vpp=2)),
    (preset("llama3-70b", global_batch_sequences=128), ParallelPlan(tp=4, pp=8, dp=2, vpp=1)),
])
def test_virtual_stage_closed_form_equals_pricing(model, plan) -> None:
    """The planner prices other vpp from one pricing per side of 1 (sends, fill/drain per stage)."""
    base = evaluate_plan(model, balanced_plan(model, plan, H100), H100)
    for vpp in ((2, 3, 4) if plan.vpp > 1 else (1,)):
        direct = evaluate_plan(model, replace(base.plan, vpp=vpp), H100)
        assert _step_at_vpp(base, model, vpp, CostParams()) == pytest.approx(direct.step_time_s, rel=1e-9)


def test_distinct_shards_per_token_worked_example() -> None:
    """DeepSeek-V3 routes within 4 of 8 expert groups: over 8 nodes (a group each) a token reaches
    8 * (1 - C(7,4)/C(8,4)) = 4 nodes, against 8 * (1 - C(224,8)/C(256,8)) = 5.26 without the limit."""
    assert DEEPSEEK.distinct_shards_per_token(8) == pytest.approx(4.0)
    unlimited = replace(DEEPSEEK, expert_groups_per_token=0)
    assert unlimited.distinct_shards_per_token(8) == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert DEEPSEEK.distinct_shards_per_token(1) == 1.0
    # one expert a shard: a token visits exactly top_k shards
    assert unlimited.distinct_shards_per_token(256) == pytest.approx(8.0)
    with pytest.raises(SpecError, match="expert_groups_per_token"):
        replace(DEEPSEEK, num_expert_groups=7)


def test_deduplicating_dispatch_cuts_only_cross_node_bytes() -> None:
    moe_layer = DEEPSEEK.num_layers - 1
    off = replace(ParallelPlan(tp=2, pp=8, dp=64, ep=64, vpp=4), ep_overlap=False)
    per_copy = layer_time(DEEPSEEK, replace(off, ep_dedup=False), moe_layer, H100).ep_comm
    dedup = layer_time(DEEPSEEK, off, moe_layer, H100).ep_comm
    # the NIC part dominates: 3.5 remote nodes a token instead of 7 remote copies
    assert dedup == pytest.approx(per_copy * 3.5 / 7, rel=0.02)
    inside = replace(off, tp=8, dp=8, ep=8)  # EP8 inside a server: nothing to deduplicate
    assert layer_time(DEEPSEEK, inside, moe_layer, H100).ep_comm == \
        layer_time(DEEPSEEK, replace(inside, ep_dedup=False), moe_layer, H100).ep_comm


def test_tp_overlap_off_exposes_all_tp_traffic() -> None:
    plan = ParallelPlan(tp=4, dp=2, ep=8)
    hidden = layer_time(MOE, plan, 0, H100).tp_comm
    exposed = layer_time(MOE, replace(plan, tp_overlap=False), 0, H100).tp_comm
    # overlapped, (1 - f) of the traffic shows and the hidden f still slows the GEMMs by s / (1 + s)
    f, s = CostParams().tp_overlap_fraction, CostParams().collective_overlap_slowdown
    assert exposed == pytest.approx(hidden / (1 - f + f * s / (1 + s)))


def test_dualpipe_is_priced_by_its_own_bubble_and_checks_its_layout() -> None:
    """DualPipeV's bubble is (pp - 1)(t + B - 3W) / 2 -- about a third of 1F1B's, below the
    half that two interleaved virtual stages give -- not interleaved VP2's (pp - 1) t / 2."""
    model = preset("llama3-70b", global_batch_sequences=128)
    plan = balanced_plan(model, ParallelPlan(tp=4, pp=8, dp=2), H100)
    plain = evaluate_plan(model, plan, H100).step
    dual = evaluate_plan(model, replace(plan, dualpipe=True), H100).step
    slow = max(dual.stage_microbatch_s)
    as_vp2 = (sum(dual.stage_microbatch_s) - slow) / 2  # the old pricing
    assert dual.pp_bubble < 0.8 * as_vp2
    assert 0.25 * plain.pp_bubble < dual.pp_bubble < 0.45 * plain.pp_bubble and dual.pp_p2p < plain.pp_p2p
    for bad in (replace(plan, dualpipe=True, vpp=2), replace(plan, dualpipe=True, pp=1, dp=16, stage_starts=(0,)),
                replace(plan, dualpipe=True, dp=16)):  # 8 micro-batches < 2 * pp
        with pytest.raises(SpecError, match="plan.dualpipe"):
            validate_plan(bad, model)


@pytest.mark.parametrize("virtual_stages", [(1, 2), (1,)])
def test_search_with_dualpipe_equals_brute_force(virtual_stages) -> None:
    accel = replace(H100, hbm_gib=8.0)  # small HBM: pipelines are needed
    capacity = FleetCapacity({"H100": accel}, {"H100": 32})
    space = SearchSpace(micro_batch_sizes=(1, 2), virtual_stages=virtual_stages, optimality_gap=0.0, dualpipe=True)
    fast = search_plans(MOE, capacity, top_k=3, space=space)
    slow = brute_force_plans(MOE, capacity, top_k=3, space=space)
    assert [r.step_time_s for r in fast.ranked] == pytest.approx([r.step_time_s for r in slow.ranked], rel=1e-9)
    if virtual_stages == (1,):  # without interleaving, every pipeline is better off with DualPipe
        piped = [r.plan for r in search_plans(MOE, capacity, top_k=5, space=space).ranked if r.plan.pp > 1]
        assert piped and all(p.dualpipe for p in piped)
    assert not any(r.plan.dualpipe for r in search_plans(MOE, capacity, top_k=10,
                                                         space=replace(space, dualpipe=False)).ranked)


def test_published_plans_are_ranked_under_their_runs_runtime_options() -> None:
    """Qwen3-235B ran Megatron's per-copy all-to-all without TP overlap: the shapes it is ranked
    against are priced the same way, not with a dispatcher the run did not have."""
    run = next(r for r in load_published_runs() if r.id == "mbridge-qwen3-235b-a22b-h100")
    assert not run.plan.ep_dedup and not run.plan.tp_overlap
    top = rank_published_plan(run).top_plan
    assert not top.ep_dedup and not top.tp_overlap
    capacity = FleetCapacity({"H100": H100}, {"H100": 256})
    free = search_plans(run.model, capacity, top_k=1, goal=JobGoal.exactly(256))
    assert free.ranked[0].plan.ep_dedup
