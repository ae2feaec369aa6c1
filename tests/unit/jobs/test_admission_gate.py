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


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)  # ray.get is patched to pass the value through


class FakeController:
    """The controller's admission methods over an in-process AdmissionBook-like script."""

    def __init__(self, answers):
        self.answers, self.calls = list(answers), []
        for name in ("request_admission", "admission_status", "admission_heartbeat", "release_admission"):
            setattr(self, name, _Method(lambda *a, _n=name: self._answer(_n, a)))

    def _answer(self, name, args):
        self.calls.append(name)
        if name == "admission_heartbeat":
            return True
        if name == "release_admission":
            return True
        return self.answers.pop(0)


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    import rayfleet.jobs.admission_gate as gate

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    return gate


def _record(state, **extra):
    return {"state": state, "size": 0, "reason": "waiting (gang minimum 2 does not fit): 2: 0 idle", "position": 1,
            "borrowed": 0, "waiting_for": [], **extra}


def test_the_driver_is_refused_waits_queued_and_starts_when_admitted(no_ray, monkeypatch):
    job = _job(plan={"dp": 2}, resources={"num_workers": 2})
    refused = FakeController([{"outcome": "refused", "error": ["queue", "team-a", "queue='team-a': no such queue. Fix: x"]}])
    monkeypatch.setattr(no_ray, "_controller", lambda: refused)
    with pytest.raises(no_ray.QueueRefusedError, match="queue='team-a': no such queue"):
        no_ray.AdmissionTicket.open(job, print, job_id="sub-1")
    monkeypatch.setattr(no_ray, "_controller", lambda: FakeController([{"outcome": "direct"}]))
    assert no_ray.AdmissionTicket.open(job, print, job_id="sub-1") is None  # outside the queues: as before

    controller = FakeController([
        {"outcome": "queued", "record": _record("QUEUED")},
        {"record": _record("QUEUED"), "ready": False},
        {"record": _record("QUEUED"), "ready": False},  # unchanged: no second log line
        {"record": _record("ADMITTED", size=2, reason="admitted at 2 H100 within quota", position=0), "ready": True},
    ])
    monkeypatch.setattr(no_ray, "_controller", lambda: controller)
    lines = []
    import signal

    before = signal.getsignal(signal.SIGTERM)
    ticket = no_ray.AdmissionTicket.open(job, lines.append, job_id="sub-1")
    ticket.poll_s = 0.0
    assert ticket.wait() == 2
    assert lines == ["rayfleet queue: QUEUED in team-a (place 1 in line): waiting (gang minimum 2 does not fit): 2: 0 idle",
                     "rayfleet queue: admitted in team-a at 2 H100: admitted at 2 H100 within quota"]
    import signal

    assert signal.getsignal(signal.SIGTERM) is not before  # released first when the driver is stopped
    ticket.close()
    assert controller.calls[-1] == "release_admission"
    assert signal.getsignal(signal.SIGTERM) is before
