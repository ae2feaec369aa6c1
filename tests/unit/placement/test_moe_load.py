"""Dropless vs token-drop vs forced-balance MoE routing in the cost model (issue 27).

Regression named after what it fixed: the cost model priced every MoE run as perfectly balanced,
so a dropless run (the busiest EP rank sets the layer's time) and a token-drop run (each expert
capped, padded to capacity) of one plan cost the same. The busiest rank's load factor now follows
from the run's routing, the plan and a measured per-expert load spread (moe_load.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rayfleet.placement.calibration.routing_pairs import ROUTING_PAIRS, measured_dropless_cv, model_ratio
from rayfleet.placement.cost_params import DROPLESS_EXPERT_LOAD_CV, CostParams
from rayfleet.placement.model_spec import load_model_spec, preset
from rayfleet.placement.moe_load import expected_max_of_normals, expert_load_factor
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.step_time_model import layer_time
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")


def test_expected_max_of_normals_matches_order_statistic_tables() -> None:
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)  # exact: 0.5642
    assert expected_max_of_normals(8) == pytest.approx(1.4236, abs=1e-3)
    assert expected_max_of_normals(64) == pytest.approx(2.3437, abs=2e-3)


def test_worked_example_qwen3_235b_ep8() -> None:
    """128 experts, top-8, EP8 (16 local experts), 4,096 tokens a rank: 32,768 copies a rank.
    Forced balance: 1 + 1.4236 x sqrt(0.875 / 32768) = 1.00736. Dropless with cv 1.82:
    skew = 1.82^2 x 0.875 / 16 = 0.18115, 1 + 1.4236 x sqrt(0.18115 + 2.67e-5) = 1.6060.
    Token drop at capacity factor 1.0: exactly 1.0 (padded to capacity), whatever the router."""
    kw = dict(num_experts=128, ep=8, copies_per_rank=4096 * 8)
    assert expert_load_factor(routing="forced_balance", **kw) == pytest.approx(1.00736, abs=1e-5)
    assert expert_load_factor(routing="dropless", dropless_load_cv=1.82, **kw) == pytest.approx(1.6060, abs=1e-3)
    assert expert_load_factor(routing="token_drop", dropless_load_cv=1.82, **kw) == 1.0
    assert expert_load_factor(routing="token_drop", capacity_factor=1.25, **kw) == 1.25
    # every expert on one rank: nothing to wait for
    assert expert_load_factor(routing="dropless", num_experts=128, ep=1, copies_per_rank=1e4,
                              dropless_load_cv=1.82) == 1.0
    with pytest.raises(ValueError, match="routing"):
        expert_load_factor(routing="balanced", **kw)


def _broken_factor(*, routing: str, num_experts: int, ep: int, copies_per_rank: float,
                   capacity_factor: float = 1.0, dropless_load_cv: float = 0.0) -> float:
    """The tempting shortcut: the busiest expert's spread, ignoring that a rank sums its experts."""
    return 1.0 + expected_max_of_normals(num_experts) * dropless_load_cv if routing == "dropless" else 1.0


def test_many_local_experts_average_the_skew_out() -> None:
    """EP64 with 4 local experts waits for a busier rank than EP8 with 16; the broken variant
    (the busiest expert, whatever the EP size) gives both the same factor."""
    wide = expert_load_factor(routing="dropless", num_experts=256, ep=64, copies_per_rank=16384, dropless_load_cv=1.0)
    narrow = expert_load_factor(routing="dropless", num_experts=256, ep=8, copies_per_rank=16384, dropless_load_cv=1.0)
    assert wide > narrow > 1.0
    broken = [_broken_factor(routing="dropless", num_experts=256, ep=ep, copies_per_rank=16384, dropless_load_cv=1.0)
              for ep in (64, 8)]
    assert broken[0] == broken[1]


def test_dropless_layer_costs_more_than_token_drop_of_the_same_plan() -> None:
    plan = ParallelPlan(tp=1, pp=2, vpp=24, ep=8, dp=8, micro_batch_size=2, ep_overlap=False)
    times = {r: layer_time(preset("qwen3-30b-a3b", precision="fp8", moe_routing=r), plan, 0, H100)
             for r in ("token_drop", "forced_balance", "dropless")}
    assert times["token_drop"].compute < times["forced_balance"].compute < times["dropless"].compute
    assert times["token_drop"].ep_comm < times["dropless"].ep_comm
    # with no skew, dropless is forced balance
    flat = replace(CostParams(), dropless_expert_load_cv=0.0)
    assert layer_time(preset("qwen3-30b-a3b", moe_routing="dropless"), plan, 0, H100, flat).compute == \
        pytest.approx(layer_time(preset("qwen3-30b-a3b", moe_routing="forced_balance"), plan, 0, H100, flat).compute)


def test_the_constant_is_the_routing_pairs_measurement() -> None:
    """DROPLESS_EXPERT_LOAD_CV is the median of the ModelZoo long-context pairs' values (each
    pair: the cv at which the model's dropless/forced ratio equals the measured one), and one
    value serves every sequence length (16K-128K) within 15%."""
    median, values = measured_dropless_cv()
    assert DROPLESS_EXPERT_LOAD_CV == pytest.approx(median, abs=0.01)
    assert max(values) / min(values) < 1.2
    for pair in ROUTING_PAIRS:
        assert model_ratio(pair, CostParams()) == pytest.approx(pair.measured_ratio, rel=0.05)


def test_routing_is_a_model_field_read_from_yaml() -> None:
    spec = load_model_spec({"preset": "qwen3-30b-a3b", "moe_routing": "token_drop", "moe_capacity_factor": 1.25})
    assert (spec.moe_routing, spec.moe_capacity_factor) == ("token_drop", 1.25)
    assert preset("qwen3-30b-a3b").moe_routing == "forced_balance"
