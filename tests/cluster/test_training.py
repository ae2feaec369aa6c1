"""Training jobs on the shared local fleet: `ray job submit`, the SDK, and bad specs.

The tiny MoE trains for a few steps on a small token dataset (the standard library's text,
tokenized by the byte tokenizer). Bad specs must fail in the driver, before any worker starts.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from rayfleet.errors import SpecError

from .conftest import local_reference

pytestmark = pytest.mark.cluster

STEPS = 4


def _spec(dataset: str, **overrides) -> dict:
    spec = {"name": "tiny-cluster", "model": {"preset": "tiny", "seed": 0},
            "data": {"uri": dataset, "seq_len": 64}, "plan": {"dp": 2, "ep": 2},
            "precision": "fp32", "steps": STEPS, "global_batch_size": 4,
            "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1},
            "resources": {"accelerator": "H100", "num_workers": 2}}
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("override, field", [
    ({"model": {"preset": "no-such-model"}}, "model.preset"),
    ({"data": {"uri": "/nonexistent/tokens", "seq_len": 64}}, "data.uri"),
    ({"model": {"preset": "deepseek-v3"}, "plan": {"dp": 2}, "data": None}, "plan"),
])
def test_bad_spec_fails_before_any_worker_starts(local_fleet, dataset, override, field):
    spec = _spec(dataset, **override)
    if spec.get("data") is None:
        spec["data"] = {"uri": dataset, "seq_len": 64}
    before = _num_train_workers(local_fleet.dashboard_url)
    with pytest.raises(SpecError) as err:
        local_fleet.sdk.train(spec)
    assert field in str(err.value) and "Fix:" in str(err.value)
    assert _num_train_workers(local_fleet.dashboard_url) == before


def test_ray_job_submit_runs_a_mixed_kind_job_that_holds_its_accelerators_in_a_reservation_group(
        local_fleet, dataset, tmp_path):
    """``ray job submit -- python -m rayfleet.jobs.train job.yaml`` (the CLI path users run) trains
    a plan of DP replicas on H100 and P800 (GPU and XPU: Ray Train gives all workers the same
    resources, so the workers ask for none): while the job runs, ``rayfleet:train:<job>`` holds one
    accelerator of each kind on the layout's nodes; it is gone when the job ends.

    The same job is the tier's check of a run's handle (``TrainingRun``: ``wait``, the metrics
    table with its columns and a falling loss) and of the servable export (``output.uri``): each
    had a Ray job of its own (about 35 CPU s of job start on 2 cores). The P800 node is the one
    ``test_serving_mixed.py`` added (it runs first, see conftest), else one started here."""
    import uuid

    import yaml
    from ray.util.placement_group import placement_group_table

    from rayfleet.jobs.training_run import TrainingRun, parse_metrics_lines
    from rayfleet.platform.topology import NodeTopology

    from .conftest import wait_until

    xpu = next((n for n in _live_topology().nodes if n.accelerator_type == "P800" and n.num_accelerators >= 1), None)
    added = None
    if xpu is None:
        added = xpu = NodeTopology(name="x0901", accelerator_type="P800", num_accelerators=2, rack="r09", block="b9",
                                   nvlink_domain="nvl-x0901")
        local_fleet.fleet.add_node(xpu)
    name = "tiny-mixed"

    def reservation() -> dict | None:
        return next((g for g in placement_group_table().values()
                     if g.get("name") == f"rayfleet:train:{name}" and g.get("state") != "REMOVED"), None)

    try:
        out_uri = str(tmp_path / "servable")
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(_spec(dataset, name=name, steps=6, output={"uri": out_uri},
                                            plan={"dp": 2, "replica_accelerators": ["H100", "P800"]})))
        job_id = f"tiny-mixed-{uuid.uuid4().hex[:8]}"
        submit = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--address",
             local_fleet.dashboard_url, "--submission-id", job_id, "--", "python", "-m", "rayfleet.jobs.train", str(job)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, RAY_AUTH_MODE="token"))
        run = TrainingRun(job_id=job_id, dashboard_url=local_fleet.dashboard_url, name=name, total_steps=6)
        try:
            group = wait_until(lambda: (reservation() or {}).get("state") == "CREATED" and reservation()
                               or submit.poll() is not None, timeout_s=300, interval_s=0.5, what="the reservation group")
            stdout, stderr = submit.communicate(timeout=400)
        finally:
            if submit.poll() is None:
                submit.kill()
        assert isinstance(group, dict), stdout[-3000:] + stderr[-3000:]
        assert sorted(next(iter(b)) for b in group["bundles"].values()) == ["GPU", "XPU"]
        xpu_id = next(n.ray_node_id for n in _live_topology().nodes if n.name == xpu.name)
        assert xpu_id in group["bundles_to_node_id"].values()
        assert submit.returncode == 0, stdout[-3000:] + stderr[-3000:]
        rows = parse_metrics_lines(stdout)
        assert [r["step"] for r in rows] == list(range(1, 7)), stdout[-3000:]
        assert all(r["loss"] == r["loss"] and r["tokens_per_s"] > 0 for r in rows)
        assert "finished" in stdout
        assert run.wait(timeout_s=60) == "SUCCEEDED", run.logs()[-3000:]
        table = run.metrics()
        assert len(table) == 6
        assert table["loss"][-1] < table["loss"][0]
        assert {"tokens_per_s", "mfu", "step_time_s"} <= set(table.columns)
        assert reservation() is None  # released with the run
        from rayfleet.storage.model_registry import load_servable

        servable = load_servable(out_uri)
        assert servable.config["num_layers"] == 3 and servable.metadata
    finally:
        if added is not None:
            local_fleet.fleet.kill_node(added.name)


def _live_topology():
    import ray

    from rayfleet.platform.topology import FleetTopology

    return FleetTopology.from_ray_nodes(ray.nodes())


def _num_train_workers(address: str) -> int:
    from ray.util.state import list_actors

    # the fleet's own address: with other Ray clusters on the host, none is "the" local one
    return sum(1 for a in list_actors(address=address, filters=[("state", "=", "ALIVE")])
               if "RayTrainWorker" in (a.class_name or ""))


def _losses(run) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in run.metrics().rows}


def test_killed_worker_resumes_from_its_shared_memory_snapshot(local_fleet, dataset, tmp_path):
    """Kill a training worker mid-run: the group restarts, every rank restores its node's
    shared-memory snapshot, and each step's loss equals the uninterrupted run's (fp32, same data)."""
    import signal
    import time

    import ray
    from ray.util.state import list_actors

    steps = 10
    spec = _spec(dataset, name="tiny-flash", steps=steps, plan={"dp": 2},
                 checkpoint={"every_n_steps": 2, "persist_every": 2, "uri": str(tmp_path / "ckpt"), "max_failures": 2})
    reference, reference_hashes = local_reference(spec)  # the uninterrupted run
    assert sorted(reference) == list(range(1, steps + 1))

    run = local_fleet.sdk.train(spec)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and max(_losses(run) or {0: 0}) < 5:
        assert run.status() not in ("FAILED", "STOPPED"), run.logs()[-3000:]
        time.sleep(0.5)
    workers = list_actors(address=local_fleet.dashboard_url,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    assert workers, "no live Ray Train worker to kill"
    victim = workers[0]
    os.kill(victim.pid, signal.SIGKILL)  # same machine: the local fleet's nodes are processes here
    assert run.wait(timeout_s=400) == "SUCCEEDED", run.logs()[-3000:]
    logs = run.logs()
    assert "rayfleet checkpoint: restored step" in logs and "from shm" in logs, logs[-3000:]
    resumed = _losses(run)
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=0), (step, resumed, reference)
    # the consumed samples: none skipped or repeated across the kill
    hashes = {int(r["step"]): r["sample_ids_hash"] for r in run.metrics().rows}
    assert hashes == reference_hashes
    assert ray.is_initialized()
    # The finished jobs' node snapshots (tmpfs, i.e. memory) are freed, not left for the host to hold.
    assert "MiB of tiny-flash-" in logs and "node snapshots" in logs, logs[-3000:]
    from rayfleet.platform.snapshot_node import snapshot_actor_name
    left = {}
    for node in ray.nodes():
        if node["Alive"]:
            with contextlib.suppress(ValueError):
                actor = ray.get_actor(snapshot_actor_name(node["NodeID"]), namespace="rayfleet")
                left.update({job: ranks for job, ranks in ray.get(actor.list.remote()).items()
                             if job.startswith("tiny-flash-")})
    assert left == {}, left


def test_elastic_job_shrinks_on_node_loss_and_grows_back(local_fleet, dataset, tmp_path):
    """4 workers on two 2-accelerator nodes; one node dies -> the job re-plans to 2 workers and
    resumes from its checkpoint (resharded); the node returns -> it grows back to 4. The test then
    stops the (long) job. Every step is reported once with its final value, and the losses track an
    uninterrupted run of as many steps."""
    from rayfleet.platform.topology import NodeTopology

    from .conftest import wait_until

    extra = [NodeTopology(name=f"n{9 - i:04d}", accelerator_type="H100", num_accelerators=2, rack="r09",
                          block="b9", nvlink_domain=f"nvl-n{9 - i:04d}") for i in range(2)]
    cordoned = [n.name for n in local_fleet.topology.nodes]
    # A ceiling, not a timing bet: unpaced steps take 0.1-1.5 s here and a node restart on a loaded
    # machine over 2 min (24 and then 48 steps both finished at 2 workers before the node was back).
    # The test stops the job a few steps after it has grown back; a constant learning rate makes
    # the reference run of as many steps comparable step by step.
    ceiling = 2000
    schedule = {"warmup_steps": 1, "kind": "constant"}
    spec = _spec(dataset, name="tiny-elastic", steps=ceiling, plan={"ep": 2}, global_batch_size=8, schedule=schedule,
                 # it trains while a node restarts: a quarter of a core a worker leaves the rest to the restart
                 resources={"accelerator": "H100", "elastic": {"min_workers": 2, "max_workers": 4},
                            "host_cpu_share": 0.25},
                 checkpoint={"every_n_steps": 2, "persist_every": 1, "uri": str(tmp_path / "ckpt")})
    for node in extra:
        local_fleet.fleet.add_node(node)
    try:
        for name in cordoned:  # the job may only use the two small nodes
            local_fleet.sdk.cordon(name, "test: elastic job on the small nodes only")
        run = local_fleet.sdk.train(spec)
        wait_until(lambda: max(_losses(run) or {0: 0}) >= 3 or run.status() in ("FAILED", "STOPPED"),
                   timeout_s=300, interval_s=0.5, what="the first formation's steps")
        assert "on 4 workers" in run.logs(), run.logs()[-3000:]
        local_fleet.fleet.kill_node(extra[1].name)
        wait_until(lambda: "formation 1 with 2 workers" in run.logs() or run.status() in ("FAILED", "STOPPED"),
                   timeout_s=300, interval_s=0.5, what="the job to re-form at 2 workers")
        shrink_log = run.logs()
        restored_at = max(_losses(run) or {0: 0})
        wait_until(lambda: max(_losses(run) or {0: 0}) > restored_at or run.status() in ("FAILED", "STOPPED"),
                   timeout_s=300, interval_s=0.5, what="a step at 2 workers")
        local_fleet.fleet.add_node(extra[1])
        wait_until(lambda: "formation 2 with 4 workers" in run.logs() or run.status() != "RUNNING",
                   timeout_s=400, interval_s=1.0, what="the job grown back to 4 workers")
        assert run.status() == "RUNNING" and _losses(run), (run.status(), run.logs()[-6000:])
        regrown = max(_losses(run))
        wait_until(lambda: max(_losses(run)) >= regrown + 2 or run.status() != "RUNNING",
                   timeout_s=180, interval_s=0.5, what="steps at 4 workers")
        assert run.status() == "RUNNING", run.logs()[-4000:]
        run.cancel()
        wait_until(lambda: run.status() in ("STOPPED", "FAILED", "SUCCEEDED"), timeout_s=120, interval_s=1.0,
                   what="the job stopped")
        logs = run.logs()
        assert "formation 1 with 2 workers" in shrink_log and "from storage" in logs, logs[-4000:]
        assert "formation 2 with 4 workers" in logs, logs[-4000:]  # grew back when the node returned
        resumed = _losses(run)
        steps = max(resumed)
        assert sorted(resumed) == list(range(1, steps + 1))
    finally:
        for node in extra:
            try:
                local_fleet.fleet.kill_node(node.name)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for name in cordoned:
            local_fleet.sdk.uncordon(name)
    reference, _ = local_reference({**spec, "steps": steps, "resources": {"accelerator": "H100", "num_workers": 2}})
    for step in range(1, steps + 1):  # DP4 vs DP2 differ only in summation order
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), (step, resumed, reference)
