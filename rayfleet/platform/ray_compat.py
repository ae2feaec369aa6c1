"""Every use of Ray's private modules, in one place (Ray 2.60).

Design decisions:
- rayfleet needs a few things Ray 2.60 offers only privately: the per-node view of free
  resources, the dashboard address of the connected cluster, a placement group handle from its
  id (to remove groups listed by the state API), token-authentication setup, and the running
  Serve proxy's HTTP address. Each gets one small public function here, so an upgrade of Ray
  breaks one file with one obvious fix, not six call sites.
- Every import is inside its function: importing this module costs nothing and does not import
  Ray (the CLI's fast paths and the unit tests rely on that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "dashboard_url", "available_resources_per_node", "placement_group_from_hex",
    "default_auth_token_path", "generate_auth_token", "enable_token_auth", "serve_proxy_address",
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


def serve_proxy_address() -> tuple[str, int]:
    """(host, port) of the running Serve's HTTP proxy (Serve must be running)."""
    import ray
    from ray.serve.context import _get_global_client

    config = ray.get(_get_global_client()._controller.get_http_config.remote())
    return config.host, config.port
