"""FlashCheckpointHook inside the real train loop (one gloo process, tiny MoE, fp32): a run stopped
after 3 of 5 steps resumes from shared memory, or from storage, and its next losses and samples
equal the uninterrupted run's."""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest

pytest.importorskip("rayfleet.jobs.parallel", reason="the train loop needs rayfleet.jobs.parallel (issue 5)")

from rayfleet.jobs.checkpoint.hook import FlashCheckpointHook  # noqa: E402
from rayfleet.jobs.local_processes import run_local  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.jobs.train_state import TrainHooks  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from rayfleet.storage.checkpoint import latest_checkpoint, verify_checkpoint  # noqa: E402

PLAN = ParallelPlan(dp=1, micro_batch_size=2)


def _spec(job_dict: dict) -> TrainJobSpec:
    return TrainJobSpec.model_validate({**job_dict, "steps": 5, "optimizer": {"lr": 1e-2, "weight_decay": 0.1},
                                        "schedule": {"warmup_steps": 1}})


class _Samples(TrainHooks):
    def __init__(self, inner: TrainHooks | None = None) -> None:
        self.inner, self.seen = inner, []

    def on_start(self, **kwargs) -> None:
        if self.inner:
            self.inner.on_start(**kwargs)

    def after_step(self, step, **kwargs) -> None:
        self.seen.append(kwargs["sample_ids"])
        if self.inner:
            self.inner.after_step(step, **kwargs)

    def on_end(self, summary, **kwargs) -> None:
        if self.inner:
            self.inner.on_end(summary, **kwargs)


@pytest.fixture()
def shm_root(tmp_path):
    path = f"/dev/shm/rayfleet-test-loop-{os.getpid()}-{tmp_path.name}"
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def test_stopped_run_resumes_from_shm_or_storage_with_the_same_losses_and_samples(job_dict, shm_root, tmp_path):
    spec = _spec(job_dict)
    reference_hook = _Samples()
    reference = run_local(spec, PLAN, hooks=reference_hook)

    uri = str(tmp_path / "ckpt")
    hook = FlashCheckpointHook(job="loop", snapshot_every=1, persist_every=2, checkpoint_uri=uri, shm_root=shm_root)
    pickle.loads(pickle.dumps(hook))  # must travel to Ray Train workers
    calls = []
    first = run_local(spec, PLAN, hooks=_Samples(hook), should_stop=lambda: calls.append(1) or len(calls) >= 3)
    assert first.summaries[0].stopped and first.losses == reference.losses[:3]
    assert [e.step for e in hook.events] == [1, 2, 3]
    # Step 2 was persisted in the background; the stop flushed step 3 (preemption path).
    assert hook.checkpointer.stats.persisted_steps == [2, 3]
    assert latest_checkpoint(uri).step == 3 and verify_checkpoint(uri).ok

    shm_hook = FlashCheckpointHook(job="loop", snapshot_every=1, persist_every=2, checkpoint_uri=uri, shm_root=shm_root)
    samples = _Samples(shm_hook)
    resumed = run_local(spec, PLAN, hooks=samples)
    assert (shm_hook.restored.source, shm_hook.restored.step) == ("shm", 3)
    assert resumed.summaries[0].first_step == 3
    assert resumed.losses == reference.losses[3:]
    assert samples.seen == reference_hook.seen[3:]  # no sample skipped or repeated

    storage_hook = FlashCheckpointHook(job="loop-other-node", snapshot_every=1, persist_every=2,
                                       checkpoint_uri=uri, shm_root=shm_root)
    resumed = run_local(spec, PLAN, hooks=storage_hook)
    assert (storage_hook.restored.source, storage_hook.restored.step) == ("storage", 5)  # the resumed run's flush
    assert resumed.losses == ()  # nothing left to do: 5 of 5 steps were done and persisted
