"""Slow and hung ranks in real multi-process runs (gloo, no Ray): the loop's measures and the monitor.

The slow rank is a real straggler (``RAYFLEET_DEBUG_SLOW_RANK``: it computes 3x longer before the
step's last collective), so every rank's *wall* step time is the same and only the per-rank
compute time shows it; the test runs the slow-rank policy on both to prove it.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict

import pytest
import torch.multiprocessing as mp

from rayfleet.errors import SpecError
from rayfleet.jobs.health.monitor import HUNG_EXIT_CODE, FaultInjection, HealthMonitor
from rayfleet.jobs.health.policy import SlowRankPolicy
from rayfleet.jobs.local_processes import run_local
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.placement.plan import ParallelPlan

STEPS = 14


def _spec(job_dict: dict, steps: int) -> TrainJobSpec:
    return TrainJobSpec.model_validate({**job_dict, "steps": steps, "global_batch_size": 4, "precision": "fp32"})


def _flags(rows: list[dict], key: str) -> list:
    policy = SlowRankPolicy(threshold=1.3, window=8)
    return [d for r in rows for d in policy.observe(r["step"], dict(enumerate(r[key])))]


def test_a_slow_rank_is_flagged_by_compute_time_and_not_by_wall_time(job_dict, monkeypatch) -> None:
    monkeypatch.setenv("RAYFLEET_DEBUG_SLOW_RANK", "1:3.0")
    result = run_local(_spec(job_dict, STEPS), ParallelPlan(dp=2, micro_batch_size=2))
    rows = list(result.metrics[0])
    compute = [r["compute_time_s_per_rank"] for r in rows[1:]]
    # 3x: the rank burns 2x its previous step's compute on top (steps vary on a loaded machine)
    assert statistics.median(c[1] / c[0] for c in compute) > 2.0, compute
    flagged = _flags(rows, "compute_time_s_per_rank")
    assert [d.rank for d in flagged] == [1] and flagged[0].step <= 20
    # the old measure: wall step times, equal on both ranks because they leave the last collective together
    assert _flags(rows, "step_time_s_per_rank") == []


def test_a_clean_run_flags_nobody(job_dict, monkeypatch) -> None:
    monkeypatch.delenv("RAYFLEET_DEBUG_SLOW_RANK", raising=False)
    result = run_local(_spec(job_dict, STEPS), ParallelPlan(dp=2, micro_batch_size=2))
    assert _flags(list(result.metrics[0]), "compute_time_s_per_rank") == []


class _DecisionFile:
    """Picklable ``on_decision``: appends each decision as a JSON line."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, decision) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"type": type(decision).__name__, **asdict(decision)}) + "\n")


def test_a_rank_hung_before_a_collective_is_found_and_rank0_exits(job_dict, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RAYFLEET_DEBUG_HANG_RANK", "1:3")
    out = tmp_path / "decisions.jsonl"
    monitor = HealthMonitor(hang_timeout_s=3.0, poll_s=0.25, on_decision=_DecisionFile(str(out)))
    with pytest.raises(mp.ProcessExitedException) as failed:
        run_local(_spec(job_dict, 8), ParallelPlan(dp=2, micro_batch_size=2), hooks=monitor)
    assert failed.value.exit_code == HUNG_EXIT_CODE and failed.value.error_index == 0
    (decision,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert decision["type"] == "HungCollectiveDecision" and decision["action"] == "restart_group"
    # rank 0 waits in the collective; rank 1's last beat (after step 2) may be a poll younger
    assert decision["suspect_ranks"] == [1] and 0 in decision["stalled_ranks"]
    assert "stopped at step 2" in decision["cause"]


def test_fault_injection_settings_are_checked() -> None:
    assert FaultInjection.from_env({}) == FaultInjection()
    assert FaultInjection.from_env({"RAYFLEET_DEBUG_SLOW_RANK": "2:3.5"}).slow_factor == 3.5
    with pytest.raises(SpecError, match="RAYFLEET_DEBUG_HANG_RANK"):
        FaultInjection.from_env({"RAYFLEET_DEBUG_HANG_RANK": "one"})
    with pytest.raises(SpecError, match="factor must be >= 1"):
        FaultInjection.from_env({"RAYFLEET_DEBUG_SLOW_RANK": "1:0.5"})


def test_hang_timeout_follows_the_slowest_step() -> None:
    monitor = HealthMonitor(hang_timeout_s=5.0, hang_step_factor=10.0)
    assert monitor.timeout_s() == 5.0
    monitor.after_step(0, metrics={"step_time_s_per_rank": [0.2, 1.5]}, sample_ids=(), state_fn=None, load_fn=None)
    assert monitor.timeout_s() == 15.0
    assert os.environ.get("RAYFLEET_DEBUG_HANG_RANK") is None
