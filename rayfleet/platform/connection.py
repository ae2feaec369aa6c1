"""Connecting this process to a fleet: find the cluster, join it with Ray, make sure the controller runs.

Design decisions:
- The connection lives in ``platform``, not in the SDK: training drivers (``jobs``), Serve
  deployers (``serving``) and the SDK all need it, and ``jobs``/``serving`` may not import the
  SDK (the layering rules in docs/architecture.md). The SDK's ``Fleet`` wraps a
  :class:`FleetConnection` with the user-facing methods.
- Where the fleet is, in order: an explicit address; ``"local"`` (start a private local fleet,
  stopped at exit); ``RAY_ADDRESS`` (set inside ``ray job submit``); the fleet recorded by
  ``rayfleet up`` under ``$RAYFLEET_HOME``.
- Fail fast: ``ray.init`` retries an unreachable GCS for minutes, so a TCP probe runs first and a
  missing fleet is a ``FleetNotFoundError`` naming the address and the fix within seconds.
- Token authentication stays on; workers of a non-job driver get ``RAY_AUTH_MODE=token`` passed
  on (inside a submitted job the job's runtime env already carries it, and Ray refuses a driver
  env that repeats one of its variables).
- A loopback address stays loopback (``ray_compat.keep_loopback_node_ip``): a local fleet listens
  on 127.0.0.1 only, and Ray's clients would otherwise dial the machine's network address.
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rayfleet.errors import FleetNotFoundError
from rayfleet.platform import ray_compat
from rayfleet.platform.controller import ensure_controller
from rayfleet.platform.launcher import LocalFleet, ensure_auth_token, rayfleet_home
from rayfleet.platform.topology import build_topology

__all__ = ["FleetConnection", "connect", "resolve_address"]


@dataclass(frozen=True)
class FleetConnection:
    """A joined fleet: the GCS address, the local fleet this process started (if any) and the
    fleet controller's actor handle."""

    address: str
    controller: Any
    local_fleet: LocalFleet | None = None


def _check_reachable(address: str, *, timeout_s: float = 3.0) -> None:
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


def _init_ray(address: str) -> None:
    ensure_auth_token()
    if ray.is_initialized():
        return
    _check_reachable(address)
    ray_compat.keep_loopback_node_ip()
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


def resolve_address(address: str | None) -> str:
    """The address to join: ``address`` itself, else ``RAY_ADDRESS``, else the ``rayfleet up`` fleet.

    Raises ``FleetNotFoundError`` when none of them names a running fleet.
    """
    if address is not None:
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    record = LocalFleet.load(missing_ok=True)
    if record is None or not record.is_running():
        raise FleetNotFoundError(
            f"no fleet is running here (no live record under {rayfleet_home()}, no RAY_ADDRESS). "
            "Fix: run `rayfleet up`, pass address='host:port', or use connect(address='local')"
        )
    return record.address


def connect(
    address: str | None = None,
    *,
    nodes: int = 2,
    accelerator: str = "H100",
    accelerators_per_node: int | None = 8,
    racks: int = 1,
) -> FleetConnection:
    """Join a fleet (see the module docstring for where it is looked for) and ensure its controller.

    Args:
        address: ``"host:port"`` of a running cluster; ``"local"`` to start a private local
            fleet (stopped at exit, or by ``connection.local_fleet.down()``); ``None`` to use the
            cluster of the current Ray job, else the fleet started by ``rayfleet up``.
        nodes, accelerator, accelerators_per_node, racks: shape of the fleet started for
            ``address="local"``.
    """
    local: LocalFleet | None = None
    if address == "local":
        topology = build_topology(num_nodes=nodes, accelerator=accelerator,
                                  accelerators_per_node=accelerators_per_node, num_racks=racks)
        local = LocalFleet.up(topology, home=Path(tempfile.mkdtemp(prefix="rayfleet-local-")))
        atexit.register(local.down)
        address = local.address
    else:
        address = resolve_address(address)
    _init_ray(address)
    return FleetConnection(address=address, controller=ensure_controller(), local_fleet=local)
