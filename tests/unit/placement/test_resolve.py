"""``resolve_plan``: the worked example of ``placement/resolve.py``'s docstring, step by step."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.cost_model import GIB
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.planner import search_plans
from rayfleet.placement.resolve import (TRAINABLE_SPACE, PlanRequest, RequestedPlan, ResolvedPlan,
                                        homogeneous_capacity, resolve_plan)
from rayfleet.platform.catalogue import get_accelerator

# the ``tiny`` training preset's shapes at 64 tokens, 8 sequences a step
TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=256, num_experts=4, top_k=2, moe_ffn_hidden_size=64,
                 first_k_dense_layers=1, seq_len=64, global_batch_sequences=8)
FOUR_H100 = homogeneous_capacity("H100", 4)


def test_step1_an_explicit_plan_is_completed_validated_and_priced() -> None:
    request = PlanRequest(world_size=4, global_batch_size=8, grad_accum=2, explicit=RequestedPlan(ep=2))
    resolved = resolve_plan(TINY, request, FOUR_H100)
    assert isinstance(resolved, ResolvedPlan) and not resolved.searched
    plan = resolved.plan
    # dp = 4 / (tp*cp*pp); micro_batch_size = 8 sequences / dp 4 / grad_accum 2
    assert (plan.tp, plan.pp, plan.dp, plan.ep, plan.micro_batch_size) == (1, 1, 4, 2, 1)
    assert resolved.memory is not None and resolved.peak_memory_gib == pytest.approx(resolved.memory.total / GIB)
    assert 0 < resolved.peak_memory_gib < get_accelerator("H100").hbm_gib
    with pytest.raises(FrozenInstanceError):
        resolved.plan = plan  # type: ignore[misc]  # results are frozen


def test_step1_without_grad_accum_the_micro_batch_is_one() -> None:
    resolved = resolve_plan(TINY, PlanRequest(world_size=4, global_batch_size=8, explicit=RequestedPlan(ep=2)),
                            FOUR_H100)
    assert resolved.plan.micro_batch_size == 1


def test_step2_an_explicit_plan_that_does_not_fit_memory_is_refused_naming_field_value_and_fix() -> None:
    big = preset("deepseek-v3", seq_len=4096, global_batch_sequences=64)
    request = PlanRequest(world_size=8, global_batch_size=64, explicit=RequestedPlan(ep=8))
    with pytest.raises(SpecError) as info:
        resolve_plan(big, request, homogeneous_capacity("H100", 8))
    err, message = info.value, str(info.value)
    assert err.field == "plan" and err.value == "TP1 PP1 DP8 EP8 ETP1 mbs1 ZeRO-3"  # the completed plan
    usable = get_accelerator("H100").hbm_gib * GIB * CostParams().usable_memory_fraction
    params = CostParams()
    at_least = math.ceil(big.total_params() * (params.param_bytes + params.grad_bytes + params.optimizer_bytes) / usable)
    assert "GiB per device" in message and f"{usable / GIB:.1f} GiB usable" in message
    assert f"at least {at_least} H100" in message and "resources.num_workers" in message
    assert "plan.ep" in message and "plan.pp" in message and "plan.recompute: full" in message


def test_step2_degrees_that_do_not_divide_the_workers_name_the_plan() -> None:
    with pytest.raises(SpecError) as info:
        resolve_plan(TINY, PlanRequest(world_size=3, global_batch_size=6, explicit=RequestedPlan(tp=2)),
                     homogeneous_capacity("H100", 3))
    assert info.value.field == "plan" and info.value.value == {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "etp": 1,
                                                               "recompute": "none", "zero_stage": 3,
                                                               "vpp": 1, "dualpipe": False}
    assert "divides resources.num_workers" in str(info.value)


def test_step3_without_an_explicit_plan_the_searchs_fastest_trainable_plan_is_chosen() -> None:
    resolved = resolve_plan(TINY, PlanRequest(world_size=4, global_batch_size=8), FOUR_H100)
    assert resolved.searched and resolved.memory is None
    plan = resolved.plan
    assert plan.world_size == 4 and (plan.cp, plan.etp, plan.pp) == (1, 1, 1) and plan.stage_starts is None
    best = search_plans(TINY, FOUR_H100, top_k=8, space=TRAINABLE_SPACE).ranked[0]
    assert (plan.tp, plan.dp, plan.ep, plan.micro_batch_size) == (best.plan.tp, best.plan.dp, best.plan.ep,
                                                                   best.plan.micro_batch_size)
    assert resolved.peak_memory_gib == pytest.approx(best.peak_memory_gib)


def test_step3_a_searched_plan_honours_grad_accum() -> None:
    plan = resolve_plan(TINY, PlanRequest(world_size=2, global_batch_size=8, grad_accum=4),
                        homogeneous_capacity("H100", 2)).plan
    assert plan.dp * plan.micro_batch_size * 4 == 8


def test_step3_no_plan_at_all_names_the_plan_and_the_fix() -> None:
    big = preset("deepseek-v3", seq_len=4096, global_batch_sequences=64)
    with pytest.raises(SpecError) as info:
        resolve_plan(big, PlanRequest(world_size=8, global_batch_size=64, max_pp=1), homogeneous_capacity("H100", 8))
    assert info.value.field == "plan" and info.value.value == "auto" and "more accelerators" in str(info.value)


def test_a_world_of_no_workers_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        resolve_plan(TINY, PlanRequest(world_size=0, global_batch_size=8), FOUR_H100)
    assert info.value.field == "resources.num_workers"

