"""``rayfleet node start`` / ``rayfleet node stop``: one machine's side of ``ray up cluster.yaml``.

Design decisions:
- Ray's on-premises provider runs the *same* ``worker_start_ray_commands`` on every worker, but
  every rayfleet node needs its own labels (name, rack, ...). ``node start`` therefore finds
  its own entry in the cluster's node map (``metadata.rayfleet.nodes`` of cluster.yaml, shipped
  to each machine with ``file_mounts``) by the address it was reached at — ``--node-ip-address``,
  else ``$SSH_CONNECTION``'s server address (what Ray's updater SSHed to), else the host's
  addresses — and runs ``ray start`` with :func:`ray_start_args`, exactly as ``rayfleet up``.
  On cloud node types (``--node-type-labels``) the labels come from the node type, which Ray's
  updater passes in ``RAY_OVERRIDE_LABELS``, with the node name made unique per machine.
- ``ray stop`` kills every Ray process on a machine by name. ``node stop`` stops only what
  ``node start`` recorded: each node's ``ray start`` runs in its own session, and the process
  group id is written to ``<rayfleet home>/cluster-nodes/<cluster>/<node>.json``. ``node
  start`` stops a previous instance of the same node first, which is what Ray's default
  ``ray stop; ray start`` pair achieves, without touching other clusters.
- ``node stop`` accepts ``ray stop``'s flags so that it can stand in for it (see
  scripts/rayfleet_ssh_gate.sh, which makes ``ray down`` call it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rayfleet.errors import FleetStateError, LabelError, SpecError
from rayfleet.platform import labels as L

if TYPE_CHECKING:
    from rayfleet.platform.topology import NodeTopology

__all__ = ["register", "NodeRecord", "own_addresses", "unique_node_labels"]

DEFAULT_CONFIG = "~/rayfleet_cluster.yaml"
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodeRecord:
    """A node that ``node start`` started on this machine, and how to stop it."""

    cluster: str
    node: str
    address: str
    pgid: int
    temp_dir: str | None
    log_path: str
    started_at: float


def _records_dir() -> Path:
    from rayfleet.platform.launcher import rayfleet_home

    return rayfleet_home() / "cluster-nodes"


def _record_path(cluster: str, node: str) -> Path:
    return _records_dir() / cluster / f"{node}.json"


def _load_records() -> list[tuple[Path, NodeRecord]]:
    out = []
    for path in sorted(_records_dir().glob("*/*.json")):
        try:
            out.append((path, NodeRecord(**json.loads(path.read_text()))))
        except (OSError, ValueError, TypeError):
            continue  # a half-written or foreign file is not ours to act on
    return out


# -- which node am I? -----------------------------------------------------------------------------
def own_addresses(explicit: str | None = None) -> list[str]:
    """Addresses this machine may be listed under, most specific first.

    An explicit address (``--node-ip-address`` or ``$RAYFLEET_NODE_IP``) is the only candidate:
    on a host with several "machines" (loopback addresses) a fallback would pick the wrong node.
    """
    explicit = explicit or os.environ.get("RAYFLEET_NODE_IP")
    if explicit:
        return [explicit]
    out: list[str | None] = []
    ssh = os.environ.get("SSH_CONNECTION", "").split()
    if len(ssh) == 4:
        out.append(ssh[2])  # the server address the SSH client (Ray's updater) connected to
    try:
        out += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outbound interface
            out.append(s.getsockname()[0])
    except OSError:
        pass
    return [a for a in dict.fromkeys(out) if a]


def unique_node_labels(type_labels: dict[str, str], host: str) -> dict[str, str]:
    """A cloud node type's labels with ``rayfleet.io/node`` made unique for machine ``host``.

    All instances of a node type share its labels; the type's node name is a prefix. A
    per-node scale-up domain (one written equal to the node name) follows the name.
    """
    labels = dict(type_labels)
    if labels.get(L.ROLE) == "head":
        return labels
    suffix = re.sub(r"[^a-z0-9-]", "-", host.split(".")[0].lower()).strip("-") or "node"
    prefix = labels[L.NODE]
    name = f"{prefix}-{suffix}"[:63].rstrip("-_.")
    if labels.get(L.NVLINK_DOMAIN) == prefix:
        labels[L.NVLINK_DOMAIN] = name
    labels[L.NODE] = name
    return labels


@dataclass(frozen=True)
class _StartPlan:
    cluster: str
    topology: "NodeTopology"
    address: str
    head_address: str | None
    temp_dir: str | None
    gcs_address: str
    ray_args: list[str]


def _plan_start(args: argparse.Namespace) -> _StartPlan:
    from rayfleet.platform.cluster_config import DEFAULT_HEAD_PORT, load_onprem_spec, node_topology_from_labels
    from rayfleet.platform.launcher import ray_start_args

    extra = [a for a in args.ray_args if a != "--"]
    if args.node_type_labels:
        raw = os.environ.get("RAY_OVERRIDE_LABELS")
        if not raw:
            raise LabelError("--node-type-labels: RAY_OVERRIDE_LABELS is not set. Fix: declare the labels "
                             "in the node type (available_node_types.<type>.labels) or the container env")
        try:
            type_labels = json.loads(raw)
        except ValueError:
            raise LabelError(f"RAY_OVERRIDE_LABELS={raw!r} is not a JSON object. Fix: set it to the node "
                             "type's labels as JSON, e.g. '{\"rayfleet.io/rack\": \"r00\"}'") from None
        topology = node_topology_from_labels(unique_node_labels(type_labels, socket.gethostname()),
                                             where="RAY_OVERRIDE_LABELS")
        address = own_addresses(args.node_ip_address)[0]
        head_ip = os.environ.get("RAY_HEAD_IP") or os.environ.get("RAY_IP")
        head_address = None if topology.role == "head" else (args.address or f"{head_ip}:{DEFAULT_HEAD_PORT}")
        if topology.role != "head" and not (args.address or head_ip):
            raise SpecError("--address", None, "a worker needs the head's address",
                            "pass --address HEAD:6379 (Ray's updater sets RAY_HEAD_IP)")
        cluster, temp_dir = args.cluster_name or "default", None
        gcs_address = head_address or f"{address}:{DEFAULT_HEAD_PORT}"
        ray_args = ray_start_args(topology, head_address=head_address, node_ip=address, num_cpus=None,
                                  dashboard_host="0.0.0.0", head_port=DEFAULT_HEAD_PORT,
                                  unique_ports=False, block=args.block)
    else:
        spec = load_onprem_spec(args.config)
        node = spec.node_at(own_addresses(args.node_ip_address))
        topology, address, cluster = node.topology, node.address, spec.cluster_name
        is_head = topology.role == "head"
        head_address = None if is_head else spec.head_address
        temp_dir = spec.temp_dir or f"/tmp/rayfleet-{cluster}"
        gcs_address = spec.head_address
        ray_args = ray_start_args(
            topology, head_address=head_address, node_ip=address, num_cpus=spec.num_cpus,
            object_store_bytes=spec.object_store_mib * 1024 * 1024 if spec.object_store_mib else None,
            temp_dir=temp_dir if is_head else None, head_port=spec.head_port,
            dashboard_port=spec.dashboard_port, dashboard_host=spec.dashboard_host,
            system_config=dict(spec.system_config) if spec.system_config else None,
            unique_ports=False, block=args.block,
        )
        # Several "machines" may share one host (loopback addresses): every node gets its own ports.
        ray_args += _unique_port_args(is_head=is_head)
        if not is_head:
            # A private dir per cluster, and per node under it: nodes on one host sharing a temp
            # dir race for the same socket names (raylet.1, ...) when started together.
            ray_args.append(f"--temp-dir={temp_dir}/{topology.name}")
    return _StartPlan(cluster=cluster, topology=topology, address=address, head_address=head_address,
                      temp_dir=temp_dir, gcs_address=gcs_address, ray_args=[*ray_args, *extra])


_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
               "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _unique_port_args(*, is_head: bool) -> list[str]:
    """Free ports for one node, picked at random between Ray's worker-port range and the kernel's
    ephemeral range.

    Why not bind(0) as the local launcher does: a port from the ephemeral range can be taken as
    the *source* port of some outgoing connection between picking it and the raylet binding it;
    with nodes starting in parallel (the autoscaler starts all workers at once) that race was
    seen ("bind: Address already in use"). Ray's worker processes use 10002-19999.
    """
    rng = random.SystemRandom()
    flags = _PORT_FLAGS + (("--ray-client-server-port",) if is_head else ())
    ports: list[int] = []
    while len(ports) < len(flags):
        port = rng.randrange(20000, max(_ephemeral_low(), 20001))
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
    return [f"{flag}={port}" for flag, port in zip(flags, ports)]


# -- start / stop ---------------------------------------------------------------------------------
def _cmd_start(args: argparse.Namespace) -> int:
    from rayfleet.platform.launcher import _ray_executable, ensure_auth_token

    plan = _plan_start(args)
    name = plan.topology.name
    if args.dry_run:
        print(subprocess.list2cmdline([_ray_executable(), *plan.ray_args]))
        return 0
    if plan.head_address is None:
        ensure_auth_token()
    else:
        token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token").expanduser()
        if not os.environ.get("RAY_AUTH_TOKEN") and not token.exists():
            raise FleetStateError(
                f"node {name}: no Ray auth token at {token}, so it cannot join the head. Fix: copy the "
                "head's ~/.ray/auth_token to this machine (cluster.yaml ships it with file_mounts)")
    path = _record_path(plan.cluster, name)
    _stop_records([(p, r) for p, r in _load_records() if p == path], grace_s=5.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    log_path = path.with_suffix(".log")
    # RAY_ADDRESS names this cluster to every process the raylet starts (as LocalFleet does):
    # Ray Train's state API otherwise scans the host and fails while another cluster runs on it.
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_ADDRESS=plan.gcs_address,
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.pop("RAY_OVERRIDE_LABELS", None)  # would override the labels computed here
    print(f"rayfleet node {name} ({plan.address}, cluster {plan.cluster}): "
          f"{L.format_label_string(plan.topology.to_labels())}")
    attempts = 1 if args.block else 2
    for attempt in range(1, attempts + 1):
        command = [_ray_executable(), *plan.ray_args]
        with open(log_path, "ab") as log:
            log.write(f"\n$ {subprocess.list2cmdline(command)}\n".encode())
            log.flush()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        record = NodeRecord(cluster=plan.cluster, node=name, address=plan.address, pgid=proc.pid,
                            temp_dir=plan.temp_dir, log_path=str(log_path), started_at=time.time())
        path.write_text(json.dumps(asdict(record), indent=2))
        if args.block:
            return proc.wait()
        try:
            code = proc.wait(timeout=_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        if code == 0:
            print(f"started node {name}; cluster address {plan.gcs_address}; log {log_path}")
            return 0
        # A failed start can leave daemons behind; stop them before trying again with new ports.
        _stop_records([(path, record)], grace_s=2.0)
        print(f"`ray start` for node {name} failed (exit {code}, attempt {attempt}/{attempts}):\n"
              f"{log_path.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        plan = _plan_start(args)
    raise FleetStateError(f"`ray start` for node {name} failed {attempts} times. Fix: see {log_path}")


def _session_members(sid: int) -> list[int]:
    """Live processes of session ``sid``.

    ``node start`` runs ``ray start`` as a session leader; Ray's daemons stay in that session
    and its worker processes (actors, tasks) only change process group, so the session is the
    node's whole process tree. Job entrypoints that start their own session are the exception;
    they exit with their job or when their node's raylet goes away.
    """
    from rayfleet.platform.launcher import live_pids_where

    return live_pids_where(sid=sid)


def _stop_records(records: list[tuple[Path, NodeRecord]], *, grace_s: float) -> list[str]:
    """TERM every process of each recorded node's session, KILL after ``grace_s``.

    Returns the stopped node names and removes their records.
    """
    def targets() -> list[int]:
        return [pid for _, r in records for pid in _session_members(r.pgid)]

    def send(sig: int) -> None:
        for pid in targets():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and targets():
        time.sleep(0.2)
    send(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and targets():
        time.sleep(0.1)
    for path, _ in records:
        path.unlink(missing_ok=True)
    return [r.node for _, r in records]


def _cmd_stop(args: argparse.Namespace) -> int:
    records = [(p, r) for p, r in _load_records()
               if (args.cluster is None or r.cluster == args.cluster) and (args.node is None or r.node == args.node)]
    ssh = os.environ.get("SSH_CONNECTION", "").split()
    if args.cluster is None and args.node is None and len(ssh) == 4:
        # Reached over SSH (e.g. the `ray stop` of `ray down`, through the gate): stop the
        # clusters that have a node at the address the caller connected to, not every cluster.
        clusters = {r.cluster for _, r in records if r.address == ssh[2]}
        records = [(p, r) for p, r in records if r.cluster in clusters]
    if not records:
        print("rayfleet node stop: no node started by `rayfleet node start` is recorded on this machine")
        return 0
    grace_s = 0.0 if args.force else float(args.grace_period)
    names = _stop_records(records, grace_s=grace_s)
    print(f"rayfleet node stop: stopped {', '.join(names)} (only processes rayfleet started; "
          "other Ray clusters on this machine are untouched)")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for _, r in _load_records():
        members = _session_members(r.pgid)
        rows.append({**asdict(r), "num_processes": len(members), "running": bool(members)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        state = f"running ({row['num_processes']} processes)" if row["running"] else "exited"
        print(f"{row['cluster']}\t{row['node']}\t{row['address']}\tpgid={row['pgid']}\t{state}\t{row['log_path']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rayfleet node {start,stop,list}``."""
    node = subparsers.add_parser("node", help="start/stop this machine's node of a `ray up` cluster")
    sub = node.add_subparsers(dest="node_command", required=True)

    start = sub.add_parser("start", help="run `ray start` with this machine's labels from the node map")
    start.add_argument("--config", default=DEFAULT_CONFIG,
                       help=f"cluster.yaml holding metadata.rayfleet.nodes (default {DEFAULT_CONFIG})")
    start.add_argument("--node-ip-address", default=None,
                       help="this machine's address in the node map (default: $SSH_CONNECTION's server address, "
                            "then the host's addresses)")
    start.add_argument("--node-type-labels", action="store_true",
                       help="cloud node types: take the labels from $RAY_OVERRIDE_LABELS instead of a node map")
    start.add_argument("--address", default=None, help="with --node-type-labels: the head's host:port")
    start.add_argument("--cluster-name", default=None, help="with --node-type-labels: the cluster's name")
    start.add_argument("--block", action="store_true", help="stay in the foreground (containers)")
    start.add_argument("--dry-run", action="store_true", help="print the `ray start` command only")
    start.add_argument("ray_args", nargs=argparse.REMAINDER,
                       help="after `--`: more `ray start` arguments (e.g. --autoscaling-config=...)")
    start.set_defaults(func=_cmd_start)

    stop = sub.add_parser("stop", help="stop the nodes `rayfleet node start` started on this machine")
    stop.add_argument("--cluster", default=None, help="only this cluster's nodes")
    stop.add_argument("--node", default=None, help="only this node (by name)")
    # `ray stop`'s flags, so that this can stand in for it.
    stop.add_argument("-f", "--force", action="store_true", help="SIGKILL at once")
    stop.add_argument("-g", "--grace-period", type=float, default=5.0,
                      help="seconds before SIGKILL (Ray's GCS and monitor ignore SIGTERM for longer)")
    stop.add_argument("-v", "--verbose", action="store_true", help=argparse.SUPPRESS)
    stop.set_defaults(func=_cmd_stop)

    listing = sub.add_parser("list", help="nodes started on this machine by `rayfleet node start`")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_cmd_list)
