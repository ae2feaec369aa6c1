"""The local fleet launcher: a real multi-node Ray cluster on one machine, one raylet per server.

Design decisions:
- Each fleet node is a ``ray start`` process tree started in its own session (process group),
  with its topology labels, its accelerators as Ray resources and one ``rayfleet_slot_<i>``
  resource per accelerator. This is exactly what ``cluster.yaml`` runs on real machines, so the
  local fleet exercises the production start path; ``ray.cluster_utils.Cluster`` would not.
- ``ray stop`` kills every Ray process on the machine, so stopping goes by the process groups
  this launcher recorded in ``<home>/fleet.json`` — never by name. Killing one group with SIGKILL
  is also how tests inject a hard node failure.
- Token authentication stays on: the launcher makes sure ``~/.ray/auth_token`` exists and every
  client it configures sets ``RAY_AUTH_MODE=token``.
- Ports are picked free per node (several raylets share one IP here).
- Closed to the network by binding: every node's address stays 127.0.0.1, so each Ray server
  listens on loopback only (``ray_start_command``); docs/security.md lists what that covers.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rayfleet.errors import FleetNotFoundError, FleetStateError, SpecError
from rayfleet.platform import labels as L
from rayfleet.platform import ray_compat
from rayfleet.platform.snapshot_node import remove_session_snapshots
from rayfleet.platform.topology import FleetTopology, NodeTopology

__all__ = [
    "LaunchedNode", "LocalFleet", "ray_start_args", "rayfleet_home", "ensure_auth_token",
    "FAST_FAILURE_DETECTION", "ray_start_command",
]

# Node death is noticed in ~2.5-3 s instead of ~15 s (measured; docs/architecture.md). A dead
# node's raylet refuses the check's connection at once, so the period and the threshold set that
# time; the timeout only matters for a raylet that is alive but slow to answer. CI once saw a raylet
# busy starting a job's worker processes on 2 loaded cores miss three 1 s checks and be declared
# dead (and then exit): with 5 s per check a live raylet must stay silent ~18 s to be lost, while a
# killed one is still noticed in 2.5-2.9 s (measured with both timeouts).
FAST_FAILURE_DETECTION = {
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 5000,
}


# A local fleet's nodes share this machine's cores: a training worker takes one intra-op thread, not
# the machine's count (2 workers on 2 nodes of 2 cores ran 4, spinning at each other's barriers),
# unless the caller's environment or the job's runtime env says (jobs.worker_entry.THREADS_ENV).
SHARED_HOST_THREADS_ENV = "RAYFLEET_CPU_THREADS_PER_WORKER"


def rayfleet_home() -> Path:
    """Where rayfleet keeps local state (fleet record, controller database, logs)."""
    return Path(os.environ.get("RAYFLEET_HOME", Path.home() / ".rayfleet"))


def ensure_auth_token() -> Path:
    """Create Ray's auth token if missing, and switch this process's clients to token mode."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or ray_compat.default_auth_token_path())
    if not os.environ.get("RAY_AUTH_TOKEN") and not path.exists():
        ray_compat.generate_auth_token(path)  # atomic: another process may be creating it too
    ray_compat.enable_token_auth()
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_start_args(
    node: NodeTopology,
    *,
    head_address: str | None,
    node_ip: str = "127.0.0.1",
    num_cpus: float | None = 2,
    object_store_bytes: int | None = None,
    temp_dir: str | None = None,
    head_port: int | None = None,
    dashboard_port: int | None = None,
    unique_ports: bool = True,
    system_config: dict | None = None,
    block: bool = False,
    dashboard_host: str = "127.0.0.1",
) -> list[str]:
    """The ``ray start`` arguments that bring ``node`` up with its labels and accelerators.

    ``head_address`` is None for the head node. ``unique_ports`` picks free ports for the agent
    and metrics endpoints so that several nodes can share one machine. ``num_cpus=None`` lets
    Ray detect the machine's CPUs; ``dashboard_host="0.0.0.0"`` lets other machines submit jobs
    (the head of a ``ray up`` cluster).
    """
    args = ["start", "--disable-usage-stats", f"--node-ip-address={node_ip}"]
    if num_cpus is not None:
        args.append(f"--num-cpus={num_cpus:g}")
    if block:
        args.append("--block")
    if head_address is None:
        args += ["--head", f"--port={head_port or 6379}", "--include-dashboard=true",
                 f"--dashboard-host={dashboard_host}"]
        if dashboard_port:
            args.append(f"--dashboard-port={dashboard_port}")
        if unique_ports:
            args.append(f"--ray-client-server-port={_free_port()}")
        args += [f"--temp-dir={temp_dir}"] if temp_dir else []
        args += [f"--system-config={json.dumps(system_config)}"] if system_config else []
    else:
        args.append(f"--address={head_address}")
    args.append(f"--num-gpus={node.num_accelerators if node.accelerator.ray_resource == 'GPU' else 0}")
    args.append(f"--resources={json.dumps(node.to_resources(), sort_keys=True)}")
    args.append(f"--labels={L.format_label_string(node.to_labels())}")
    if object_store_bytes:
        args.append(f"--object-store-memory={int(object_store_bytes)}")
    if unique_ports:
        args += [f"--{port}-port={_free_port()}" for port in ("node-manager", "object-manager", "dashboard-agent-listen",
                                                              "dashboard-agent-grpc", "metrics-export", "runtime-env-agent")]
    return args


def ray_start_command(node_ip: str) -> list[str]:
    """The program to run ``ray start`` with for a node at ``node_ip``: Ray's CLI, or for a
    loopback address rayfleet's wrapper of it, which keeps the address (``loopback_ray_start``;
    plain ``ray start`` swaps it for the machine's and its servers then listen everywhere)."""
    try:
        loopback = node_ip == "localhost" or ipaddress.ip_address(node_ip).is_loopback
    except ValueError:  # a host name
        loopback = False
    return [sys.executable, "-m", "rayfleet.platform.loopback_ray_start"] if loopback else [_ray_executable()]


@dataclass(frozen=True)
class LaunchedNode:
    """A node this launcher started: its name and the process group to stop."""

    name: str
    pgid: int
    log_path: str


@dataclass
class LocalFleet:
    """A running local fleet and the processes that belong to it."""

    address: str
    dashboard_url: str
    home: str
    temp_dir: str
    topology_nodes: list[dict]
    nodes: list[LaunchedNode] = field(default_factory=list)
    num_cpus_per_node: float = 2
    object_store_bytes: int | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        topology: FleetTopology,
        *,
        home: str | Path | None = None,
        num_cpus_per_node: float = 2,
        object_store_mib: int = 384,
        timeout_s: float = 120.0,
        system_config: dict | None = None,
    ) -> "LocalFleet":
        """Start every node of ``topology`` (the ``head``-role node first) and wait until all joined."""
        home_path = Path(home) if home else rayfleet_home()
        existing = cls.load(home_path, missing_ok=True)
        if existing is not None and existing.is_running():
            raise FleetStateError(
                f"a local fleet is already running at {existing.address} (record {home_path / 'fleet.json'}). "
                "Fix: stop it with `rayfleet down`, or use another RAYFLEET_HOME"
            )
        if num_cpus_per_node < 0:
            raise SpecError("num_cpus_per_node", num_cpus_per_node, "cannot be negative", "use 0 or more")
        heads = [n for n in topology.nodes if n.role == "head"] or [topology.nodes[0]]
        head = heads[0]
        ensure_auth_token()
        home_path.mkdir(parents=True, exist_ok=True)
        # Ray's unix socket paths must stay under ~107 bytes: keep the temp dir short.
        temp_dir = f"/tmp/rayfleet-{os.getuid()}-{abs(hash(str(home_path.resolve()))) % 10**6}"
        port = _free_port()
        fleet = cls(
            address=f"127.0.0.1:{port}", dashboard_url="", home=str(home_path), temp_dir=temp_dir,
            topology_nodes=[asdict(n) | {"ray_node_id": None} for n in topology.nodes],
            num_cpus_per_node=num_cpus_per_node, object_store_bytes=object_store_mib * 1024 * 1024,
        )
        try:
            fleet._start_head(head, port, timeout_s, system_config={**FAST_FAILURE_DETECTION, **(system_config or {})})
            # One at a time: raylets starting together raced for ports ("bind: Address already
            # in use") on this machine.
            for node in topology.nodes:
                if node.name != head.name:
                    fleet._start_worker(node, timeout_s)
        except BaseException:
            fleet.down()
            raise
        fleet.save()
        return fleet

    def _spawn(self, node: NodeTopology, *, head_address: str | None, **kwargs) -> LaunchedNode:
        log_dir = Path(self.home) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{node.name}.log"
        args = ray_start_args(
            node, head_address=head_address, num_cpus=self.num_cpus_per_node,
            object_store_bytes=self.object_store_bytes, temp_dir=self.temp_dir, **kwargs,
        )
        # Job entrypoints (`ray job submit -- python -m rayfleet ...`) resolve `python` on the
        # raylet's PATH: put this interpreter's bin first so they run in rayfleet's environment.
        bin_dir = str(Path(sys.executable).parent)
        # RAYFLEET_HOME travels too, so the controller's database lives with this fleet.
        # RAY_ADDRESS names this fleet to every process its raylets start: Ray's own clients that
        # look a cluster up themselves (Ray Train's state actor and controller call the state API
        # without an address) otherwise scan the host for GCS processes and fail with "Found
        # multiple active Ray instances" while another fleet runs on the same machine.
        env = dict(os.environ, RAY_AUTH_MODE="token", RAYFLEET_HOME=str(Path(self.home).resolve()),
                   PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]), RAY_ADDRESS=self.address,
                   **ray_compat.LOOPBACK_FLEET_ENV,  # its processes keep 127.0.0.1 (ray_start_command)
                   **ray_compat.shared_host_ray_env())  # its raylets share this host
        env.setdefault(SHARED_HOST_THREADS_ENV, "1")  # ... and its cores (see SHARED_HOST_THREADS_ENV)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*ray_start_command("127.0.0.1"), *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        launched = LaunchedNode(name=node.name, pgid=proc.pid, log_path=str(log_path))
        self.nodes.append(launched)
        self._procs = getattr(self, "_procs", {})
        self._procs[node.name] = proc
        return launched

    def _start_head(self, head: NodeTopology, port: int, timeout_s: float, *, system_config: dict,
                    attempts: int = 3) -> LaunchedNode:
        """Start the head node; a failed start is retried on fresh ports, as a worker's is.

        On a loaded machine the head's own ``ray start`` was seen to fail with "GCS cannot find the
        node" (Ray waits a fixed 30 s for its raylet to register), which failed a whole test session.
        """
        for attempt in range(attempts):
            dashboard_port = _free_port()
            self.address, self.dashboard_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}"
            launched = self._spawn(head, head_address=None, head_port=port, dashboard_port=dashboard_port,
                                   system_config=system_config)
            try:
                self._wait_for_start(launched, timeout_s)
                return launched
            except FleetStateError:
                _signal_group(launched.pgid, signal.SIGKILL)
                self.nodes.remove(launched)
                if attempt == attempts - 1:
                    raise
                port = _free_port()
        raise AssertionError("unreachable")

    def _start_worker(self, node: NodeTopology, timeout_s: float, *, attempts: int = 3) -> LaunchedNode:
        for attempt in range(attempts):
            launched = self._spawn(node, head_address=self.address)
            try:
                self._wait_for_start(launched, timeout_s)
                return launched
            except FleetStateError:
                _signal_group(launched.pgid, signal.SIGKILL)
                self.nodes.remove(launched)
                if attempt == attempts - 1:
                    raise
                # Ray waits a fixed 30 s for a raylet to register; on a starved machine the GCS
                # needs a breather before the next try, not a second raylet at once.
                time.sleep(10.0 * (attempt + 1))
        raise AssertionError("unreachable")

    def _wait_for_start(self, launched: LaunchedNode, timeout_s: float) -> None:
        """Wait for the node's ``ray start`` to return; raise with its log on failure."""
        proc = self._procs[launched.name]
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise FleetStateError(f"node {launched.name} did not start within {timeout_s:.0f}s. "
                                  f"Fix: see its log {launched.log_path}") from None
        if code != 0:
            tail = Path(launched.log_path).read_text(errors="replace")[-2000:]
            raise FleetStateError(f"`ray start` for node {launched.name} exited with {code}:\n{tail}\n"
                                  f"Fix: see the full log {launched.log_path}")

    def down(self, *, grace_s: float = 5.0, head_grace_s: float = 1.0) -> None:
        """Stop this fleet's processes: workers (TERM, KILL after ``grace_s``; ~0.1 s with the GCS up),
        then the head (KILL after ``head_grace_s``: its GCS may ignore TERM for minutes)."""
        head = self.nodes[:1]  # started first; add_node re-adds workers only, at the end
        for group, grace in ((self.nodes[1:], grace_s), (head, head_grace_s)):
            for launched in reversed(group):
                _signal_group(launched.pgid, signal.SIGTERM)
            _wait_gone(group, grace)
            for launched in group:
                _signal_group(launched.pgid, signal.SIGKILL)
            _wait_gone(group, 5.0)  # a SIGKILL is sent, not done: on a loaded host dying takes a moment
        # Snapshots of jobs that died with the fleet: tmpfs, i.e. memory, until someone frees it.
        sessions = [p.name for p in Path(self.temp_dir).glob("session_*") if p.name != "session_latest"]
        remove_session_snapshots(sessions)
        record = Path(self.home) / "fleet.json"
        if record.exists():
            record.unlink()

    def kill_node(self, name: str) -> None:
        """Hard-kill one node (SIGKILL to its process group): a simulated machine failure."""
        launched = self._launched(name)
        _signal_group(launched.pgid, signal.SIGKILL)

    def add_node(self, node: NodeTopology, *, timeout_s: float = 120.0) -> LaunchedNode:
        """Start one more node (or restart a killed one under the same name) and join it."""
        self.nodes = [n for n in self.nodes if n.name != node.name]
        launched = self._start_worker(node, timeout_s)
        if all(t["name"] != node.name for t in self.topology_nodes):
            self.topology_nodes.append(asdict(node) | {"ray_node_id": None})
        self.save()
        return launched

    def _launched(self, name: str) -> LaunchedNode:
        for launched in self.nodes:
            if launched.name == name:
                return launched
        raise SpecError("node", name, "this fleet did not start such a node",
                        f"use one of {[n.name for n in self.nodes]}")

    # -- record ---------------------------------------------------------------------------
    @property
    def topology(self) -> FleetTopology:
        return FleetTopology(tuple(NodeTopology(**n) for n in self.topology_nodes))

    def is_running(self) -> bool:
        return bool(self.nodes) and _group_alive(self.nodes[0].pgid)

    def save(self) -> None:
        path = Path(self.home) / "fleet.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, home: str | Path | None = None, *, missing_ok: bool = False) -> "LocalFleet | None":
        path = Path(home or rayfleet_home()) / "fleet.json"
        if not path.exists():
            if missing_ok:
                return None
            raise FleetNotFoundError(f"no local fleet record at {path}. Fix: start one with `rayfleet up`")
        data = json.loads(path.read_text())
        data["nodes"] = [LaunchedNode(**n) for n in data["nodes"]]
        return cls(**data)


def _ray_executable() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def live_pids_where(*, pgid: int | None = None, sid: int | None = None) -> list[int]:
    """Live (non-zombie) processes of a process group or a session, read from ``/proc``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # After the ")" closing the command name: state, ppid, pgrp, session, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        if (pgid is not None and int(fields[2]) == pgid) or (sid is not None and int(fields[3]) == sid):
            pids.append(int(entry.name))
    return pids


def _wait_gone(group: list[LaunchedNode], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_group_alive(n.pgid) for n in group):
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # A group of zombies still "exists"; look for one live member.
    return bool(live_pids_where(pgid=pgid))
