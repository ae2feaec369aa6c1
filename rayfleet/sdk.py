"""The notebook SDK: ``fleet = rayfleet.connect(); fleet.topology(); fleet.status()``.

``connect`` resolves where the fleet is (an explicit address, the job's own cluster inside
``ray job submit``, the local fleet recorded by ``rayfleet up``, or a new local fleet for
``address="local"``), connects Ray with token authentication on, and makes sure the fleet
controller runs. Later capabilities (``fleet.train``, ``fleet.serve``) hang off ``Fleet``.
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
from pathlib import Path

import ray

from rayfleet.errors import FleetNotFoundError
from rayfleet.platform.controller import ensure_controller
from rayfleet.platform.inventory import FleetStatus, NodeStatus
from rayfleet.platform.launcher import LocalFleet, ensure_auth_token, rayfleet_home
from rayfleet.platform.status_table import render_status
from rayfleet.platform.topology import FleetTopology, build_topology

__all__ = ["Fleet", "connect"]


class Fleet:
    """A connection to a rayfleet fleet."""

    def __init__(self, address: str, *, local_fleet: LocalFleet | None = None) -> None:
        self.address = address
        self.local_fleet = local_fleet
        self.controller = ensure_controller()

    # -- views ----------------------------------------------------------------------------
    def topology(self) -> FleetTopology:
        """The fleet's topology, rebuilt from the live nodes' labels."""
        return FleetTopology.from_ray_nodes(ray.nodes())

    def status(self) -> FleetStatus:
        """Per-node accelerators (free / training / inference / cordoned), health and recent events."""
        return ray.get(self.controller.status.remote())

    def nodes(self) -> list[NodeStatus]:
        return list(self.status().nodes)

    def events(self, limit: int = 50, node: str | None = None) -> list:
        return ray.get(self.controller.events.remote(limit, node))

    def print_status(self) -> None:
        print(render_status(self.status()))

    # -- operations -----------------------------------------------------------------------
    def cordon(self, node: str, reason: str = "cordoned by operator") -> int:
        return ray.get(self.controller.cordon.remote(node, reason))

    def uncordon(self, node: str) -> None:
        ray.get(self.controller.uncordon.remote(node))

    def self_check(self, node: str, *, inject_fault: str | None = None) -> dict:
        return ray.get(self.controller.run_self_check.remote(node, inject_fault))

    # -- training -------------------------------------------------------------------------
    @property
    def dashboard_url(self) -> str:
        """The job API / dashboard address of the connected cluster (``http://host:port``)."""
        from ray._private.worker import get_dashboard_url

        url = get_dashboard_url()
        return url if "://" in url else f"http://{url}"

    def train(self, spec, *, max_failures: int | None = None, storage_path: str | None = None):
        """Submit a training job; returns a :class:`rayfleet.jobs.handle.TrainingRun`.

        ``spec``: a ``TrainJobSpec``, a mapping of its fields, or a job YAML path. The spec and
        its dataset are checked here, before anything is submitted.
        """
        from rayfleet.jobs.handle import submit_training
        from rayfleet.jobs.planning import check_dataset, validate_job
        from rayfleet.jobs.spec import TrainJobSpec

        if isinstance(spec, (str, Path)):
            spec = TrainJobSpec.from_yaml(spec)
        elif not isinstance(spec, TrainJobSpec):
            spec = TrainJobSpec.model_validate(dict(spec))
        if spec.resources.num_workers is not None or (spec.plan is not None and spec.plan.dp is not None):
            validate_job(spec)  # dataset, plan and memory, before anything is submitted
        else:
            check_dataset(spec)  # the plan needs the live fleet's size: the job driver checks it
        return submit_training(spec, dashboard_url=self.dashboard_url, max_failures=max_failures,
                               storage_path=storage_path)

    # -- serving --------------------------------------------------------------------------------
    def serve(self, spec, *, timeout_s: float = 300.0):
        """Deploy a model on this fleet (Ray Serve); returns a
        :class:`~rayfleet.serving.deploy.deployer.ServeDeployment` once its engines answer.

        ``spec``: a ``ServeSpec``, a mapping of its fields, or a serve YAML path (see
        ``examples/serve/``). Use ``.openai_base_url`` with any OpenAI client and
        ``.shutdown()`` to delete the app. Raises ``SpecError`` for a bad spec and
        ``ServeDeployError`` if the app does not come up within ``timeout_s``.
        """
        from rayfleet.serving.deploy.deployer import deploy

        return deploy(spec, timeout_s=timeout_s)

    # -- queues and the shared autoscaler -------------------------------------------------------
    def queues(self) -> list:
        """The fleet's queues (frozen :class:`~rayfleet.platform.queues.Queue` records)."""
        from rayfleet.platform.queues import parse_queue_spec

        return [parse_queue_spec(q) for q in ray.get(self.controller.list_queues.remote())]

    def create_queue(self, name: str, *, parent: str | None = None, quota: dict | None = None,
                     borrow_limit: dict | None = None, priority: int = 0):
        """Create or replace a queue (validated here, then as a whole tree by the controller)."""
        from rayfleet.platform.queues import parse_queue_spec

        queue = parse_queue_spec({"name": name, "parent": parent, "quota": quota or {},
                                  "borrow_limit": borrow_limit, "priority": priority})
        return parse_queue_spec(ray.get(self.controller.create_queue.remote(queue.to_json())))

    def delete_queue(self, name: str) -> None:
        ray.get(self.controller.delete_queue.remote(name))

    def autoscaler_step(self) -> list[dict]:
        """Run one step of the shared autoscaler now; returns its decisions (also in events)."""
        return ray.get(self.controller.autoscaler_step.remote())

    def start_autoscaler(self, interval_s: float = 10.0, **config) -> None:
        """Run the shared autoscaler in the controller every ``interval_s`` seconds.

        ``config``: :class:`~rayfleet.platform.autoscaler_policy.AutoscalerConfig` fields, e.g.
        ``scale_down_after_s=5, job_resize_cooldown_s=10`` (seconds of hysteresis).
        """
        ray.get(self.controller.start_autoscaler.remote(interval_s, config or None))

    def stop_autoscaler(self) -> bool:
        """Stop the shared autoscaler loop; returns whether one was running."""
        return ray.get(self.controller.stop_autoscaler.remote())

    def autoscaler_decisions(self, limit: int = 20) -> list:
        """The autoscaler's recent decisions and handovers (events with their reasons), oldest first."""
        return ray.get(self.controller.autoscaler_decisions.remote(limit))

    def autoscale_serve(self, served, **config):
        """Let the shared autoscaler scale a served model (``fleet.serve(...)``'s result) onto
        accelerators it lends from elastic training; returns a handle with ``history()``/``stop()``.

        ``config``: :class:`~rayfleet.serving.deploy.autoscale_shell.ServeShellConfig` fields — ``ttft_slo_s``,
        ``target_ongoing_requests``, ``max_replicas``, ``role``, ``interval_s``, ``window_s``.
        """
        from rayfleet.serving.deploy.autoscale_shell import start_serve_shell

        return start_serve_shell(served.spec, **config)

    def shutdown(self) -> None:
        """Disconnect; stop the local fleet too if this ``Fleet`` started it."""
        if ray.is_initialized():
            ray.shutdown()
        if self.local_fleet is not None:
            self.local_fleet.down()
            self.local_fleet = None

    def __repr__(self) -> str:
        return f"Fleet(address={self.address!r}, local={self.local_fleet is not None})"


def _check_reachable(address: str, *, timeout_s: float = 3.0) -> None:
    """Fail fast: ``ray.init`` retries an unreachable GCS for minutes before giving up."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise FleetNotFoundError(
            f"address {address!r} is not host:port. Fix: pass the head node's GCS address, e.g. '10.0.0.1:6379'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise FleetNotFoundError(
            f"no Ray cluster answers at {address!r} ({exc.strerror or exc}). Fix: start a fleet with "
            "`rayfleet up` or `ray up cluster.yaml`, pass the head's GCS address (host:port), "
            "or use rayfleet.connect(address='local') to start a local one"
        ) from None


def _init(address: str) -> None:
    ensure_auth_token()
    if ray.is_initialized():
        return
    _check_reachable(address)
    # Inside a submitted job the job's runtime env already applies (and Ray refuses a driver
    # env that repeats one of its variables); elsewhere workers need the auth mode passed on.
    in_job = bool(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))
    try:
        ray.init(address=address, namespace="rayfleet", log_to_driver=False,
                 runtime_env=None if in_job else {"env_vars": {"RAY_AUTH_MODE": "token"}})
    except ConnectionError as exc:
        raise FleetNotFoundError(
            f"cannot connect to a Ray cluster at {address!r} ({exc}). Fix: start a fleet with "
            "`rayfleet up` or `ray up cluster.yaml`, pass the right address (host:port of the head's GCS), "
            "or use rayfleet.connect(address='local') to start a local one"
        ) from None


def connect(
    address: str | None = None,
    *,
    nodes: int = 2,
    accelerator: str = "H100",
    accelerators_per_node: int | None = 8,
    racks: int = 1,
) -> Fleet:
    """Connect to a fleet.

    Args:
        address: ``"host:port"`` of a running cluster; ``"local"`` to start a private local
            fleet (stopped by ``fleet.shutdown()`` or at exit); ``None`` to use the cluster of
            the current Ray job, else the fleet started by ``rayfleet up``.
        nodes, accelerator, accelerators_per_node, racks: shape of the fleet started for
            ``address="local"``.
    """
    if address == "local":
        topology = build_topology(num_nodes=nodes, accelerator=accelerator,
                                  accelerators_per_node=accelerators_per_node, num_racks=racks)
        home = Path(tempfile.mkdtemp(prefix="rayfleet-local-"))
        local = LocalFleet.up(topology, home=home)
        atexit.register(local.down)
        _init(local.address)
        return Fleet(local.address, local_fleet=local)
    if address is None:
        if os.environ.get("RAY_ADDRESS"):
            address = os.environ["RAY_ADDRESS"]
        else:
            record = LocalFleet.load(missing_ok=True)
            if record is None or not record.is_running():
                raise FleetNotFoundError(
                    f"no fleet is running here (no live record under {rayfleet_home()}, no RAY_ADDRESS). "
                    "Fix: run `rayfleet up`, pass address='host:port', or use connect(address='local')"
                )
            address = record.address
    _init(address)
    return Fleet(address)
