"""cluster.yaml and the cloud cluster configs declare exactly the labels and resources of `rayfleet up`.

No Ray cluster is started: configs are parsed, checked against Ray's own schema, and
`rayfleet node start --dry-run` prints the `ray start` command each machine would run.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import yaml

from rayfleet.cli import main
from rayfleet.errors import LabelError, SpecError, UnknownAcceleratorError
from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import get_accelerator
from rayfleet.platform.cluster_config import (
    check_declared_resources, cloud_node_types, kuberay_node_types, load_onprem_spec, load_yaml,
    node_topology_from_labels, onprem_spec,
)
from rayfleet.cli.node import own_addresses, unique_node_labels
from rayfleet.platform.topology import build_topology

REPO = Path(__file__).resolve().parents[3]
CLUSTER_YAML = REPO / "cluster.yaml"
CLOUD = {name: REPO / "examples" / "clusters" / f"{name}.yaml" for name in ("aws", "gcp")}
KUBERAY = REPO / "examples" / "clusters" / "kuberay.yaml"


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _dry_run(capsys, *argv: str) -> list[str]:
    assert main(["node", "start", "--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out.strip().splitlines()[-1])


# -- cluster.yaml (on-premises, Ray's local provider) --------------------------------------------
def test_cluster_yaml_is_the_same_fleet_as_rayfleet_up() -> None:
    spec = load_onprem_spec(CLUSTER_YAML)
    assert spec.topology == build_topology(num_nodes=3, num_racks=2)
    assert [n.address for n in spec.nodes] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert spec.head.topology.name == "n0000" and spec.head_address == "127.0.0.1:6379"
    assert spec.dashboard_url == "http://127.0.0.1:8265"


def test_cluster_yaml_passes_rays_own_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    for path in (CLUSTER_YAML, *CLOUD.values()):
        validate_config(prepare_config(yaml.safe_load(path.read_text())))


def test_cluster_yaml_never_runs_ray_stop() -> None:
    """Ray's default start commands begin with `ray stop`, which kills every Ray process here."""
    config = load_yaml(CLUSTER_YAML)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert key in config, f"{key} missing: Ray's default (`ray stop`, `ray start`) would apply"
    for key in ("head_start_ray_commands", "worker_start_ray_commands", "setup_commands",
                "head_setup_commands", "worker_setup_commands", "initialization_commands"):
        assert not any("ray stop" in cmd for cmd in config.get(key, [])), key
    assert all(cmd.startswith("rayfleet node start") for cmd in
               config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in config["head_start_ray_commands"][0]


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
def test_node_start_gives_each_machine_its_labels_and_accelerators(capsys, address: str) -> None:
    spec = load_onprem_spec(CLUSTER_YAML)
    node = spec.node_at([address]).topology
    args = _dry_run(capsys, "--config", str(CLUSTER_YAML), "--node-ip-address", address)
    opts = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    assert L.parse_label_string(opts["--labels"]) == node.to_labels()
    assert opts["--num-gpus"] == "8"
    assert json.loads(opts["--resources"]) == {L.slot_resource(i): 1.0 for i in range(8)}
    assert opts["--node-ip-address"] == address
    assert opts["--temp-dir"] == "/tmp/rayfleet-loopback" + ("" if node.role == "head" else f"/{node.name}")
    if node.role == "head":
        assert "--head" in args and opts["--port"] == "6379" and opts["--dashboard-port"] == "8265"
        assert opts["--dashboard-host"] == "0.0.0.0"
    else:
        assert "--head" not in args and opts["--address"] == "127.0.0.1:6379"


def test_node_start_finds_itself_by_the_address_ssh_reached(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SSH_CONNECTION", "127.0.0.1 51234 127.0.0.3 22")
    monkeypatch.delenv("RAYFLEET_NODE_IP", raising=False)
    assert own_addresses()[0] == "127.0.0.3"
    args = _dry_run(capsys, "--config", str(CLUSTER_YAML))
    assert L.parse_label_string(dict(a.split("=", 1) for a in args if "=" in a)["--labels"])[L.NODE] == "n0002"


def test_node_start_passes_extra_ray_start_args(capsys) -> None:
    args = _dry_run(capsys, "--config", str(CLUSTER_YAML), "--node-ip-address", "127.0.0.1", "--",
                    "--autoscaling-config=~/ray_bootstrap_config.yaml")
    assert args[-1] == "--autoscaling-config=~/ray_bootstrap_config.yaml"


def test_unknown_address_names_the_map(capsys) -> None:
    assert main(["node", "start", "--dry-run", "--config", str(CLUSTER_YAML), "--node-ip-address", "10.9.9.9"]) == 2
    err = capsys.readouterr().err
    assert "10.9.9.9" in err and "127.0.0.2" in err and "Fix:" in err


# -- malformed cluster.yaml: clear errors -------------------------------------------------------
def _broken(mutate) -> dict:
    config = copy.deepcopy(load_yaml(CLUSTER_YAML))
    mutate(config)
    return config


def _node_labels(config: dict, address: str) -> dict:
    return config["metadata"]["rayfleet"]["nodes"][address]["labels"]


def test_malformed_label_value_names_value_place_and_fix() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.3").update({L.RACK: "rack 01"}))
    with pytest.raises(LabelError) as err:
        onprem_spec(config, source="cluster.yaml")
    msg = str(err.value)
    assert "'rack 01'" in msg and L.RACK in msg and "127.0.0.3" in msg and "cluster.yaml" in msg and "Fix:" in msg


def test_malformed_label_key_is_refused() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.2").update({"rayfleet.io/Bad Key!": "x"}))
    with pytest.raises(LabelError, match="not a valid label key.*Fix:"):
        onprem_spec(config)


def test_missing_label_is_named() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.2").pop(L.NVLINK_DOMAIN))
    with pytest.raises(LabelError, match=r"missing label\(s\) \['rayfleet.io/nvlink-domain'\].*Fix:"):
        onprem_spec(config)


def test_non_string_label_value_says_quote_it() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.2").update({L.RACK: True}))
    with pytest.raises(LabelError, match="not a string. Fix: quote it"):
        onprem_spec(config)


def test_integer_count_is_accepted() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.2").update({L.NUM_ACCELERATORS: 8}))
    assert onprem_spec(config).node_at(["127.0.0.2"]).topology.num_accelerators == 8


def test_unknown_accelerator_and_mismatched_ray_type() -> None:
    bad_type = _broken(lambda c: _node_labels(c, "127.0.0.2").update(
        {L.ACCELERATOR_TYPE: "H999", L.RAY_ACCELERATOR_TYPE: "H999"}))
    with pytest.raises(UnknownAcceleratorError, match="H999.*Fix:"):
        onprem_spec(bad_type)
    mismatch = _broken(lambda c: _node_labels(c, "127.0.0.2").update({L.RAY_ACCELERATOR_TYPE: "A100"}))
    with pytest.raises(LabelError, match="ray.io/accelerator-type='A100' differs"):
        onprem_spec(mismatch)


def test_role_must_match_the_provider_addresses() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.2").update({L.ROLE: "head"}))
    with pytest.raises(LabelError, match="in provider.worker_ips. Fix: set rayfleet.io/role: worker"):
        onprem_spec(config)


def test_every_address_needs_exactly_one_entry() -> None:
    config = _broken(lambda c: c["provider"]["worker_ips"].append("127.0.0.4"))
    with pytest.raises(SpecError, match=r"without a node entry: \['127.0.0.4'\]"):
        onprem_spec(config)


def test_duplicate_node_names_are_refused() -> None:
    config = _broken(lambda c: _node_labels(c, "127.0.0.3").update({L.NODE: "n0001"}))
    with pytest.raises(LabelError, match="more than once"):
        onprem_spec(config)


def test_node_start_on_malformed_yaml_exits_2_with_the_fix(tmp_path, capsys) -> None:
    path = _write(tmp_path, _broken(lambda c: _node_labels(c, "127.0.0.2").update({L.BLOCK: "-b0"})))
    assert main(["node", "start", "--dry-run", "--config", str(path), "--node-ip-address", "127.0.0.2"]) == 2
    err = capsys.readouterr().err
    assert "'-b0'" in err and "Fix:" in err and "rayfleet node: error" in err


def test_missing_file_is_a_spec_error(tmp_path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_onprem_spec(tmp_path / "nope.yaml")


# -- cloud variants -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CLOUD))
def test_cloud_node_types_declare_full_labels_and_resources(name: str) -> None:
    config = load_yaml(CLOUD[name])
    types = {t.name: t for t in cloud_node_types(config, source=name)}
    assert set(types) == set(config["available_node_types"]) and len(types) >= 2
    for decl in types.values():
        assert set(L.REQUIRED_KEYS) <= set(decl.labels)
        for key, value in decl.labels.items():
            L.validate_label(key, value)
        topology = node_topology_from_labels(decl.labels, where=decl.name)
        accel = get_accelerator(topology.accelerator_type)
        assert topology.num_accelerators == accel.accelerators_per_node
        assert decl.resources[accel.ray_resource] == topology.num_accelerators
        assert {k for k in decl.resources if L.slot_index(k) is not None} == {
            L.slot_resource(i) for i in range(topology.num_accelerators)}
    assert all("rayfleet node start --node-type-labels" in c
               for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert not any("ray stop" in c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"])


def test_kuberay_groups_declare_full_labels_and_resources() -> None:
    manifest = load_yaml(KUBERAY)
    groups = kuberay_node_types(manifest, source="kuberay.yaml")
    assert [g.labels[L.ROLE] for g in groups] == ["head", "worker"]
    for group in groups:
        assert set(L.REQUIRED_KEYS) <= set(group.labels)
        assert group.resources["GPU"] == 8
        assert {k for k in group.resources if L.slot_index(k) is not None} == {L.slot_resource(i) for i in range(8)}


def test_cloud_type_with_a_missing_slot_is_refused() -> None:
    config = load_yaml(CLOUD["aws"])
    del config["available_node_types"]["worker.h100"]["resources"]["rayfleet_slot_7"]
    with pytest.raises(SpecError, match=r"resources.rayfleet_slot_7=None.*Fix: set rayfleet_slot_7: 1"):
        cloud_node_types(config, source="aws.yaml")


def test_cloud_type_with_wrong_gpu_count_is_refused() -> None:
    config = load_yaml(CLOUD["gcp"])
    config["available_node_types"]["worker.h100"]["resources"]["GPU"] = 4
    with pytest.raises(SpecError, match="GPU=4"):
        cloud_node_types(config, source="gcp.yaml")


def test_kuberay_env_labels_must_match_rayStartParams() -> None:
    manifest = load_yaml(KUBERAY)
    group = manifest["spec"]["workerGroupSpecs"][0]
    group["rayStartParams"]["labels"] = group["rayStartParams"]["labels"].replace("rack=k8s", "rack=other")
    with pytest.raises(LabelError, match="RAY_OVERRIDE_LABELS"):
        kuberay_node_types(manifest, source="kuberay.yaml")


def test_xpu_resources_are_declared_by_their_catalogue_name() -> None:
    labels = {L.NODE: "x0", L.ACCELERATOR_TYPE: "P800", L.NUM_ACCELERATORS: "8", L.RACK: "r0",
              L.BLOCK: "b0", L.NVLINK_DOMAIN: "sn0", L.ROLE: "worker"}
    topology = node_topology_from_labels(labels, where="t")
    resource = get_accelerator("P800").ray_resource
    check_declared_resources(topology, {resource: 8, **{L.slot_resource(i): 1 for i in range(8)}}, where="t")
    with pytest.raises(SpecError):
        check_declared_resources(topology, {"GPU": 8, **{L.slot_resource(i): 1 for i in range(8)}}, where="t")


def test_unique_node_labels_per_machine() -> None:
    worker = {L.NODE: "h100", L.NVLINK_DOMAIN: "h100", L.ROLE: "worker", L.RACK: "usw2a"}
    a = unique_node_labels(worker, "ip-10-0-0-12.us-west-2.compute.internal")
    b = unique_node_labels(worker, "ip-10-0-0-13")
    assert a[L.NODE] == "h100-ip-10-0-0-12" == a[L.NVLINK_DOMAIN]
    assert a[L.NODE] != b[L.NODE] and a[L.RACK] == "usw2a"
    L.validate_label(L.NODE, unique_node_labels(worker, "X" * 200 + ".example")[L.NODE])
    head = {L.NODE: "h100-head", L.NVLINK_DOMAIN: "h100-head", L.ROLE: "head"}
    assert unique_node_labels(head, "anything") == head


# -- rayfleet node stop: only what node start recorded ------------------------------------------
def test_explicit_address_is_the_only_candidate(monkeypatch) -> None:
    monkeypatch.setenv("SSH_CONNECTION", "127.0.0.1 51234 127.0.0.3 22")
    assert own_addresses("127.0.0.2") == ["127.0.0.2"]


def test_node_stop_kills_the_recorded_session_and_nothing_else(tmp_path, monkeypatch, capsys) -> None:
    import dataclasses
    import subprocess
    import sys
    import time

    from rayfleet.cli import node as node_cli

    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path))
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    # Like a node: a session leader, a daemon in its group, and a worker that moved to its own
    # process group (as Ray's workers do) but stayed in the session.
    worker = f"{sys.executable} -c 'import os, time; os.setpgid(0, 0); time.sleep(300)'"
    ours = subprocess.Popen(["bash", "-c", f"sleep 300 & {worker} & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # another cluster's process
    try:
        deadline = time.monotonic() + 10
        while len(node_cli._session_members(ours.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(node_cli._session_members(ours.pid)) == 3
        record = node_cli.NodeRecord(cluster="c", node="n0001", address="127.0.0.2", pgid=ours.pid,
                                     temp_dir=None, log_path="/dev/null", started_at=0.0)
        path = tmp_path / "cluster-nodes" / "c" / "n0001.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(dataclasses.asdict(record)))
        assert main(["node", "stop", "--grace-period", "2"]) == 0
        assert "stopped n0001" in capsys.readouterr().out
        ours.wait(timeout=10)
        assert node_cli._session_members(ours.pid) == []
        assert other.poll() is None and not path.exists()
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_node_type_labels_start_a_cloud_worker_with_a_unique_name(capsys, monkeypatch) -> None:
    """What Ray's updater runs on an AWS worker: labels from RAY_OVERRIDE_LABELS, head from RAY_HEAD_IP."""
    worker = load_yaml(CLOUD["aws"])["available_node_types"]["worker.h100"]
    monkeypatch.setenv("RAY_OVERRIDE_LABELS", json.dumps(worker["labels"]))
    monkeypatch.setenv("RAY_HEAD_IP", "10.0.0.5")
    monkeypatch.setattr("socket.gethostname", lambda: "ip-10-0-0-12")
    args = _dry_run(capsys, "--node-type-labels", "--node-ip-address", "10.0.0.12")
    opts = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    labels = L.parse_label_string(opts["--labels"])
    assert labels[L.NODE] == "h100-ip-10-0-0-12" == labels[L.NVLINK_DOMAIN]
    assert {k: v for k, v in labels.items() if k not in (L.NODE, L.NVLINK_DOMAIN)} == {
        k: str(v) for k, v in worker["labels"].items() if k not in (L.NODE, L.NVLINK_DOMAIN)}
    assert opts["--address"] == "10.0.0.5:6379" and opts["--num-gpus"] == "8"
    assert json.loads(opts["--resources"]) == {k: float(v) for k, v in worker["resources"].items() if k != "GPU"}


def test_node_stop_over_ssh_stops_only_the_cluster_at_the_reached_address(tmp_path, monkeypatch, capsys) -> None:
    """`ray down` of cluster a (head 127.0.0.1) must not stop cluster b started on the same host."""
    import dataclasses
    import subprocess

    from rayfleet.cli import node as node_cli

    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path))
    monkeypatch.setenv("SSH_CONNECTION", "127.0.0.1 40000 127.0.0.1 22")
    procs = {}
    try:
        for cluster, node, address in (("a", "n0000", "127.0.0.1"), ("a", "n0001", "127.0.0.2"),
                                       ("b", "m0000", "127.0.0.9")):
            proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
            procs[node] = proc
            path = tmp_path / "cluster-nodes" / cluster / f"{node}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dataclasses.asdict(node_cli.NodeRecord(
                cluster=cluster, node=node, address=address, pgid=proc.pid, temp_dir=None,
                log_path="/dev/null", started_at=0.0))))
        assert main(["node", "stop", "--grace-period", "2"]) == 0
        assert "stopped n0000, n0001" in capsys.readouterr().out
        assert procs["n0000"].wait(timeout=10) is not None and procs["n0001"].wait(timeout=10) is not None
        assert procs["m0000"].poll() is None
        assert (tmp_path / "cluster-nodes" / "b" / "m0000.json").exists()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
