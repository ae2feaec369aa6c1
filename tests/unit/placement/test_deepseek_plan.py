"""DeepSeek-V3's own training plan (technical report, arXiv 2412.19437, sections 3.2-3.3): PP16
EP64, ZeRO-1 DP, 2048 H800 (80 GB, as the H100), no full recompute. It fits only with the
report's memory savings, which the memory model carries as general plan options: selective
recompute (RMSNorm, MLA up-projections, SwiGLU output), FP8-cached Linear/SwiGLU inputs and
BF16 Adam moments."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.cost_model import balanced_plan, evaluate_plan, plan_memory
from rayfleet.placement.fleet_capacity import FleetCapacity
from rayfleet.placement.memory_model import layer_activation_bytes
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.planner import SearchSpace, brute_force_plans, search_plans
from rayfleet.placement.search_space import JobGoal
from rayfleet.placement.cost_params import CostParams
from rayfleet.platform.catalogue import get_accelerator

# the report's batch after the ramp-up: 15,360 sequences of 4,096 tokens
DEEPSEEK = preset("deepseek-v3", global_batch_sequences=15360)
# H800: an H100 with NVLink cut to 400 GB/s (200 GB/s a direction); same 80 GB HBM
H800 = replace(get_accelerator("H100"), name="H800", intra_node_link_gbps=200.0)
OWN_PLAN = ParallelPlan(tp=1, pp=16, dp=128, ep=64, micro_batch_size=1, zero_stage=1)


def _fits(plan: ParallelPlan) -> tuple[bool, float]:
    plan = balanced_plan(DEEPSEEK, plan, H800, CostParams())
    mem, _, usable = plan_memory(DEEPSEEK, plan, H800)
    return mem.total <= usable, mem.total / usable


def test_the_reports_plan_fits_only_with_the_reports_memory_savings() -> None:
    validate_plan(replace(OWN_PLAN, stage_starts=tuple(range(16))), DEEPSEEK, world_size=2048, scaleup_domain_size=8)
    for moments in ("fp32", "bf16"):
        for acts in ("bf16", "fp8"):  # without selective recompute stage 0 holds far too much
            fits, ratio = _fits(replace(OWN_PLAN, optimizer_dtype=moments, activation_dtype=acts))
            assert not fits and ratio > 1.4, (moments, acts, ratio)
        # with it, BF16 activations fill 97-98% of the usable HBM; FP8 caching leaves ~18% free
        tight = _fits(replace(OWN_PLAN, recompute="selective", optimizer_dtype=moments))[1]
        fits, ratio = _fits(replace(OWN_PLAN, recompute="selective", optimizer_dtype=moments, activation_dtype="fp8"))
        assert fits and 0.6 < ratio < 0.85 and 0.95 < tight <= 1.0, (moments, ratio, tight)


def test_fp8_primary_weights_drop_the_bf16_copy() -> None:
    """Megatron-Bridge's FP8 recipes keep the weights only in FP8 (``fp8_param_gather``): two bytes
    a parameter (row- and column-wise) instead of a BF16 copy plus both FP8 copies."""
    params = CostParams()
    assert params.weight_bytes("fp8") == 2 and params.weight_bytes("bf16") == 2
    assert replace(params, fp8_primary_weights=False).weight_bytes("fp8") == 4
    plan = balanced_plan(DEEPSEEK, replace(OWN_PLAN, recompute="selective"), H800, params)
    with_copy = plan_memory(DEEPSEEK, plan, H800, params=replace(params, fp8_primary_weights=False))[0]
    without = plan_memory(DEEPSEEK, plan, H800, params=params)[0]
    assert with_copy.weights == pytest.approx(2 * without.weights, rel=0.01)


def test_what_fp8_stores_in_one_byte() -> None:
    """FP8 training saves Linear inputs FP8-cast (Transformer Engine); FP8 activation caching
    adds SwiGLU's inputs; residual streams and attention's tensors stay BF16."""
    plan = ParallelPlan(recompute="selective")
    tokens = DEEPSEEK.seq_len
    h, k, f = DEEPSEEK.hidden_size, DEEPSEEK.top_k, DEEPSEEK.moe_ffn_hidden_size
    moe = DEEPSEEK.num_layers - 1
    bf16_model = replace(DEEPSEEK, precision="bf16")
    fp8 = layer_activation_bytes(DEEPSEEK, plan, moe, CostParams())
    cached = layer_activation_bytes(DEEPSEEK, replace(plan, activation_dtype="fp8"), moe, CostParams())
    bf16 = layer_activation_bytes(bf16_model, plan, moe, CostParams())
    latents = DEEPSEEK.q_lora_rank + DEEPSEEK.kv_lora_rank + DEEPSEEK.rope_head_dim
    # selective recompute: the Linear inputs left are MLA's latents and the dispatched tokens
    assert bf16 - fp8 == pytest.approx(tokens * (latents + k * h))
    assert fp8 - cached == pytest.approx(tokens * 2 * (k + DEEPSEEK.num_shared_experts) * f)
    kept = tokens * 2 * (2 * h + DEEPSEEK.num_heads * DEEPSEEK.head_dim)  # residuals and core out, BF16
    assert cached == pytest.approx(kept + tokens * (latents + k * h + 2 * (k + 1) * f))


def test_fp8_activations_need_an_fp8_model() -> None:
    bf16_model = replace(DEEPSEEK, precision="bf16")
    with pytest.raises(SpecError, match="plan.activation_dtype"):
        validate_plan(replace(OWN_PLAN, activation_dtype="fp8", stage_starts=tuple(range(16))), bf16_model)
    # the search drops the option for a BF16 model instead of failing
    small = replace(bf16_model, num_layers=8, first_k_dense_layers=1, num_experts=32, global_batch_sequences=256)
    capacity = FleetCapacity({"H100": get_accelerator("H100")}, {"H100": 64})
    result = search_plans(small, capacity, top_k=3, space=SearchSpace(activation_dtypes=("bf16", "fp8")))
    assert result.ranked and all(r.plan.activation_dtype == "bf16" for r in result.ranked)


def test_search_with_fp8_activations_equals_brute_force() -> None:
    model = ModelSpec(name="moe-fp8", num_layers=12, hidden_size=2048, ffn_hidden_size=5632, num_heads=16,
                      num_kv_heads=8, vocab_size=50000, num_experts=16, top_k=2, moe_ffn_hidden_size=2816,
                      seq_len=4096, global_batch_sequences=256, precision="fp8")
    accel = replace(get_accelerator("H100"), hbm_gib=12.0)  # small HBM so the options matter
    capacity = FleetCapacity({"H100": accel}, {"H100": 16})
    space = SearchSpace(micro_batch_sizes=(1, 2), virtual_stages=(1, 2), optimality_gap=0.0,
                        optimizer_dtypes=("fp32", "bf16"), activation_dtypes=("bf16", "fp8"))
    fast = search_plans(model, capacity, top_k=1, space=space)
    slow = brute_force_plans(model, capacity, top_k=1, space=space)
    assert fast.ranked and slow.ranked
    assert fast.ranked[0].step_time_s == pytest.approx(slow.ranked[0].step_time_s, rel=1e-9)
    plain = search_plans(model, capacity, top_k=1, space=replace(space, activation_dtypes=("bf16",)))
    assert not plain.ranked or plain.ranked[0].step_time_s >= fast.ranked[0].step_time_s
    # the option is used where it fits what BF16 activations cannot
    assert any(r.plan.activation_dtype == "fp8" for r in search_plans(model, capacity, top_k=5, space=space).ranked)


def test_the_planner_finds_a_plan_for_the_reports_job_and_prices_the_reports_plan() -> None:
    capacity = FleetCapacity({"H800": H800}, {"H800": 2048})
    space = SearchSpace(optimizer_dtypes=("fp32", "bf16"), activation_dtypes=("bf16", "fp8"))
    result = search_plans(DEEPSEEK, capacity, top_k=5, space=space, goal=JobGoal.exactly(2048))
    assert result.ranked
    own = evaluate_plan(DEEPSEEK, balanced_plan(DEEPSEEK, replace(OWN_PLAN, recompute="selective",
                                                                  activation_dtype="fp8"), H800, CostParams()), H800)
    assert own.fits
    # the planner's best is at least as fast as the report's plan under the same cost model
    assert result.ranked[0].step_time_s <= own.step_time_s * (1 + space.optimality_gap)
