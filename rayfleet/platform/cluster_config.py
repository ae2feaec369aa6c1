"""Load and check Ray cluster YAMLs (`ray up` configs and KubeRay manifests) against rayfleet's labels.

Design decisions:
- The on-premises form (Ray's ``local`` provider) cannot give nodes their own labels: Ray
  forbids ``available_node_types`` there and every worker runs the same
  ``worker_start_ray_commands``. So cluster.yaml carries a *node map* under
  ``metadata.rayfleet.nodes`` (``metadata`` is the one top-level key Ray's schema leaves to
  users), keyed by each machine's address, whose values are the node's labels written exactly
  as Ray will carry them. ``rayfleet node start`` looks its own address up in that map.
- Cloud forms (AWS, GCP, KubeRay) declare labels and resources per node type. All instances of
  a type share them, so the type's ``rayfleet.io/node`` is a name *prefix* that
  ``rayfleet node start --node-type-labels`` makes unique per machine (see rayfleet.cli.node).
- Labels are checked with the same rules as everywhere else (:mod:`rayfleet.platform.labels`,
  :meth:`NodeTopology.from_labels`), and the declared resources must be exactly what
  :meth:`NodeTopology.to_resources` and the catalogue say, so a config cannot drift from what
  ``rayfleet up`` gives a node. Every error names the file, the place in it, the value and the fix.
- Pure: YAML in, frozen dataclasses out; no Ray import.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from rayfleet.errors import LabelError, RayfleetError, SpecError
from rayfleet.platform import labels as L
from rayfleet.platform.topology import FleetTopology, NodeTopology

__all__ = [
    "ClusterNode", "OnPremClusterSpec", "NodeTypeDeclaration", "load_yaml", "onprem_spec",
    "load_onprem_spec", "node_topology_from_labels", "check_declared_resources",
    "cloud_node_types", "kuberay_node_types", "DEFAULT_HEAD_PORT", "DEFAULT_DASHBOARD_PORT",
]

DEFAULT_HEAD_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265


@dataclass(frozen=True)
class ClusterNode:
    """One machine of an on-premises cluster: the address it is reached at and its topology."""

    address: str
    topology: NodeTopology


@dataclass(frozen=True)
class OnPremClusterSpec:
    """The rayfleet part of an on-premises cluster.yaml (``metadata.rayfleet`` + provider IPs)."""

    cluster_name: str
    nodes: tuple[ClusterNode, ...]
    head_port: int = DEFAULT_HEAD_PORT
    dashboard_host: str = "0.0.0.0"
    dashboard_port: int = DEFAULT_DASHBOARD_PORT
    num_cpus: float | None = None
    object_store_mib: int | None = None
    temp_dir: str | None = None
    system_config: Mapping[str, Any] | None = None

    @property
    def head(self) -> ClusterNode:
        return next(n for n in self.nodes if n.topology.role == "head")

    @property
    def head_address(self) -> str:
        """``host:port`` of the head's GCS (what ``ray start --address`` and ``ray.init`` take)."""
        return f"{self.head.address}:{self.head_port}"

    @property
    def dashboard_url(self) -> str:
        """Where ``ray job submit --address`` goes."""
        return f"http://{self.head.address}:{self.dashboard_port}"

    @property
    def topology(self) -> FleetTopology:
        return FleetTopology(tuple(n.topology for n in self.nodes))

    def node_at(self, addresses: Iterable[str]) -> ClusterNode:
        """The node whose address is the first of ``addresses`` found in the map."""
        candidates = list(dict.fromkeys(a for a in addresses if a))
        by_address = {n.address: n for n in self.nodes}
        for address in candidates:
            if address in by_address:
                return by_address[address]
        raise SpecError(
            "node address", candidates, f"none is in cluster {self.cluster_name!r}'s node map "
            f"(addresses {sorted(by_address)})",
            "pass --node-ip-address with this machine's address in provider.head_ip/worker_ips, or "
            "add the machine to metadata.rayfleet.nodes",
        )


@dataclass(frozen=True)
class NodeTypeDeclaration:
    """What a cloud config declares for one node type: its labels and resources."""

    name: str
    labels: Mapping[str, str]
    resources: Mapping[str, float]


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; raise :class:`SpecError` for a missing file or bad YAML."""
    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError("cluster config", str(path), "no such file",
                        "pass the path of your cluster.yaml") from None
    except yaml.YAMLError as exc:
        raise SpecError("cluster config", str(path), f"is not valid YAML ({exc})", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise SpecError("cluster config", str(path), "is not a YAML mapping", "use a Ray cluster config")
    return data


def _label_value(value: Any, *, key: str, where: str) -> str:
    # YAML turns `8` into an int; that is what people write for a count, so accept integers.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LabelError(
            f"{where}: value {value!r} of label {key!r} is not a string. Fix: quote it, e.g. "
            f"{key}: \"{value}\""
        )
    return str(value)


def node_topology_from_labels(labels: Mapping[str, Any], *, where: str) -> NodeTopology:
    """Check a node's full rayfleet label set and build its topology.

    Raises:
        LabelError: a key or value is malformed, a required key is missing, or
            ``ray.io/accelerator-type`` disagrees with ``rayfleet.io/accelerator-type``.
        UnknownAcceleratorError / SpecError: the accelerator type or a count is unknown/invalid.
    """
    if not isinstance(labels, Mapping):
        raise LabelError(f"{where}: labels must be a mapping of label key to value, got {labels!r}. "
                         f"Fix: write e.g. '{L.RACK}: r00' lines")
    clean = {str(k): _label_value(v, key=str(k), where=where) for k, v in labels.items()}
    for key, value in clean.items():
        L.validate_label(key, value, where=where)
    missing = [k for k in L.REQUIRED_KEYS if k not in clean]
    if missing:
        raise LabelError(f"{where}: missing label(s) {missing}. Fix: every node declares the full "
                         f"rayfleet label set {list(L.REQUIRED_KEYS)}")
    ray_type = clean.get(L.RAY_ACCELERATOR_TYPE)
    if ray_type is not None and ray_type != clean[L.ACCELERATOR_TYPE]:
        raise LabelError(f"{where}: {L.RAY_ACCELERATOR_TYPE}={ray_type!r} differs from "
                         f"{L.ACCELERATOR_TYPE}={clean[L.ACCELERATOR_TYPE]!r}. Fix: set both to the "
                         "same catalogue type")
    try:
        return NodeTopology.from_labels(clean)
    except SpecError:
        raise
    except RayfleetError as exc:  # LabelError, UnknownAcceleratorError: say where in the file
        raise type(exc)(f"{where}: {exc}") from None


def check_declared_resources(topology: NodeTopology, resources: Mapping[str, Any], *, where: str) -> None:
    """Raise :class:`SpecError` unless ``resources`` declares the node's accelerators and slots.

    GPUs are ``GPU: n``; other kinds their catalogue resource (``XPU``, ``NPU``); and one
    ``rayfleet_slot_<i>: 1`` per accelerator, nothing more.
    """
    declared = dict(resources)
    accel = topology.accelerator
    expected = dict(topology.to_resources())
    if accel.ray_resource == "GPU":
        expected["GPU"] = float(topology.num_accelerators)
    for name, amount in expected.items():
        if name not in declared or float(declared[name]) != amount:
            raise SpecError(f"{where}.resources.{name}", declared.get(name),
                            f"a {topology.num_accelerators}x{accel.name} node declares {name}: {amount:g}",
                            f"set {name}: {amount:g} (see `rayfleet up`'s nodes)")
    extra_slots = sorted(k for k in declared if L.slot_index(k) is not None and k not in expected)
    if extra_slots:
        raise SpecError(f"{where}.resources", extra_slots, f"slots beyond the node's {topology.num_accelerators} "
                        "accelerators", "declare rayfleet_slot_0 .. rayfleet_slot_<n-1> only")


# -- on-premises (Ray `local` provider) ---------------------------------------------------------
def _where(source: str, path: str) -> str:
    return f"{source}: {path}"


def onprem_spec(config: Mapping[str, Any], *, source: str = "cluster.yaml") -> OnPremClusterSpec:
    """Parse and check the node map of an on-premises cluster config.

    Checks: the provider is ``local`` with ``head_ip``/``worker_ips``; every address has exactly
    one node-map entry and vice versa; every entry's labels are valid and complete; the head IP's
    node has role ``head`` and no other node does; node names are unique.
    """
    provider = config.get("provider") or {}
    if provider.get("type") != "local":
        raise SpecError(_where(source, "provider.type"), provider.get("type"), "the node map needs the "
                        "on-premises form", "use provider.type: local (cloud forms live in examples/clusters)")
    head_ip = provider.get("head_ip")
    worker_ips = list(provider.get("worker_ips") or [])
    if not head_ip:
        raise SpecError(_where(source, "provider.head_ip"), head_ip, "missing", "set the head machine's address")
    section = ((config.get("metadata") or {}).get("rayfleet")) or {}
    raw_nodes = section.get("nodes")
    if not isinstance(raw_nodes, Mapping) or not raw_nodes:
        raise SpecError(_where(source, "metadata.rayfleet.nodes"), raw_nodes, "no node map",
                        "add one entry per machine address with its labels (see docs/cluster-yaml.md)")
    addresses = [str(head_ip), *map(str, worker_ips)]
    for address in addresses + [str(a) for a in raw_nodes]:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise SpecError(_where(source, "address"), address, "is not an IP address",
                            "use the machine's IP, as in provider.head_ip/worker_ips") from None
    unmapped = [a for a in addresses if a not in {str(k) for k in raw_nodes}]
    unknown = [str(a) for a in raw_nodes if str(a) not in addresses]
    if unmapped or unknown:
        raise SpecError(_where(source, "metadata.rayfleet.nodes"), sorted(raw_nodes),
                        f"addresses without a node entry: {unmapped}; entries for no provider address: {unknown}",
                        "give every provider.head_ip/worker_ips address exactly one entry")
    nodes = []
    for address, entry in raw_nodes.items():
        path = f"metadata.rayfleet.nodes[{str(address)!r}]"
        labels = entry.get("labels") if isinstance(entry, Mapping) else None
        topology = node_topology_from_labels(labels, where=_where(source, f"{path}.labels"))
        want_role = "head" if str(address) == str(head_ip) else "worker"
        if topology.role != want_role:
            raise LabelError(f"{_where(source, path)}: {L.ROLE}={topology.role!r} but {address} is "
                             f"{'provider.head_ip' if want_role == 'head' else 'in provider.worker_ips'}. "
                             f"Fix: set {L.ROLE}: {want_role}")
        nodes.append(ClusterNode(address=str(address), topology=topology))
    FleetTopology(tuple(n.topology for n in nodes))  # unique names
    return OnPremClusterSpec(
        cluster_name=str(config.get("cluster_name", "default")),
        nodes=tuple(nodes),
        head_port=int(section.get("head_port", DEFAULT_HEAD_PORT)),
        dashboard_host=str(section.get("dashboard_host", "0.0.0.0")),
        dashboard_port=int(section.get("dashboard_port", DEFAULT_DASHBOARD_PORT)),
        num_cpus=None if section.get("num_cpus") is None else float(section["num_cpus"]),
        object_store_mib=None if section.get("object_store_mib") is None else int(section["object_store_mib"]),
        temp_dir=section.get("temp_dir"),
        system_config=section.get("system_config"),
    )


def load_onprem_spec(path: str | Path) -> OnPremClusterSpec:
    return onprem_spec(load_yaml(path), source=str(path))


# -- cloud forms --------------------------------------------------------------------------------
def cloud_node_types(config: Mapping[str, Any], *, source: str) -> tuple[NodeTypeDeclaration, ...]:
    """Check every ``available_node_types`` entry of an AWS/GCP ``ray up`` config."""
    types = config.get("available_node_types") or {}
    if not types:
        raise SpecError(_where(source, "available_node_types"), None, "no node types",
                        "declare the head and worker node types")
    head_type = config.get("head_node_type")
    if head_type not in types:
        raise SpecError(_where(source, "head_node_type"), head_type, "not a declared node type",
                        f"use one of {sorted(types)}")
    out = []
    for name, node_type in types.items():
        where = _where(source, f"available_node_types.{name}")
        topology = node_topology_from_labels(node_type.get("labels"), where=f"{where}.labels")
        want_role = "head" if name == head_type else "worker"
        if topology.role != want_role:
            raise LabelError(f"{where}: {L.ROLE}={topology.role!r}. Fix: set {L.ROLE}: {want_role}")
        resources = node_type.get("resources") or {}
        check_declared_resources(topology, resources, where=where)
        out.append(NodeTypeDeclaration(name=name, labels=topology.to_labels(), resources=dict(resources)))
    return tuple(out)


def kuberay_node_types(manifest: Mapping[str, Any], *, source: str) -> tuple[NodeTypeDeclaration, ...]:
    """Check the head group and worker groups of a KubeRay ``RayCluster`` manifest.

    Labels come from ``rayStartParams.labels`` (the ``ray start --labels`` string), resources from
    ``rayStartParams.num-gpus`` and ``rayStartParams.resources`` (a JSON object), which is what
    KubeRay's autoscaler reads. The containers must also hand the same labels to
    ``rayfleet node start`` in ``RAY_OVERRIDE_LABELS``.
    """
    if manifest.get("kind") != "RayCluster":
        raise SpecError(_where(source, "kind"), manifest.get("kind"), "not a KubeRay manifest", "use kind: RayCluster")
    spec = manifest.get("spec") or {}
    groups = [("head", spec.get("headGroupSpec") or {}, "head")]
    groups += [(g.get("groupName", f"worker{i}"), g, "worker") for i, g in enumerate(spec.get("workerGroupSpecs") or [])]
    out = []
    for name, group, want_role in groups:
        where = _where(source, f"{'headGroupSpec' if want_role == 'head' else 'workerGroupSpecs.' + name}")
        params = group.get("rayStartParams") or {}
        labels = L.parse_label_string(str(params.get("labels", "")), where=f"{where}.rayStartParams.labels")
        topology = node_topology_from_labels(labels, where=f"{where}.rayStartParams.labels")
        if topology.role != want_role:
            raise LabelError(f"{where}: {L.ROLE}={topology.role!r}. Fix: set {L.ROLE}={want_role}")
        resources = json.loads(str(params.get("resources", "{}")).strip("'\"").replace('\\"', '"') or "{}")
        if "num-gpus" in params:
            resources["GPU"] = float(params["num-gpus"])
        check_declared_resources(topology, resources, where=where)
        containers = (((group.get("template") or {}).get("spec") or {}).get("containers")) or []
        env = {e.get("name"): e.get("value") for c in containers for e in c.get("env") or []}
        env_labels = json.loads(env.get("RAY_OVERRIDE_LABELS") or "{}")
        if env_labels != labels:
            raise LabelError(f"{where}: the container's RAY_OVERRIDE_LABELS {env_labels} differs from "
                             f"rayStartParams.labels {labels}. Fix: keep them identical")
        out.append(NodeTypeDeclaration(name=name, labels=labels, resources=resources))
    return tuple(out)
