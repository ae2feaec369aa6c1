"""ParallelPlan validation: every user mistake names the field, the value and the fix."""

from __future__ import annotations

import pickle

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.plan import ParallelPlan, validate_plan

MOE = ModelSpec(name="moe", num_layers=8, hidden_size=512, ffn_hidden_size=1024, num_heads=8, num_kv_heads=4,
                vocab_size=1000, num_experts=12, top_k=2, moe_ffn_hidden_size=256, seq_len=1024,
                global_batch_sequences=64)


def _err(plan: ParallelPlan, model: ModelSpec = MOE, **kw) -> SpecError:
    with pytest.raises(SpecError) as info:
        validate_plan(plan, model, **kw)
    return info.value


def test_valid_plan_passes() -> None:
    validate_plan(ParallelPlan(tp=2, pp=2, dp=4, ep=4), MOE, world_size=16, scaleup_domain_size=8)


def test_world_size_mismatch() -> None:
    err = _err(ParallelPlan(tp=2, pp=2, dp=2, ep=2), world_size=16)
    assert err.field == "plan" and "16" in str(err) and "Fix:" in str(err)


def test_ep_must_divide_experts() -> None:
    err = _err(ParallelPlan(tp=1, dp=8, ep=8))
    assert err.field == "plan.ep" and "num_experts=12" in str(err)


def test_tp_larger_than_nvlink_domain() -> None:
    err = _err(ParallelPlan(tp=8, dp=2), scaleup_domain_size=4)
    assert err.field == "plan.tp" and "NVLink domain" in str(err)


def test_layers_not_divisible_without_stage_starts() -> None:
    err = _err(ParallelPlan(pp=3, dp=1))
    assert err.field == "plan.pp" and "not divisible" in str(err)
    validate_plan(ParallelPlan(pp=3, stage_starts=(0, 3, 6)), MOE)  # explicit boundaries are fine


@pytest.mark.parametrize("starts", [(0, 4), (1, 3, 6), (0, 5, 5), (0, 3, 8)])
def test_bad_stage_starts(starts) -> None:
    assert _err(ParallelPlan(pp=3, stage_starts=starts)).field == "plan.stage_starts"


def test_more_stages_than_layers() -> None:
    assert _err(ParallelPlan(pp=16)).field == "plan.pp"


def test_tp_must_divide_heads_and_fit_kv_heads() -> None:
    assert _err(ParallelPlan(tp=3, dp=1)).field == "plan.tp"
    gqa = ModelSpec(name="gqa", num_layers=2, hidden_size=768, ffn_hidden_size=1536, num_heads=12,
                    num_kv_heads=4, vocab_size=100)
    err = _err(ParallelPlan(tp=6, dp=1), gqa)
    assert "num_kv_heads=4" in str(err)


def test_expert_grid_must_fold_into_stage_ranks() -> None:
    err = _err(ParallelPlan(tp=2, dp=2, ep=6))  # 6 does not divide tp*cp*dp = 4
    assert err.field == "plan.ep" and "parallel folding" in str(err)
    validate_plan(ParallelPlan(tp=4, dp=1, ep=2, etp=2), MOE)  # etp*ep = tp


def test_dense_model_has_no_experts() -> None:
    dense = preset("llama3-8b", num_layers=4)
    assert _err(ParallelPlan(dp=2, ep=2), dense).field == "plan.ep"


def test_batch_must_divide() -> None:
    err = _err(ParallelPlan(dp=3, micro_batch_size=2, ep=1))
    assert err.field == "plan.micro_batch_size" and "global_batch_sequences=64" in str(err)


def test_cp_must_divide_sequence() -> None:
    assert _err(ParallelPlan(cp=3, dp=1)).field == "plan.cp"


def test_heterogeneous_tp_degrees_must_divide_tp() -> None:
    validate_plan(ParallelPlan(tp=4, dp=1, layer_tp=(4, 4, 2, 2, 1, 1, 4, 4)), MOE)
    assert _err(ParallelPlan(tp=4, dp=1, layer_tp=(4, 4, 3, 2, 1, 1, 4, 4))).field == "plan.layer_tp"
    assert _err(ParallelPlan(tp=4, dp=1, layer_tp=(4, 4))).field == "plan.layer_tp"


def test_mixed_replica_microbatches_must_cover_the_batch() -> None:
    plan = ParallelPlan(dp=2, replica_accelerators=("H100", "A100"), replica_microbatches=(40, 20))
    assert _err(plan).field == "plan.replica_microbatches"
    validate_plan(ParallelPlan(dp=2, replica_accelerators=("H100", "A100"), replica_microbatches=(40, 24)), MOE)


def test_errors_pickle_across_processes() -> None:
    err = _err(ParallelPlan(tp=1, dp=8, ep=8))
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.field == "plan.ep"


def test_coords_cover_both_grids() -> None:
    plan = ParallelPlan(tp=2, cp=1, dp=4, pp=2, ep=4, etp=1)
    coords = [plan.coords(r) for r in range(plan.world_size)]
    assert len(set((c.tp, c.cp, c.dp, c.pp) for c in coords)) == plan.world_size
    assert len(set((c.etp, c.ep, c.edp, c.pp) for c in coords)) == plan.world_size
    assert coords[1].tp == 1 and coords[2].dp == 1 and coords[8].pp == 1
    assert plan.edp == 2
