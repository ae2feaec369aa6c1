"""``rayfleet.jobs.dry_run``: the plan a job would get, by the submission's own planning path."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.dry_run import dry_run, format_dry_run
from rayfleet.jobs.planning import job_plan, plan_inputs
from rayfleet.jobs.spec import TrainJobSpec

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_job_dry_runs_to_the_plan_a_submission_gets(path: Path) -> None:
    spec = TrainJobSpec.from_yaml(path)
    report = dry_run(spec)
    expected = job_plan(plan_inputs(spec), world_size=report.world_size).plan
    assert report.plan == expected and report.runs == "yes"
    assert report.peak_memory_gib > 0 and report.step_time_s and sum(report.nodes.values()) >= 1
    text = format_dry_run(report, spec)
    assert expected.describe() in text and "runs:     yes" in text


def test_an_elastic_job_is_planned_at_its_requested_size_and_says_so() -> None:
    spec = TrainJobSpec.from_yaml(next(p for p in EXAMPLES if p.name == "deepseek-v3.yaml"))
    report = dry_run(spec)
    assert report.world_size == 2048 and "elastic" in report.sized_by
    assert report.nodes == {"H100": 256} and report.smallest  # also planned at min_workers
    text = format_dry_run(report, spec)
    assert "elastic:  formations of 1536..2048" in text
    # without num_workers it plans at max_workers
    data = spec.to_dict()
    data["resources"] = {"accelerator": "H100", "elastic": {"min_workers": 1536, "max_workers": 2048}}
    assert dry_run(TrainJobSpec.model_validate(data)).sized_by.startswith("resources.elastic.max_workers")


def test_a_job_without_a_size_names_the_field_and_the_fix() -> None:
    spec = TrainJobSpec.from_yaml(next(p for p in EXAMPLES if p.name == "tiny-fp8.yaml"))
    data = spec.to_dict()
    data["resources"] = {"accelerator": "H100"}
    with pytest.raises(SpecError) as err:
        dry_run(TrainJobSpec.model_validate(data))
    assert err.value.field == "resources.num_workers" and "--set resources.num_workers=N" in str(err.value)
