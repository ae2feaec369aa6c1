"""The foundation on a real multi-node local fleet: labels, agents, health, cordon, persistence."""

from __future__ import annotations

import pytest
import ray

from rayfleet.errors import SpecError
from rayfleet.platform import labels as L
from rayfleet.platform.agent import AGENT_NAMESPACE, agent_name
from rayfleet.platform.controller import CONTROLLER_NAME, ensure_controller
from rayfleet.platform.topology import build_topology

from .conftest import NUM_NODES, wait_until

pytestmark = pytest.mark.cluster


@ray.remote(num_cpus=0)
class _Probe:
    def where(self) -> str:
        return ray.get_runtime_context().get_node_labels()[L.NODE]


def test_every_node_carries_its_topology_labels_and_accelerators(local_fleet):
    expected = build_topology(num_nodes=NUM_NODES, accelerator="H100", accelerators_per_node=8, num_racks=2)
    assert local_fleet.topology == expected
    for entry in ray.nodes():
        labels = entry["Labels"]
        node = expected.node(labels[L.NODE])
        assert {k: labels[k] for k in node.to_labels()} == node.to_labels()
        assert entry["Resources"]["GPU"] == 8
        assert all(entry["Resources"][L.slot_resource(i)] == 1 for i in range(8))
    assert {n.name for n in local_fleet.sdk.topology().nodes} == {n.name for n in expected.nodes}


def test_one_agent_per_node_pinned_there_and_healthy(local_fleet):
    status = local_fleet.sdk.status()
    assert [r.topology.name for r in status.nodes] == [n.name for n in local_fleet.topology.nodes]
    for row in status.nodes:
        assert row.health == "healthy", row
        assert row.last_heartbeat_age_s is not None and row.last_heartbeat_age_s < 10
        assert row.usage.total == 8
        agent = ray.get_actor(agent_name(row.topology.name), namespace=AGENT_NAMESPACE)
        assert ray.get(agent.ping.remote()) == row.topology.name
        report = ray.get(agent.report.remote())
        assert report["labels"][L.NODE] == row.topology.name and report["self_check"]["ok"]


def test_cordoned_node_takes_no_new_work_until_uncordoned(local_fleet):
    target = "n0003"
    reserved = local_fleet.sdk.cordon(target, "test: maintenance")
    try:
        assert reserved == 8
        row = local_fleet.sdk.status().node(target)
        assert row.cordoned and row.usage.cordoned == 8 and row.usage.free == 0
        pinned = _Probe.options(num_gpus=1, label_selector={L.NODE: target}).remote()
        ready, _ = ray.wait([pinned.where.remote()], timeout=4)
        assert not ready, "an actor landed on a cordoned node"
        # Unpinned accelerator work still runs, elsewhere.
        others = [_Probe.options(num_gpus=1).remote() for _ in range(6)]
        places = ray.get([p.where.remote() for p in others], timeout=60)
        assert target not in places
        for actor in others:
            ray.kill(actor)
    finally:
        local_fleet.sdk.uncordon(target)
    assert ray.get(pinned.where.remote(), timeout=60) == target
    ray.kill(pinned)
    assert not local_fleet.sdk.status().node(target).cordoned
    kinds = [e.kind for e in local_fleet.sdk.events(limit=20, node=target)]
    assert "cordoned" in kinds and "uncordoned" in kinds


def test_silent_data_corruption_marks_node_suspect_and_cordons_it(local_fleet):
    target = "n0002"
    try:
        result = local_fleet.sdk.self_check(target, inject_fault="sdc")
        assert not result["ok"] and result["checksum"] != result["expected"]
        row = wait_until(lambda: (r := local_fleet.sdk.status().node(target)).cordoned and r, what="auto-cordon")
        assert row.health == "suspect" and "self-check" in row.health_reason
        assert any(e.kind == "self_check_failed" for e in local_fleet.sdk.events(node=target))
        # Healthy nodes are untouched.
        assert local_fleet.sdk.status().node("n0001").health == "healthy"
    finally:
        assert local_fleet.sdk.self_check(target, inject_fault=None)["ok"]
        local_fleet.sdk.uncordon(target)
    assert local_fleet.sdk.status().node(target).health == "healthy"


def test_controller_comes_back_with_its_inventory(local_fleet):
    sdk = local_fleet.sdk
    sdk.cordon("n0001", "test: persisted cordon")
    try:
        before = ray.get(sdk.controller.inventory.remote())
        events_before = len(sdk.events(limit=1000))
        # 1) Ray restarts a crashed controller (max_restarts=-1): state is reloaded from SQLite.
        ray.kill(sdk.controller, no_restart=False)
        wait_until(lambda: _try_inventory(sdk.controller), timeout_s=60, what="controller restart")
        # 2) A controller removed for good is recreated on the same database.
        ray.kill(sdk.controller, no_restart=True)
        wait_until(lambda: not _exists(), timeout_s=30, what="controller gone")
        sdk.controller = ensure_controller()
        after = ray.get(sdk.controller.inventory.remote())
        strip = lambda recs: [{k: v for k, v in r.items() if k not in ("last_heartbeat", "agent_info", "self_check_at")}
                              for r in recs]
        assert strip(after) == strip(before)
        assert next(r for r in after if r["name"] == "n0001")["cordoned"]
        assert len(sdk.events(limit=1000)) > events_before  # history kept, restarts appended
        wait_until(lambda: all(r.health == "healthy" for r in sdk.status().nodes), what="agents re-attach")
    finally:
        sdk.uncordon("n0001")


def _try_inventory(handle):
    try:
        return len(ray.get(handle.inventory.remote(), timeout=5)) == NUM_NODES
    except Exception:
        return False


def _exists() -> bool:
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=AGENT_NAMESPACE)
        return True
    except ValueError:
        return False


def test_unknown_node_is_a_clear_error(local_fleet):
    with pytest.raises(SpecError, match="'n9999'.*Fix"):
        local_fleet.sdk.cordon("n9999")


def test_ray_job_submit_runs_rayfleet_against_the_fleet(local_fleet):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(local_fleet.dashboard_url)
    job = client.submit_job(entrypoint="python -m rayfleet status --no-events")
    status = wait_until(lambda: (s := client.get_job_status(job)) in (JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                                     JobStatus.STOPPED) and s,
                        timeout_s=120, interval_s=1, what="job to finish")
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs
    assert all(f"n000{i}" in logs for i in range(NUM_NODES)) and "healthy" in logs


def test_the_fleets_log_monitors_and_reporters_scan_slowly(local_fleet):
    """Four raylets share this host: their log monitors and dashboard agents got
    ``shared_host_ray_env`` from the launcher (each monitor re-globbed its log directory ten times a
    second before, each agent's reporter read every worker of its node every 5 s)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "log_monitor.py" not in cmdline and "dashboard/agent.py" not in cmdline:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("RAY_ADDRESS") == local_fleet.address:
            found.append(("agent" if "agent.py" in cmdline else "log monitor",
                          env.get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"), env.get("LOG_NAME_UPDATE_INTERVAL_S"),
                          env.get("REPORTER_UPDATE_INTERVAL_MS")))
    assert len(found) == 2 * NUM_NODES and {f[1:] for f in found} == {("0", "2", "30000")}, found
