"""`rayfleet job list | status | logs --follow | stop | resume` against the shared local fleet.

One long tiny-MoE job is followed while it runs (its metrics lines arrive through Ray's
``tail_job_logs`` before it ends), stopped from the CLI, found STOPPED in ``job list --json``,
then resumed: the resubmission restores the newest checkpoint of the first run (same run key)
instead of starting at step 1.
"""

from __future__ import annotations

import io
import json
import threading

import pytest

from rayfleet.cli import main
from rayfleet.jobs.training_run import METRICS_PREFIX, parse_metrics_lines

from .conftest import wait_until

pytestmark = pytest.mark.cluster


def _spec(dataset: str) -> dict:
    # Far more steps than the test waits for: it stops the job itself.
    return {"name": "tiny-lifecycle", "model": {"preset": "tiny", "seed": 0}, "data": {"uri": dataset, "seq_len": 64},
            "plan": {"dp": 2}, "precision": "fp32", "steps": 500, "global_batch_size": 4, "optimizer": {"lr": 1e-3},
            "schedule": {"warmup_steps": 1},
            # it trains while the test follows, lists and stops it: a quarter of a core a worker
            "resources": {"accelerator": "H100", "num_workers": 2, "host_cpu_share": 0.25},
            "checkpoint": {"every_n_steps": 2, "persist_every": 1}}


class _Follower:
    """``fleet.job_logs(id, follow=True)`` drained in a thread; ``text`` grows as chunks arrive."""

    def __init__(self, sdk, job_id: str) -> None:
        self.chunks: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sdk, job_id), daemon=True)
        self.thread.start()

    def _run(self, sdk, job_id: str) -> None:
        try:
            for chunk in sdk.job_logs(job_id, follow=True):
                self.chunks.append(chunk)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def _cli_json(capsys, *argv: str):
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_follow_stop_list_and_resume_a_training_job(local_fleet, dataset, tmp_path, capsys):
    sdk, url = local_fleet.sdk, local_fleet.dashboard_url
    run = sdk.train(_spec(dataset), storage_path=str(tmp_path / "runs"))
    follower = _Follower(sdk, run.job_id)
    progress, progress_status = io.StringIO(), []  # `rayfleet train`'s own follow, on the same job
    progress_thread = threading.Thread(target=lambda: progress_status.append(run.follow(out=progress)), daemon=True)
    progress_thread.start()
    try:
        wait_until(lambda: len(parse_metrics_lines(follower.text)) >= 3 or follower.error is not None,
                   timeout_s=120, interval_s=0.5, what="three streamed metrics lines")
        assert follower.error is None, follower.error
        status = _cli_json(capsys, "job", "status", run.job_id, "--json", "--address", url)
        assert status["status"] == "RUNNING", status  # streamed while running, not read after the end
        assert (status["kind"], status["name"]) == ("train", "tiny-lifecycle")

        capsys.readouterr()
        assert main(["job", "stop", run.job_id, "--address", url]) == 0
        assert capsys.readouterr().out.strip() == f"{run.job_id}: STOPPED"
        follower.thread.join(timeout=30)  # the stream ends with the job
        assert not follower.thread.is_alive() and follower.error is None
        progress_thread.join(timeout=30)
        assert progress_status == ["STOPPED"] and "step 3/500" in progress.getvalue(), progress.getvalue()[-2000:]
    finally:
        run.cancel()
    streamed = parse_metrics_lines(follower.text)
    assert [r["step"] for r in streamed] == list(range(1, len(streamed) + 1))
    # resources.host_cpu_share 0.25: after each step rank 0 idled until its CPU was a quarter of the
    # wall time, so steps end at least about 4x their own compute apart (uncapped: about 1x)
    gaps = sorted(b["time_unix_s"] - a["time_unix_s"] for a, b in zip(streamed, streamed[1:]))
    compute = sorted(r["compute_time_s"] for r in streamed[1:])
    assert gaps[len(gaps) // 2] >= 0.8 * compute[len(compute) // 2] / 0.25, (gaps, compute)
    assert follower.text.count(METRICS_PREFIX) == len(streamed)  # each chunk once: no re-download
    assert f"checkpoints of run {run.job_id} in {tmp_path / 'runs' / run.job_id / 'checkpoints'}" in follower.text

    listed = {r["id"]: r for r in _cli_json(capsys, "job", "list", "--json", "--kind", "train", "--address", url)}
    assert listed[run.job_id]["status"] == "STOPPED"
    capsys.readouterr()  # the CLI's --follow --json of an ended job: JSON lines, then it returns
    assert main(["job", "logs", run.job_id, "--follow", "--json", "--address", url]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {line["job"] for line in lines} == {run.job_id}
    assert len(parse_metrics_lines("".join(line["text"] for line in lines))) >= len(streamed)

    resumed = sdk.resume(run.job_id)
    try:
        assert sdk.job(resumed.job_id).resumed_from == run.job_id
        wait_until(lambda: parse_metrics_lines(resumed.logs()) or resumed.status() in ("FAILED", "STOPPED"),
                   timeout_s=120, interval_s=1.0, what="the resumed job's first step")
        logs = resumed.logs()
        first = parse_metrics_lines(logs)[0]["step"]
        assert "rayfleet checkpoint: restored step" in logs, logs[-3000:]
        assert first > 2, f"the resumed run started at step {first}, not after the first run's checkpoints"
    finally:
        resumed.cancel()
