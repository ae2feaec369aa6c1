"""A validated spec cut into frozen slices: what each consumer gets, and what travels to workers."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError

import pytest

from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import ElasticBounds, LoopConfig, train_job
from rayfleet.placement.plan import ParallelPlan


@pytest.fixture()
def spec(job_dict) -> TrainJobSpec:
    return TrainJobSpec.model_validate({
        **job_dict, "name": "slices", "grad_clip": None,
        "plan": {"dp": 2, "ep": 2}, "grad_accum": 2,
        "resources": {"accelerator": "H100", "num_workers": 2, "elastic": {"min_workers": 2, "max_workers": 4}},
        "checkpoint": {"every_n_steps": 3}, "output": {"uri": "/tmp/out"}})


def test_each_consumer_gets_its_slice(spec) -> None:
    job = train_job(spec)
    loop = job.loop
    assert loop.model == spec.model.to_config() and loop.seed == spec.model.seed
    assert (loop.data.uri, loop.data.seq_len) == (spec.data.uri, spec.data.seq_len)
    assert loop.optimizer.lr == spec.optimizer.lr and loop.schedule.kind == spec.schedule.kind
    assert (loop.steps, loop.global_batch_size, loop.grad_clip, loop.output_uri) == (
        spec.steps, spec.global_batch_size, None, "/tmp/out")
    assert not loop.fp8_dispatch  # FP8 dispatch only under an FP8 recipe
    assert job.checkpoint is not None and job.checkpoint.every_n_steps == 3 and job.checkpoint.uri is None
    assert job.elastic == ElasticBounds(2, 4) and job.is_elastic
    planning = job.planning
    assert planning.explicit is not None and (planning.explicit.dp, planning.explicit.ep) == (2, 2)
    assert (planning.num_workers, planning.grad_accum, planning.accelerator) == (2, 2, "H100")
    assert job.with_checkpoint_uri("/ck").checkpoint.uri == "/ck" and job.checkpoint.uri is None


def test_the_worker_payload_pickles_and_is_frozen(spec) -> None:
    """Ray Train ships ``train_loop_config`` pickled: the slices must survive it unchanged."""
    job = train_job(spec)
    payload = {"loop": job.loop, "checkpoint": job.checkpoint, "plan": ParallelPlan(dp=2, ep=2)}
    assert pickle.loads(pickle.dumps(payload)) == payload
    with pytest.raises(FrozenInstanceError):
        job.loop.steps = 1  # type: ignore[misc]
    assert isinstance(job.loop, LoopConfig)
