"""Every use of Ray's private modules, in one place (Ray 2.60).

Design decisions:
- rayfleet needs a few things Ray 2.60 offers only privately: the per-node view of free
  resources, the dashboard address of the connected cluster, a placement group handle from its
  id (to remove groups listed by the state API), token-authentication setup, the running
  Serve proxy's HTTP address, a ``ray start`` that keeps a loopback node address, and a Ray
  Train trainer without the helper actors a rayfleet job does not need (and its tag for a torch
  run), and the base class of
  Serve LLM's node-initialization callbacks. Each gets one small public function here, so an upgrade of Ray
  breaks one file with one obvious fix, not six call sites.
- Every import is inside its function: importing this module costs nothing and does not import
  Ray (the CLI's fast paths and the unit tests rely on that).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "dashboard_url", "available_resources_per_node", "placement_group_from_hex",
    "default_auth_token_path", "generate_auth_token", "enable_token_auth", "serve_proxy_address",
    "keep_loopback_node_ip", "LOOPBACK_FLEET_ENV", "shared_host_ray_env",
    "metrics_export_interval_s", "without_helper_actors", "torch_training_framework", "serve_llm_callback_base",
]


def dashboard_url() -> str:
    """The connected cluster's dashboard / job API address, always with a scheme (``http://host:port``)."""
    from ray._private.worker import get_dashboard_url

    url = get_dashboard_url()
    return url if "://" in url else f"http://{url}"


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Free resources of each live node, keyed by Ray node id (the only per-node view in Ray 2.60)."""
    from ray._private.state import available_resources_per_node as per_node

    return per_node()


def metrics_export_interval_s() -> float:
    """How often this cluster's processes export their metrics to Ray's agents
    (``metrics_report_interval_ms``, 10 s by default): a scrape more often reads the same values."""
    from ray._raylet import Config

    return Config.metrics_report_interval_ms() / 1000.0


def placement_group_from_hex(placement_group_id: str) -> Any:
    """A ``PlacementGroup`` handle for an id as the state API lists it (hex), e.g. to remove it."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(PlacementGroupID(bytes.fromhex(placement_group_id)))


def default_auth_token_path() -> Path:
    """Where Ray looks for its authentication token when ``RAY_AUTH_TOKEN_PATH`` is unset."""
    from ray._private.authentication.authentication_token_setup import _get_default_token_path

    return Path(_get_default_token_path())


def generate_auth_token(path: Path | None = None) -> bool:
    """Create a new token at ``path`` (default: Ray's default path) unless one is there already;
    True if this call created it.

    Atomic, first writer wins: the token goes to a private temporary file that is then hard-linked
    into place, which fails if the file exists. Ray's own ``generate_and_save_token`` opens the
    path for writing, so two processes starting fleets at once on a fresh machine (two test
    sessions, two notebooks) could each write a different token, and the fleet started with the
    first one refuses every client that read the second.
    """
    import os
    import tempfile

    from ray._private.authentication.authentication_token_setup import generate_new_authentication_token

    path = Path(path) if path is not None else default_auth_token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".auth_token-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(generate_new_authentication_token())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def enable_token_auth() -> None:
    """Switch this process's Ray clients to token authentication (an environment variable is not
    enough once Ray is imported: its C++ config is cached)."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


# For every process a loopback fleet starts: Ray then keeps "127.0.0.1" (the head's GCS address, a
# job's RAY_ADDRESS) as loopback instead of swapping in the machine's address (keep_loopback_node_ip).
LOOPBACK_FLEET_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# Ray's log monitor (one per node) re-globs its node's log directory for new files every 0.1 s
# until it holds 1,000 files (RAY_LOG_MONITOR_MANY_FILES_THRESHOLD), then every
# LOG_NAME_UPDATE_INTERVAL_S. With several raylets on one host that is several scans of
# hundreds of worker logs ten times a second: measured 2.7 CPU minutes of the cluster test tier's
# 29.5 (4 nodes, 19 min), and 2.9 CPU s a minute on an idle 4-node local fleet (1.0 with this).
# A new file is found within 2 s and read from its start, so no output is lost; lines of files
# already open still go out every 0.1 s.
#
# Each node's dashboard agent also runs Ray's reporter: every REPORTER_UPDATE_INTERVAL_MS (5 s) it
# reads every worker process of its node with psutil (memory_full_info reads /proc/<pid>/smaps, a
# walk of a torch process's thousands of mappings) for the dashboard's node view and Ray's node
# gauges. Nothing of rayfleet reads them (the node agents report health and the autoscaler reads
# the controller), and on one host several agents read the same machine: every 30 s is plenty.
_SHARED_HOST_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "2",
                    "REPORTER_UPDATE_INTERVAL_MS": "30000"}


def shared_host_ray_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The log-monitor and reporter settings for Ray nodes that share one host (a local fleet, a
    local ``ray.init``), each left as ``environ`` (default: this process's) sets it."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key, value) for key, value in _SHARED_HOST_ENV.items()}


def keep_loopback_node_ip() -> None:
    """Make Ray in this process keep a loopback address (``ray start --node-ip-address``, the
    address of ``ray.init``) as given. Idempotent.

    Ray 2.60 replaces 127.0.0.1 with the machine's routable address
    (``services.resolve_ip_for_localhost``, called by ``ray start`` and by every client's address
    parsing), and every Ray server binds by its node's address: the C++ gRPC servers (GCS, raylet,
    object manager, core workers) on all interfaces unless it is 127.0.0.1, the agents on it (plus
    loopback). Kept as 127.0.0.1, all of them bind loopback only (measured; docs/security.md), and a
    client must then keep it too or it dials the machine's address, where nothing listens.
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``LOOPBACK_FLEET_ENV``) has the same effect but also
    makes ``ray start --address`` refuse to start a second node; here that check is let through.
    """
    import ipaddress

    from ray._private import ray_constants, services

    ray_constants.ENABLE_RAY_CLUSTER = True  # read by `ray start --address` only once this is patched
    resolve = services.resolve_ip_for_localhost
    if getattr(resolve, "keeps_loopback", False):
        return

    def keep_loopback(host: str) -> str:
        if host == "localhost":
            return "127.0.0.1"
        try:
            return host if ipaddress.ip_address(host).is_loopback else resolve(host)
        except ValueError:  # a host name: Ray's own resolution
            return resolve(host)

    keep_loopback.keeps_loopback = True  # type: ignore[attr-defined]
    services.resolve_ip_for_localhost = keep_loopback


def serve_proxy_address() -> tuple[str, int]:
    """(host, port) of the running Serve's HTTP proxy (Serve must be running)."""
    import ray
    from ray.serve.context import _get_global_client

    config = ray.get(_get_global_client()._controller.get_http_config.remote())
    return config.host, config.port


def without_helper_actors(trainer_cls: type) -> type:
    """``trainer_cls`` (a Ray Train v2 trainer, e.g. ``TorchTrainer``) without two helper actors
    of Ray Train's that a rayfleet job does not need. Each is a process of its own (about 2 CPU s
    to start on a 2-core host, for each of the 50-odd jobs of the test suite), and Ray Train's
    controller waits for both on its way up or down.

    - The datasets callback, when the run is given no Ray Dataset: it still starts a
      ``DatasetManager`` (a process that imports Ray Data) and sends every worker Ray Data's
      context (which imports Ray Data there too). rayfleet's workers read their token shards
      themselves; with datasets the callback stays.
    - The placement-group cleaner: a detached actor per run that removes the run's placement
      group if the controller dies while the driver lives on. A rayfleet job's driver does that
      itself (``jobs.elastic.formation.remove_orphan_placement_groups`` after an aborted
      formation); otherwise a dead controller fails the fit, the driver exits, and Ray removes the
      job's placement groups with the job.
    """
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class _Trainer(trainer_cls):  # type: ignore[misc, valid-type]
        def _create_default_callbacks(self):
            dropped = (PlacementGroupCleanerCallback,) if self.datasets else (DatasetsCallback,
                                                                              PlacementGroupCleanerCallback)
            return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]

    _Trainer.__name__ = _Trainer.__qualname__ = trainer_cls.__name__
    return _Trainer


def torch_training_framework() -> Any:
    """Ray Train's tag for a torch run (``BackendConfig.framework``: its state export names the
    framework and its version)."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


def serve_llm_callback_base() -> type:
    """The base class of a Ray Serve LLM callback (``LLMConfig.callback_config.callback_class``):
    public as a setting, its class lives in a private module in Ray 2.60."""
    from ray.llm._internal.common.callbacks.base import CallbackBase

    return CallbackBase
