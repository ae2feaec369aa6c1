"""The capability table drives both sides: the trainer's plan checks and the planner's search.

Every row is tried as a small explicit plan (its ``example``) through the job's own door -- the
spec, then ``plan_inputs`` / ``job_plan`` (``placement/resolve.py``) -- and through
``require_runnable`` (what the worker's context calls): runnable rows pass, refused rows fail
naming the row's field and reason. The runnable search never ranks a refused kind, the job's
search space is the table's, and flipping a row flips both sides (the broken variant).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import rayfleet.placement.capabilities as capabilities
from rayfleet.errors import SpecError
from rayfleet.jobs.planning import job_plan, plan_inputs
from rayfleet.jobs.spec import PlanSection, TrainJobSpec
from rayfleet.placement.capabilities import (CAPABILITIES, Capability, refusals, require_runnable, runnable_space,
                                             runs_label)
from rayfleet.placement.fleet_capacity import fleet_capacity_of
from rayfleet.placement.model_spec import preset
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.planner import search_plans
from rayfleet.placement.resolve import TRAINABLE_SPACE
from rayfleet.placement.search_space import JobGoal, SearchSpace

SPEC_PLAN_FIELDS = set(PlanSection.model_fields)
# tiny with 4 layers: room for pp=2 x vpp=2 and DualPipeV's two chunks a rank
MODEL = {"preset": "tiny", "config": {"num_layers": 4}}
BATCH = 16


def _split(cap: Capability) -> tuple[dict[str, Any], str]:
    plan = {k: v for k, v in cap.example.items() if k != "precision"}
    precision = "tensorwise" if cap.example.get("precision") == "fp8" else "bf16"
    return plan, precision


def _plan(cap: Capability) -> tuple[ParallelPlan, str]:
    fields, precision = _split(cap)
    return ParallelPlan(**fields), "fp8" if precision != "bf16" else "bf16"


def _job(cap: Capability) -> dict:
    fields, precision = _split(cap)
    world = fields.get("tp", 1) * fields.get("cp", 1) * fields.get("pp", 1) * fields.get("dp", 1)
    plan = {"dp": 1, **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}
    return {"name": "cap", "model": MODEL, "data": {"uri": "/nonexistent", "seq_len": 64}, "steps": 2,
            "global_batch_size": BATCH, "precision": precision, "plan": plan, "resources": {"num_workers": world}}


def test_every_row_is_complete_and_kinds_are_unique() -> None:
    assert len({c.kind for c in CAPABILITIES}) == len(CAPABILITIES)
    for cap in CAPABILITIES:
        assert cap.reason and cap.fix and cap.field and " " not in cap.name, cap.kind
        plan, precision = _plan(cap)
        assert cap.uses(plan, precision), f"{cap.kind}: its example does not use it"
        if not cap.runs:
            assert "issue 28" in cap.reason or "not implemented" in cap.reason, cap.kind


@pytest.mark.parametrize("cap", [c for c in CAPABILITIES if c.runs], ids=lambda c: c.kind)
def test_a_runnable_kind_passes_the_trainers_validation(cap: Capability) -> None:
    plan, precision = _plan(cap)
    require_runnable(plan, precision=precision)
    assert runs_label(plan, precision=precision) == "yes"
    if set(_split(cap)[0]) <= SPEC_PLAN_FIELDS:
        spec = TrainJobSpec.model_validate(_job(cap))
        resolved = job_plan(plan_inputs(spec), world_size=spec.resources.num_workers)
        assert cap.uses(resolved.plan, precision) and not resolved.searched


@pytest.mark.parametrize("cap", [c for c in CAPABILITIES if not c.runs], ids=lambda c: c.kind)
def test_a_refused_kind_is_refused_with_the_tables_reason(cap: Capability) -> None:
    plan, precision = _plan(cap)
    with pytest.raises(SpecError) as err:
        require_runnable(plan, precision=precision)
    assert err.value.field == cap.field and err.value.value == cap.value(plan)
    assert cap.reason in str(err.value) and f"Fix: {cap.fix}" in str(err.value)
    assert runs_label(plan, precision=precision) == f"no:{cap.name}"
    fields = set(_split(cap)[0])
    with pytest.raises(SpecError) as at_spec:
        TrainJobSpec.model_validate(_job(cap))
    if fields <= SPEC_PLAN_FIELDS:  # the job can ask for it: refused with the table's words
        assert at_spec.value.field == cap.field and cap.reason in str(at_spec.value)
    else:  # the job spec has no such field: refused as unknown, never run
        assert "is not a field of this section" in str(at_spec.value)


@pytest.mark.parametrize("model, fleet, precision", [
    (preset("llama3-8b"), "H100:1024", "bf16"),
    (preset("mixtral-8x7b"), "H100:256", "bf16"),
    (preset("deepseek-v3"), "H100:256", "fp8"),
])
def test_the_runnable_search_never_ranks_a_refused_kind(model, fleet, precision) -> None:
    wide = SearchSpace(dualpipe=True, optimizer_dtypes=("fp32", "bf16"), activation_dtypes=("bf16", "fp8"))
    goal = JobGoal.exactly(int(fleet.split(":")[1]))
    narrow = search_plans(model, fleet_capacity_of(fleet), top_k=5, space=runnable_space(wide), goal=goal)
    assert narrow.ranked
    assert all(not refusals(r.plan, precision=precision) for r in narrow.ranked)


def test_mixtral_expert_tp_plans_on_1024_h100_are_runnable() -> None:
    """Mixtral-8x7B on 1,024 H100 ranks expert-TP plans (ETP2 inside EP8), which the trainer runs
    (issue 28 item 3; tests/unit/jobs/test_expert_tensor_parallel_parity.py). They were the
    example of a refused kind until then."""
    result = search_plans(preset("mixtral-8x7b"), fleet_capacity_of("H100:1024"), top_k=5,
                          goal=JobGoal.exactly(1024))
    assert any(r.plan.etp > 1 for r in result.ranked)
    assert all(runs_label(r.plan, precision="bf16") == "yes" for r in result.ranked)


def test_llama3_8b_cp_plans_on_1024_h100_are_runnable() -> None:
    result = search_plans(preset("llama3-8b"), fleet_capacity_of("H100:1024"), top_k=5,
                          goal=JobGoal.exactly(1024))
    assert any(r.plan.cp > 1 for r in result.ranked)
    assert all(runs_label(r.plan, precision="bf16") == "yes" for r in result.ranked)


def test_the_jobs_search_space_is_the_tables() -> None:
    # the job's own search is the table's runnable space with one narrowing, ZeRO-3 as the only
    # rung (resolve.py says why, with the measurement); every other kind the trainer runs is
    # searched: CP, ETP, virtual stages (the old narrowing left those out: issue 28 item 5)
    assert TRAINABLE_SPACE == runnable_space(SearchSpace(max_pp=1, zero_stage=3))
    assert TRAINABLE_SPACE.zero_ladder == (3,)
    assert TRAINABLE_SPACE.context_parallel == runnable_space().context_parallel
    assert TRAINABLE_SPACE.virtual_stages == runnable_space().virtual_stages
    assert TRAINABLE_SPACE.expert_tp_options == runnable_space().expert_tp_options == "1_or_tp"
    assert set(TRAINABLE_SPACE.zero_ladder) <= set(runnable_space().zero_ladder)
    space = runnable_space()
    assert space.context_parallel == SearchSpace().context_parallel
    assert space.expert_tp_options == SearchSpace().expert_tp_options  # ETP runs (issue 28 item 3)
    # interleaved and DualPipeV pipelines run (issue 28 item 1): virtual stages stay searched and
    # DualPipeV is searched when asked (--dualpipe), as in the planner's own space
    assert space.virtual_stages == SearchSpace().virtual_stages
    assert runnable_space(SearchSpace(dualpipe=True, zero_stages=(1, 2))).dualpipe
    assert not runnable_space(SearchSpace(dualpipe=True)).dualpipe  # DualPipeV with ZeRO-3 does not run
    assert space.optimizer_dtypes == ("fp32",) and space.activation_dtypes == ("bf16",)
    assert space.zero_ladder == (1, 2, 3) and space.max_pp == SearchSpace().max_pp


def test_flipping_a_row_flips_both_sides(monkeypatch) -> None:
    """If the table said ETP did not run (as before issue 28 item 3), the spec would refuse etp: 2,
    the runnable space would drop ETP and the plan table would mark Mixtral's ETP plans."""
    cap = capabilities.capability("etp")
    TrainJobSpec.model_validate(_job(cap))  # runs today
    require_runnable(ParallelPlan(tp=2, dp=2, ep=2, etp=2))
    flipped = tuple(dataclasses.replace(c, runs=False) if c.kind == "etp" else c for c in CAPABILITIES)
    monkeypatch.setattr(capabilities, "CAPABILITIES", flipped)
    with pytest.raises(SpecError) as err:
        TrainJobSpec.model_validate(_job(cap))
    assert err.value.field == "plan.etp"
    assert runnable_space().expert_tp_options == "1"
    result = search_plans(preset("mixtral-8x7b"), fleet_capacity_of("H100:1024"), top_k=5,
                          goal=JobGoal.exactly(1024))
    labels = [runs_label(r.plan, precision="bf16") for r in result.ranked]
    assert any(label.startswith("no:") and "etp>1" in label for label in labels)
