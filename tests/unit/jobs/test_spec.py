"""TrainJobSpec validation: every bad field fails before any worker, naming the field and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.planning import check_dataset, job_plan, model_spec_for, plan_inputs, validate_job
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.placement.plan import ParallelPlan

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "jobs").glob("*.yaml"))


def plan_of(spec: TrainJobSpec, *, world_size: int, accelerator: str | None = None) -> ParallelPlan:
    """The plan the job would run with (the one translation, then placement's resolve_plan)."""
    return job_plan(plan_inputs(spec), world_size=world_size, accelerator=accelerator).plan


def _with(base: dict, path: str, value) -> dict:
    data = copy.deepcopy(base)
    keys = path.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return data


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_jobs_load_and_plan(path: Path) -> None:
    spec = TrainJobSpec.from_yaml(path)
    plan = plan_of(spec, world_size=spec.resources.num_workers)
    assert plan.world_size == spec.resources.num_workers
    assert TrainJobSpec.model_validate(spec.to_dict()) == spec  # round trip, plan "auto" included


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"tiny-fp8.yaml", "tiny-bf16-dp.yaml", "mixed-fleet.yaml"}


@pytest.mark.parametrize("path,value,field,in_fix", [
    ("model.preset", "tinyy", "model.preset", "tiny"),
    ("model.config", {"dimm": 64}, "model.config.dimm", "dim"),
    ("model.config", {"num_heads": 3}, "model.config.num_heads", "num_heads"),
    ("precision", "fp9", "precision", "tensorwise"),
    ("bogus", 1, "bogus", "allowed here"),
    ("plan", {"dp": 3}, "global_batch_size", "multiple of 3"),
    ("plan", {"dp": 2, "tpp": 2}, "plan.tpp", "allowed here"),
    ("plan", "manual", "plan", "auto"),
    ("plan", {"dp": 2, "micro_batch_size": 3}, "plan.micro_batch_size", "divid"),
    ("plan", {"dp": 2, "replica_microbatches": [3, 2]}, "plan.replica_microbatches", "add up"),
    ("plan", {"cp": 3}, "data.seq_len", "divisible by 6"),  # load-balanced CP: 2*cp chunks
    ("grad_accum", 3, "grad_accum", None),
    ("optimizer.lr", -1.0, "optimizer.lr", None),
    ("optimizer.betas", [0.9, 1.5], "optimizer.betas", "0.95"),
    ("schedule.warmup_steps", 99, "schedule.warmup_steps", "fewer"),
    ("data.seq_len", 4096, "data.seq_len", "max_seq_len"),
    ("resources.accelerator", "H1OO", "resources.accelerator", "H100"),
    ("resources.elastic", {"min_workers": 4, "max_workers": 2}, "resources.elastic.min_workers", "min_workers <="),
    ("checkpoint", {"every_n_steps": 0}, "checkpoint.every_n_steps", None),
    ("steps", None, "steps", None),
])
def test_bad_field_names_field_value_and_fix(job_dict, path, value, field, in_fix) -> None:
    data = _with(job_dict, path, value)
    if path == "grad_accum":
        data["plan"] = {"dp": 2, "micro_batch_size": 2}
        data["resources"] = {"num_workers": 2}
    with pytest.raises(SpecError) as info:
        TrainJobSpec.model_validate(data)
    assert info.value.field == field, str(info.value)
    assert "Fix:" in str(info.value)
    if in_fix:
        assert in_fix in str(info.value).split("Fix:")[1] or in_fix in str(info.value)


def test_constructor_raises_spec_error_too(job_dict) -> None:
    with pytest.raises(SpecError, match="model.preset"):
        TrainJobSpec(**_with(job_dict, "model.preset", "nope"))


def test_missing_yaml_and_bad_yaml(tmp_path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        TrainJobSpec.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="mapping"):
        TrainJobSpec.from_yaml(tmp_path / "list.yaml")


def test_dataset_that_does_not_exist_fails_on_data_uri(job_dict, tmp_path) -> None:
    spec = TrainJobSpec.model_validate(_with(job_dict, "data.uri", str(tmp_path / "nowhere")))
    with pytest.raises(SpecError) as info:
        validate_job(spec)
    assert info.value.field == "data.uri" and "rayfleet data prepare" in str(info.value)


def test_dataset_too_small_for_one_batch(job_dict) -> None:
    spec = TrainJobSpec.model_validate({**job_dict, "global_batch_size": 4096})
    with pytest.raises(SpecError, match="fewer than one global batch"):
        check_dataset(spec)


def test_vocabulary_larger_than_model(job_dict) -> None:
    spec = TrainJobSpec.model_validate(_with(job_dict, "model.config", {"vocab_size": 100}))
    with pytest.raises(SpecError) as info:
        check_dataset(spec)
    assert info.value.field == "model.config.vocab_size"


def test_auto_plan_for_tiny_is_dp_or_small_ep(job_dict) -> None:
    spec = TrainJobSpec.model_validate(job_dict)
    for world in (1, 2, 4):
        plan = plan_of(spec, world_size=world, accelerator="H100")
        assert plan.world_size == world and plan.tp == 1 and plan.pp == 1
        assert plan.dp == world and plan.ep <= world
    resolved = validate_job(spec)
    assert resolved.plan.world_size == 1 and resolved.num_samples > spec.global_batch_size


def test_deepseek_v3_on_8_h100_does_not_fit(job_dict) -> None:
    big = {**job_dict, "model": {"preset": "deepseek-v3"}, "data": {"uri": "unused", "seq_len": 4096},
           "global_batch_size": 64, "resources": {"accelerator": "H100", "num_workers": 8}}
    explicit = TrainJobSpec.model_validate({**big, "plan": {"ep": 8}})
    with pytest.raises(SpecError) as info:
        plan_of(explicit, world_size=8)
    message = str(info.value)
    assert info.value.field == "plan" and "GiB" in message
    assert "more accelerators" in message and "plan.ep" in message and "plan.pp" in message
    with pytest.raises(SpecError) as auto:
        plan_of(TrainJobSpec.model_validate(big), world_size=8)
    assert auto.value.field == "plan" and "more accelerators" in str(auto.value)


def test_explicit_plan_must_fill_the_workers(job_dict) -> None:
    spec = TrainJobSpec.model_validate({**job_dict, "plan": {"dp": 2, "ep": 2}, "resources": {"num_workers": 2}})
    assert plan_of(spec, world_size=2).ep == 2
    with pytest.raises(SpecError) as info:
        plan_of(spec, world_size=4)
    assert info.value.field == "plan"
    with pytest.raises(SpecError) as info:  # 3 experts-groups cannot split 4 experts
        plan_of(TrainJobSpec.model_validate({**job_dict, "global_batch_size": 6, "plan": {"ep": 3},
                                                  "resources": {"num_workers": 3}}), world_size=3)
    assert info.value.field == "plan.ep"


def test_grad_accum_derives_micro_batch(job_dict) -> None:
    spec = TrainJobSpec.model_validate({**job_dict, "plan": {"dp": 2}, "grad_accum": 2,
                                        "resources": {"num_workers": 2}})
    assert plan_of(spec, world_size=2).micro_batch_size == 2
    auto = TrainJobSpec.model_validate({**job_dict, "grad_accum": 4})
    plan = plan_of(auto, world_size=2)
    assert plan.dp * plan.micro_batch_size * 4 == 8


def test_model_spec_matches_model_parameter_count(job_dict) -> None:
    spec = TrainJobSpec.model_validate(job_dict)
    config = spec.model.to_config()
    planner = model_spec_for(spec)
    assert planner.num_layers == config.num_layers and planner.num_experts == config.num_experts
    assert planner.global_batch_sequences == 8 and planner.seq_len == 32


def test_splits_the_trainer_does_not_run_are_refused_at_the_spec(job_dict) -> None:
    spec = copy.deepcopy(job_dict)
    spec["plan"] = {"pp": 2, "dp": 2, "dualpipe": True, "zero_stage": 3}  # DualPipeV with ZeRO-3
    spec["resources"] = {"num_workers": 4}
    with pytest.raises(SpecError) as err:
        TrainJobSpec.model_validate(spec)
    assert err.value.field == "plan.zero_stage" and "zero_stage: 2" in str(err.value)


def test_expert_tensor_parallel_plans_are_accepted_at_the_spec(job_dict) -> None:
    """etp was refused here until the trainer ran it (issue 28 item 3)."""
    spec = TrainJobSpec.model_validate({**job_dict, "plan": {"dp": 4, "ep": 2, "etp": 2},
                                        "resources": {"num_workers": 4}})
    plan = plan_of(spec, world_size=4)
    assert (plan.dp, plan.ep, plan.etp, plan.edp) == (4, 2, 2, 1)


@pytest.mark.parametrize("workers", [8, 16, 64])
def test_auto_plan_is_always_one_the_trainer_runs(job_dict, workers) -> None:
    spec = TrainJobSpec.model_validate({**job_dict, "global_batch_size": 64,
                                        "resources": {"num_workers": workers}})
    plan = plan_of(spec, world_size=workers)
    assert (plan.cp, plan.etp) == (1, 1) and plan.world_size == workers
