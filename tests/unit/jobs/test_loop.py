"""The train loop end to end on gloo: one process, resume, stop, output; DP runs against the reference."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("rayfleet.jobs.parallel", reason="the train loop needs rayfleet.jobs.parallel")

from rayfleet.jobs.local_processes import run_local, run_local_many  # noqa: E402
from rayfleet.jobs.train_metrics import METRIC_KEYS  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.jobs.train_state import TrainHooks  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from rayfleet.storage.model_registry import load_servable  # noqa: E402


def _spec(job_dict: dict, **overrides) -> TrainJobSpec:
    # lr high enough that a wrong gradient shows in the loss within a few steps
    base = {**job_dict, "optimizer": {"lr": 1e-2, "weight_decay": 0.1}, "schedule": {"warmup_steps": 1}}
    return TrainJobSpec.model_validate({**base, **overrides})


REFERENCE_PLAN = ParallelPlan(dp=1, micro_batch_size=2)


@pytest.fixture(scope="module")
def reference(token_dataset):
    """Single-process run of the job the DP tests compare against (4 steps, fp32)."""
    job = {"name": "unit", "model": {"preset": "tiny"}, "data": {"uri": token_dataset, "seq_len": 32},
           "steps": 4, "global_batch_size": 8, "precision": "fp32"}
    return run_local(_spec(job), REFERENCE_PLAN)


def test_single_process_reports_every_step_with_all_keys(reference) -> None:
    (metrics,) = reference.metrics
    (summary,) = reference.summaries
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and summary.steps_completed == 4
    assert set(METRIC_KEYS) <= set(metrics[0])
    m = metrics[-1]
    assert m["tokens"] == 8 * 32 and len(m["step_time_s_per_rank"]) == 1 and 0 < m["mfu"] < 1
    assert len(m["expert_load_max"]) == 2 and m["expert_load_mean"][0] == 8 * 32 * 2 / 4  # top-2 of 4 experts
    assert all(torch.isfinite(torch.tensor(summary.losses)))
    assert summary.losses[-1] < summary.losses[0]
    assert m["lr"] < metrics[1]["lr"]  # cosine decay after the warmup step
    assert len(set(summary.sample_ids_hashes)) == 4


class _Capture(TrainHooks):
    """Keeps a deep copy of the state after step ``at`` and asks for a stop after ``stop_after`` steps."""

    def __init__(self, at: int) -> None:
        self.at, self.state, self.seen, self.start_state = at, None, [], None

    def on_start(self, *, rank, world_size, plan, step, state_fn, load_fn) -> None:
        self.start_state = state_fn()  # e.g. a checkpointer's restore template: must not change the run

    def after_step(self, step, *, metrics, sample_ids, state_fn, load_fn) -> None:
        self.seen.append(sample_ids)
        if step == self.at:
            self.state = copy.deepcopy(state_fn())


def test_resume_from_state_continues_exactly(job_dict, reference) -> None:
    hook = _Capture(at=1)  # after 2 steps
    first = run_local(_spec(job_dict, steps=4), REFERENCE_PLAN, hooks=hook)
    assert first.losses == reference.losses  # deterministic, and reading the state changed nothing
    assert hook.start_state.step == 0 and hook.start_state.data["position"] == 0
    state = hook.state
    assert state.step == 2 and state.data["position"] == 16
    resumed_hook = _Capture(at=-1)
    resumed = run_local(_spec(job_dict, steps=4), REFERENCE_PLAN, resume=state, hooks=resumed_hook)
    assert resumed.summaries[0].first_step == 2
    assert resumed.losses == reference.losses[2:]
    assert resumed_hook.seen == hook.seen[2:]  # same samples, none skipped or repeated


def test_should_stop_ends_all_ranks_after_the_same_step(job_dict) -> None:
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 2

    result = run_local(_spec(job_dict, steps=4), REFERENCE_PLAN, should_stop=stop)
    assert result.summaries[0].stopped and result.summaries[0].steps_completed == 2


def test_fp8_run_saves_a_plain_servable(job_dict, tmp_path) -> None:
    out = tmp_path / "model"
    spec = _spec(job_dict, steps=2, precision="delayed", output={"uri": str(out)})
    result = run_local(spec, REFERENCE_PLAN)
    assert result.summaries[0].output_uri == str(out)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    servable = load_servable(str(out))
    from rayfleet.models import build_model

    plain = build_model(servable.config, device="meta").state_dict()
    assert set(servable.state_dict) == set(plain)  # no FP8 scaling buffers leak into serving
    assert servable.metadata["steps"] == 2 and servable.metadata["precision"] == "delayed"


def test_two_process_dp_matches_single_process_reference(job_dict, reference) -> None:
    """Even DP, uneven DP (mixed-fleet split) and the broken loss averaging, in one spawn."""
    even = ParallelPlan(dp=2, micro_batch_size=2)
    uneven = ParallelPlan(dp=2, micro_batch_size=2, replica_microbatches=(3, 1))
    runs = run_local_many(_spec(job_dict, steps=4), [
        (even, {}), (uneven, {}), (uneven, {"loss_averaging": "replica_mean_control"})])
    ref = torch.tensor(reference.losses, dtype=torch.float64)
    for result in runs[:2]:
        for rank_summary in result.summaries:  # every rank reports the global loss
            torch.testing.assert_close(torch.tensor(rank_summary.losses, dtype=torch.float64), ref,
                                       rtol=2e-6, atol=0)
        assert result.metrics[0][-1]["sample_ids_hash"] == reference.metrics[0][-1]["sample_ids_hash"]
        assert len(result.metrics[1][-1]["step_time_s_per_rank"]) == 2
    broken = torch.tensor(runs[2].losses, dtype=torch.float64)
    assert (broken[1:] - ref[1:]).abs().max() / ref.abs().max() > 2e-5  # ten times the tolerance


class _RestoreAtStart(TrainHooks):
    """How a checkpoint hook restores: it loads a saved state through ``load_fn`` in ``on_start``."""

    def __init__(self, state) -> None:
        self.state = state

    def on_start(self, *, rank, world_size, plan, step, state_fn, load_fn) -> None:
        assert step == 0
        load_fn(self.state)


def test_hook_restores_through_load_fn_at_start(job_dict, reference) -> None:
    capture = _Capture(at=2)
    run_local(_spec(job_dict, steps=4), REFERENCE_PLAN, hooks=capture)
    restored = run_local(_spec(job_dict, steps=4), REFERENCE_PLAN, hooks=_RestoreAtStart(capture.state))
    assert restored.summaries[0].first_step == 3 and restored.losses == reference.losses[3:]
