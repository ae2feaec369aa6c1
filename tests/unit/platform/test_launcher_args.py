import json

import pytest

from rayfleet.platform import labels as L
from rayfleet.platform.launcher import ray_start_args
from rayfleet.platform.topology import build_topology


def _arg(args, flag):
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")][0]


@pytest.fixture
def spawned(monkeypatch) -> list:
    """(argv, env) of every ``ray start`` a LocalFleet would run (``subprocess.Popen`` faked)."""
    import subprocess

    calls: list = []

    class FakePopen:
        def __init__(self, argv, *, env, **_):
            calls.append((argv, env))
            self.pid = 12345

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    return calls


def test_head_and_worker_args_carry_labels_and_accelerators():
    fleet = build_topology(num_nodes=2, accelerator="H100:1,P800:1")
    head = ray_start_args(fleet.nodes[0], head_address=None, head_port=7000, system_config={"a": 1})
    assert "--head" in head and _arg(head, "--port") == "7000" and _arg(head, "--num-gpus") == "8"
    assert L.parse_label_string(_arg(head, "--labels")) == fleet.nodes[0].to_labels()
    assert json.loads(_arg(head, "--system-config")) == {"a": 1}
    worker = ray_start_args(fleet.nodes[1], head_address="127.0.0.1:7000")
    assert "--head" not in worker and _arg(worker, "--address") == "127.0.0.1:7000"
    assert _arg(worker, "--num-gpus") == "0"  # P800 is an XPU, declared as a custom resource
    resources = json.loads(_arg(worker, "--resources"))
    assert resources["XPU"] == 8 and all(resources[L.slot_resource(i)] == 1 for i in range(8))


def test_each_node_gets_its_own_agent_ports():
    node = build_topology(num_nodes=1).nodes[0]
    a = ray_start_args(node, head_address="h:1")
    b = ray_start_args(node, head_address="h:1")
    assert _arg(a, "--dashboard-agent-listen-port") != _arg(b, "--dashboard-agent-listen-port")


def test_every_node_process_is_told_its_own_fleets_address(tmp_path, monkeypatch, spawned):
    """Two fleets on one host: Ray's clients that look a cluster up themselves (Ray Train's state
    API) read RAY_ADDRESS; without it they scan the host and find "multiple active Ray instances"."""
    from rayfleet.platform import launcher

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")  # another cluster's, in the caller's environment
    fleet = launcher.LocalFleet(address="127.0.0.1:41000", dashboard_url="", home=str(tmp_path), temp_dir="/tmp/x",
                                topology_nodes=[])
    for node in build_topology(num_nodes=2).nodes:
        fleet._spawn(node, head_address=None if node.role == "head" else fleet.address)
    assert [env["RAY_ADDRESS"] for _, env in spawned] == ["127.0.0.1:41000", "127.0.0.1:41000"]
    assert all(env["RAY_AUTH_MODE"] == "token" for _, env in spawned)


def test_a_local_fleets_training_workers_take_one_thread_each_unless_told(tmp_path, monkeypatch, spawned):
    """Its nodes share this machine's cores (launcher.SHARED_HOST_THREADS_ENV)."""
    from rayfleet.jobs.worker_entry import THREADS_ENV, cpu_threads_per_worker
    from rayfleet.platform import launcher

    monkeypatch.delenv(THREADS_ENV, raising=False)
    fleet = launcher.LocalFleet(address="127.0.0.1:41000", dashboard_url="", home=str(tmp_path), temp_dir="/tmp/x",
                                topology_nodes=[])
    node = build_topology(num_nodes=1).nodes[0]
    fleet._spawn(node, head_address=None)
    monkeypatch.setenv(THREADS_ENV, "3")
    fleet._spawn(node, head_address=None)
    assert launcher.SHARED_HOST_THREADS_ENV == THREADS_ENV
    (_, first), (_, second) = spawned
    assert [first[THREADS_ENV], second[THREADS_ENV]] == ["1", "3"]
    assert cpu_threads_per_worker(1, env=first) == 1 and cpu_threads_per_worker(1, env=second) == 3


def test_local_fleet_nodes_stay_on_loopback(tmp_path, spawned):
    """Regression: `ray start --node-ip-address=127.0.0.1` swapped in the machine's address and the
    fleet's GCS, raylets and workers listened on every interface. A loopback node is started through
    rayfleet's wrapper that keeps the address, and its processes are told to keep it too."""
    import sys

    from rayfleet.platform import launcher

    fleet = launcher.LocalFleet(address="127.0.0.1:41000", dashboard_url="", home=str(tmp_path), temp_dir="/tmp/x",
                                topology_nodes=[])
    for node in build_topology(num_nodes=2).nodes:
        fleet._spawn(node, head_address=None if node.role == "head" else fleet.address)
    wrapper = [sys.executable, "-m", "rayfleet.platform.loopback_ray_start", "start"]
    assert [argv[:4] for argv, _ in spawned] == [wrapper, wrapper]
    assert all("--node-ip-address=127.0.0.1" in argv for argv, _ in spawned)
    assert all(env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" for _, env in spawned)
    # A machine of a real cluster runs Ray's own CLI with its network address.
    assert launcher.ray_start_command("10.0.0.5")[-1].endswith("ray")
    assert launcher.ray_start_command("localhost") == wrapper[:3]
