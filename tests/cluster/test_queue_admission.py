"""Queue admission on the live fleet: wait, borrow, reclaim by an elastic shrink, controller restart.

Two queues of 2 H100 each (``rayfleet queue apply``); the queues govern those 4 of the fleet's 32
(docs/queues.md: the roots' quotas are what admission hands out). a1 fills team-a and b1 team-b;
b2 (elastic 1..2, team-b) waits QUEUED with its reason and place in line, shown by ``rayfleet job
list`` and ``rayfleet status``; the controller is killed and comes back with b2 still QUEUED in
the same place and every job still known; a1 is stopped, team-a idles and b2 borrows its 2; a2
(team-a, 1 H100, within quota) arrives and the controller reclaims by shrinking b2 one DP replica
(a ShrinkTraining through its shell: it re-forms at 1 from its checkpoint), then a2 runs. The
admission events come in that order with those reasons. The unit twin, in milliseconds:
tests/unit/platform/test_admission_controller.py. A job to an undeclared queue is refused by the
SDK and, submitted with ``ray job submit``, by its driver (exit 2, the field, value and fix).
A Serve pool in a queue is admitted by the same controller (``test_serve_pool_admitted_through_a_queue``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from rayfleet.cli import main
from rayfleet.errors import SpecError
from rayfleet.jobs.training_run import parse_metrics_lines
from live_helpers import free_port

from .conftest import wait_until

pytestmark = pytest.mark.cluster

TEAM_A, TEAM_B = "qa-team-a", "qa-team-b"
QUEUES_YAML = f"""\
queues:
  - name: {TEAM_A}
    quota: {{H100: 2}}
    borrow_limit: {{H100: 0}}
  - name: {TEAM_B}
    quota: {{H100: 2}}
    borrow_limit: {{H100: 2}}
"""


def _spec(dataset: str, name: str, queue: str, *, steps: int = 2000, **extra) -> dict:
    spec = {"name": name, "queue": queue, "model": {"preset": "tiny", "seed": 0},
            "data": {"uri": dataset, "seq_len": 64}, "precision": "fp32", "steps": steps, "global_batch_size": 4,
            "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1}}
    spec.update(extra)
    return spec


def _admission(sdk, job_id: str) -> dict | None:
    import ray

    try:
        return next((a for a in sdk.admissions() if a["request"]["job_id"] == job_id), None)
    except ray.exceptions.RayError:  # the controller restarting
        return None


def _restarted_since(sdk, killed_at: float) -> bool:
    """The controller answers again, and it is a new one (started after ``killed_at``)."""
    import ray

    try:
        return any(e.kind == "controller_started" and e.ts > killed_at for e in sdk.events(limit=50))
    except ray.exceptions.RayError:
        return False


def _state(sdk, job_id: str) -> str | None:
    found = _admission(sdk, job_id)
    return found["state"] if found else None


def _cli_json(capsys, *argv: str):
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_queue_wait_borrow_reclaim_and_controller_restart(local_fleet, dataset, tmp_path, capsys):
    import ray

    from rayfleet.platform.controller import get_controller

    sdk, url, address = local_fleet.sdk, local_fleet.dashboard_url, local_fleet.address
    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES_YAML)
    assert _cli_json(capsys, "queue", "apply", str(queues), "--json", "--address", address)["created"] == [TEAM_A, TEAM_B]

    nope = _spec(dataset, "tiny-q-nope", "qa-nope", resources={"accelerator": "H100", "num_workers": 1})
    with pytest.raises(SpecError, match=r"queue='qa-nope': no such queue.*rayfleet queue apply"):
        sdk.train(nope)  # the SDK asks before submitting; the job's driver asks again (ray job submit):
    job_yaml = tmp_path / "nope.yaml"
    job_yaml.write_text(yaml.safe_dump(nope))
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--address", url,
                          "--", "python", "-m", "rayfleet.jobs.train", str(job_yaml)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, RAY_AUTH_MODE="token"))
    assert out.returncode != 0 and "rayfleet train: error: queue='qa-nope': no such queue" in out.stdout + out.stderr, \
        out.stdout[-2000:] + out.stderr[-2000:]

    # a1 and b1 only hold their accelerators while the test waits for b2, the restart and a2: at a
    # fifth of a core each, they leave the shared host's CPU to those (resources.host_cpu_share)
    fixed = lambda n, share=None: {"plan": {"dp": n}, "resources": {  # noqa: E731
        "accelerator": "H100", "num_workers": n, **({"host_cpu_share": share} if share else {})}}
    runs = {}
    try:
        runs["a1"] = sdk.train(_spec(dataset, "tiny-q-a1", TEAM_A, **fixed(2, 0.2)))
        runs["b1"] = sdk.train(_spec(dataset, "tiny-q-b1", TEAM_B, **fixed(2, 0.2)))
        wait_until(lambda: _state(sdk, runs["a1"].job_id) == _state(sdk, runs["b1"].job_id) == "ADMITTED",
                   timeout_s=120, interval_s=0.5, what="a1 and b1 admitted within their quotas")
        runs["b2"] = sdk.train(_spec(
            dataset, "tiny-q-b2", TEAM_B, plan={"ep": 1},
            resources={"accelerator": "H100", "elastic": {"min_workers": 1, "max_workers": 2}, "host_cpu_share": 0.5},
            checkpoint={"every_n_steps": 2, "persist_every": 1, "uri": str(tmp_path / "b2-ckpt")}))
        b2 = runs["b2"].job_id
        wait_until(lambda: _state(sdk, b2) == "QUEUED", timeout_s=120, interval_s=0.5, what="b2 queued")
        queued = _admission(sdk, b2)
        assert queued["position"] == 1 and "gang minimum 1 does not fit" in queued["reason"], queued
        assert "0 idle" in queued["reason"], queued

        listed = {r["id"]: r for r in _cli_json(capsys, "job", "list", "--json", "--address", url)}
        assert (listed[b2]["status"], listed[b2]["queue_position"]) == ("QUEUED", 1), listed[b2]
        assert listed[b2]["queue_reason"] == queued["reason"]
        assert listed[runs["a1"].job_id]["queue_state"] == "ADMITTED"
        capsys.readouterr()
        assert main(["status", "--address", address]) == 0
        status_text = capsys.readouterr().out
        assert "training jobs in queues:" in status_text, status_text
        row = next(line.split() for line in status_text.splitlines() if line.startswith(b2))
        assert row[1:4] == [TEAM_B, "QUEUED", "1"], row

        # the controller dies in the middle; Ray restarts it from the same SQLite file
        killed_at = time.time()
        ray.kill(get_controller(), no_restart=False)
        wait_until(lambda: _restarted_since(sdk, killed_at), timeout_s=90, interval_s=0.5,
                   what="the restarted controller to answer")
        again = {a["request"]["job_id"]: a for a in sdk.admissions()}
        assert {runs[k].job_id for k in ("a1", "b1", "b2")} <= set(again), again
        assert (again[b2]["state"], again[b2]["position"], again[b2]["reason"]) == ("QUEUED", 1, queued["reason"])
        assert all(runs[k].status() == "RUNNING" for k in ("a1", "b1", "b2"))

        # team-a idles: b2 borrows its 2 accelerators (team-b's borrow limit) and trains
        assert sdk.stop_job(runs["a1"].job_id).status == "STOPPED"
        wait_until(lambda: _state(sdk, b2) == "ADMITTED", timeout_s=90, interval_s=0.5, what="b2 to borrow")
        borrowing = _admission(sdk, b2)
        assert (borrowing["size"], borrowing["borrowed"]) == (2, 2) and "borrowing 2 idle" in borrowing["reason"]
        wait_until(lambda: (_admission(sdk, b2) or {}).get("held") == 2 or runs["b2"].status() != "RUNNING",
                   timeout_s=240, interval_s=0.5, what="b2's first step on 2 workers")

        # team-a within its quota wants 1: the controller shrinks the borrower b2 (elastic) to 1
        runs["a2"] = sdk.train(_spec(dataset, "tiny-q-a2", TEAM_A, steps=3, **fixed(1)))
        a2 = runs["a2"].job_id
        wait_until(lambda: "formation 1 with 1 workers" in runs["b2"].logs() or runs["b2"].status() != "RUNNING",
                   timeout_s=240, interval_s=1.0, what="b2 to re-form at 1 worker")
        assert runs["a2"].wait(timeout_s=300) == "SUCCEEDED"
        b2_log = runs["b2"].logs()
        assert f"rayfleet queue: QUEUED in {TEAM_B} (place 1 in line)" in b2_log, b2_log[-3000:]
        assert f"rayfleet queue: admitted in {TEAM_B} at 2 H100, 2 borrowed" in b2_log
        assert "queue reclaim: shrunk by 1 DP replica(s) to 1" in b2_log
        a2_log = runs["a2"].logs()
        assert "rayfleet queue: admitted in qa-team-a at 1 H100" in a2_log and "reclaiming 1" in a2_log
        steps_after = parse_metrics_lines(b2_log)
        assert steps_after and runs["b2"].status() == "RUNNING"

        events = [(e.subject, e.kind, e.cause) for e in sdk.events(limit=400) if e.kind.startswith("queue_")]
        mine = [(s, k) for s, k, _ in events if s.startswith("job:tiny-q-")]
        order = [mine.index(x) for x in [("job:tiny-q-b2", "queue_waiting"), ("job:tiny-q-a1", "queue_released"),
                                         ("job:tiny-q-b2", "queue_admitted"), ("job:tiny-q-b2", "queue_reclaim"),
                                         ("job:tiny-q-a2", "queue_admitted")]]
        assert order == sorted(order), mine
        reclaim = next(c for s, k, c in events if (s, k) == ("job:tiny-q-b2", "queue_reclaim"))
        assert f"queue {TEAM_B} borrows 2 above quota, reclaimed by {TEAM_A}" in reclaim
        released = next(c for s, k, c in events if (s, k) == ("job:tiny-q-a1", "queue_released"))
        # Promptly, not by the heartbeat deadline: by its driver's SIGTERM handler, by its driver's own
        # release on the way out (where Ray Train's handler took the signal during fit: seen once in
        # a full cluster-tier run), or by the controller seeing the Ray job end.
        assert released in ("the job was stopped", "the job ended", "its Ray job ended"), released
    finally:
        for run in runs.values():
            run.cancel()
        ids = {run.job_id for run in runs.values()}
        try:
            wait_until(lambda: not ids & {a["request"]["job_id"] for a in sdk.admissions()}, timeout_s=90,
                       interval_s=1.0, what="every test job released")
            sdk.delete_queue(TEAM_A)
            sdk.delete_queue(TEAM_B)
        except Exception:  # noqa: BLE001 - leftover queues do not affect jobs without a queue
            pass


SERVE_QUEUE = "qa-serve"


def test_serve_pool_admitted_through_a_queue(local_fleet, capsys):
    """A Serve pool in a queue of 1 H100: admitted at 1 replica although it asks for 1..2 (Serve's
    autoscaling capped there), listed with its queue in ``rayfleet status``; a second app in the
    full queue and one in an undeclared queue are refused before anything is deployed; shutting
    the app down gives its grant back. One tiny colocated app on the session fleet."""
    from ray import serve

    from rayfleet.serving.deploy.pool_admission import PoolRefusedError

    sdk, address = local_fleet.sdk, local_fleet.address
    sdk.create_queue(SERVE_QUEUE, quota={"H100": 1}, borrow_limit={"H100": 0})
    model = {"preset": "tiny", "seed": 5, "dtype": "float64", "overrides": {"max_seq_len": 256}}
    engine = {"block_size": 8, "num_blocks": 32, "max_num_seqs": 4, "max_num_batched_tokens": 64}

    def app(name, queue, replicas=1, max_replicas=None):
        pool = {"replicas": replicas, "max_replicas": max_replicas, "accelerators_per_replica": 1,
                "accelerator_type": "H100", "queue": queue}
        return {"name": name, "mode": "colocated", "model": model, "engine": engine, "colocated": pool,
                "http": {"port": free_port(), "route_prefix": f"/{name}"}}

    served = None
    try:
        served = sdk.serve(app("qa-serve-1", SERVE_QUEUE, 1, 2), timeout_s=240)
        grant = served.grants["colocated"]
        assert (grant.replicas, grant.job_id) == (1, "serve:qa-serve-1/colocated"), grant
        record = _admission(sdk, grant.job_id)
        assert (record["state"], record["size"], record["held"], record["request"]["queue"]) == (
            "ADMITTED", 1, 1, SERVE_QUEUE), record
        capsys.readouterr()
        assert main(["status", "--address", address]) == 0
        row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(grant.job_id))
        assert row[1:3] == [SERVE_QUEUE, "ADMITTED"], row

        with pytest.raises(PoolRefusedError, match=r"colocated.replicas=1: Serve pool qa-serve-2/colocated does "
                                                   rf"not fit in queue {SERVE_QUEUE}.*Fix: lower the pool's replicas"):
            sdk.serve(app("qa-serve-2", SERVE_QUEUE), timeout_s=60)
        with pytest.raises(PoolRefusedError, match=r"queue='qa-serve-nope': no such queue.*rayfleet queue apply"):
            sdk.serve(app("qa-serve-3", "qa-serve-nope"), timeout_s=60)
        assert not {"qa-serve-2", "qa-serve-3"} & set(serve.status().applications)  # nothing was deployed

        served.shutdown()
        served = None
        assert _admission(sdk, grant.job_id) is None  # the grant went back with the app
    finally:
        if served is not None:
            served.shutdown()
        try:
            sdk.delete_queue(SERVE_QUEUE)
        except Exception:  # noqa: BLE001 - a leftover queue does not affect jobs without a queue
            pass
