"""The job driver's admission request (pure parts of ``jobs.admission_gate``), without Ray."""

import json

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.admission_gate import admission_request, submission_id
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import train_job
from rayfleet.platform.queues import JobClass

BASE = {"name": "tiny-q", "queue": "team-a", "model": {"preset": "tiny"}, "data": {"uri": "/tmp/x", "seq_len": 64},
        "precision": "fp32", "steps": 4, "global_batch_size": 4}
CKPT = {"every_n_steps": 2, "persist_every": 1}


def _job(**extra):
    return train_job(TrainJobSpec.model_validate({**BASE, **extra}))


def test_a_fixed_job_asks_for_its_size_and_is_guaranteed():
    req = admission_request(_job(plan={"dp": 2}, resources={"num_workers": 2}), job_id="sub-1")
    assert (req.job_id, req.name, req.queue, req.min_size, req.max_size, req.replica_size, req.job_class) == (
        "sub-1", "tiny-q", "team-a", 2, 2, 2, JobClass.GUARANTEED)


def test_an_elastic_job_asks_for_its_range_and_may_be_opportunistic():
    job = _job(resources={"elastic": {"min_workers": 1, "max_workers": 2}}, checkpoint=CKPT)
    req = admission_request(job, job_id="sub-2")
    assert (req.min_size, req.max_size, req.replica_size, req.job_class) == (1, 2, 1, JobClass.ELASTIC)
    job = _job(resources={"elastic": {"min_workers": 2, "max_workers": 2}, "job_class": "opportunistic"},
               checkpoint=CKPT)
    assert admission_request(job, job_id="sub-3").job_class is JobClass.OPPORTUNISTIC


def test_a_job_in_a_queue_must_say_its_size():
    with pytest.raises(SpecError, match="resources.num_workers=None: a job in queue 'team-a' must say"):
        admission_request(_job(), job_id="sub-4")


def test_a_reclaimable_class_needs_elastic_and_a_checkpoint():
    with pytest.raises(SpecError, match="resources.job_class='elastic'.*checkpoint"):
        _job(resources={"num_workers": 2, "job_class": "elastic"})
    with pytest.raises(SpecError, match="resources.job_class='spot'"):
        _job(resources={"num_workers": 2, "job_class": "spot"})


def test_the_submission_id_comes_from_rays_job_config(monkeypatch):
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_9"}}))
    assert submission_id(run_key="rk", name="n") == "raysubmit_9"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert submission_id(run_key="rk", name="n") == "rk" and submission_id(run_key=None, name="n") == "n"


def test_a_shrink_the_shell_took_already_is_not_taken_twice():
    """A restarted controller sends an unfinished queue reclaim again; the shell ignores it."""
    from rayfleet.jobs.elastic.training_shell import TrainingShell
    from rayfleet.platform.autoscaler.service import SharedAutoscaler
    from rayfleet.platform.autoscaler.shell import LocalChannel
    from rayfleet.platform.autoscaler.types import ShrinkTraining

    job = _job(resources={"elastic": {"min_workers": 1, "max_workers": 2}}, checkpoint=CKPT)
    autoscaler = SharedAutoscaler(free_accelerators=lambda: ({}, {}), request_nodes=lambda d: None,
                                  record=lambda *e: None)
    shell = TrainingShell(job, LocalChannel(autoscaler), log=lambda line: None)
    shell.target_size = 2
    shrink = ShrinkTraining("tiny-q", 1, (1,), {}, "queue reclaim")
    shell.apply(shrink, 0.0)
    assert (shell.target_size, shell.version) == (1, 1)
    shell.apply(shrink, 1.0)
    assert (shell.target_size, shell.version) == (1, 1)
