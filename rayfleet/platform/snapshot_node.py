"""Where flash snapshots live on a node's tmpfs, and freeing a whole fleet's (no torch here: the
launcher's ``down`` imports it; the store itself is :mod:`rayfleet.platform.snapshot`), the
per-node actor that owns the directory, and freeing.

Layout: ``{DEFAULT_SNAPSHOT_ROOT}/{ray session}/{job}/rank_{r}/...``. One directory per Ray
cluster session, so a fleet's teardown removes exactly its own jobs' snapshots, also while another
local fleet of the same user runs on the host. tmpfs is memory: a snapshot nobody frees holds its
RAM until the host reboots (a day of test runs once left 9.3 GiB there and starved the next run
into Ray's OOM killer). Who frees what:

- the job driver, each formation's snapshots when its ``fit`` returns (nothing restores from
  them after that: the next formation restores from the persisted checkpoint);
- ``LocalFleet.down``, every snapshot its sessions left (jobs killed with the fleet).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

__all__ = [
    "DEFAULT_SNAPSHOT_ROOT", "session_snapshot_root", "remove_session_snapshots", "list_snapshots",
    "SnapshotStoreActor", "snapshot_actor_name", "get_or_create_snapshot_actor", "release_job_snapshots",
]

DEFAULT_SNAPSHOT_ROOT = f"/dev/shm/rayfleet-{os.getuid()}/snapshots"


def session_snapshot_root(session_name: str, base: str = DEFAULT_SNAPSHOT_ROOT) -> str:
    """The snapshot root of one Ray session (``ray.get_runtime_context().get_session_name()``)."""
    if not session_name or "/" in session_name or session_name in (".", ".."):
        raise ValueError(f"session_name {session_name!r} is not a Ray session name (e.g. 'session_2026-11-27_17-09-00_1_2')")
    return os.path.join(base, session_name)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def remove_session_snapshots(session_names: Iterable[str], base: str = DEFAULT_SNAPSHOT_ROOT) -> int:
    """Delete the snapshot roots of ``session_names`` under ``base``; returns the bytes freed."""
    freed = 0
    for name in session_names:
        root = Path(session_snapshot_root(name, base))
        if root.is_dir() and not root.is_symlink():
            freed += _tree_bytes(root)
            shutil.rmtree(root, ignore_errors=True)
    return freed


def _make_private_dirs(path: Path) -> None:
    """``mkdir -p path`` where a ``rayfleet-<uid>`` component is created mode 0700 and must be
    ours: a directory another user created there first (to read or plant snapshots) is refused."""
    for parent in reversed((path, *path.parents)):
        if parent.name.startswith("rayfleet-") and parent.name.removeprefix("rayfleet-").isdigit():
            parent.mkdir(mode=0o700, exist_ok=True)
            st = parent.lstat()
            if parent.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"{parent} is not a private directory of this user (uid {os.getuid()}); "
                                      "remove it or pass another snapshot root")
    path.mkdir(parents=True, exist_ok=True)


def list_snapshots(root: str | os.PathLike, job: str | None = None) -> dict[str, dict[int, list[int]]]:
    """``{job: {rank: [committed steps, newest first]}}`` from commit records (no data read)."""
    out: dict[str, dict[int, list[int]]] = {}
    base = Path(root)
    jobs = [base / job] if job else (sorted(p for p in base.iterdir() if p.is_dir()) if base.exists() else [])
    for job_dir in jobs:
        for rank_dir in sorted(job_dir.glob("rank_*")):
            steps = []
            for record_path in rank_dir.glob("slot_*.json"):
                with contextlib.suppress(ValueError, OSError):
                    steps.append(int(json.loads(record_path.read_text())["step"]))
            out.setdefault(job_dir.name, {})[int(rank_dir.name.split("_")[1])] = sorted(steps, reverse=True)
    return out


class SnapshotStoreActor:
    """Per-node owner of the snapshot directory (a detached Ray actor; see
    :func:`get_or_create_snapshot_actor`). Training processes on the node read and write the files
    directly through :class:`SnapshotStore`; this actor hands out the root, lists what is there,
    and frees a job's memory when it ends. It outlives worker restarts, and so does the data."""

    def __init__(self, root: str = DEFAULT_SNAPSHOT_ROOT) -> None:
        self._root = Path(root)
        _make_private_dirs(self._root)

    def root(self) -> str:
        return str(self._root)

    def list(self, job: str | None = None) -> dict[str, dict[int, list[int]]]:
        return list_snapshots(self._root, job)

    def usage_bytes(self, job: str | None = None) -> int:
        base = self._job_dir(job) if job else self._root
        return _tree_bytes(base) if base.exists() else 0

    def release(self, job: str) -> int:
        """Delete a job's snapshots on this node; returns the bytes freed."""
        freed = self.usage_bytes(job)
        shutil.rmtree(self._job_dir(job), ignore_errors=True)
        return freed

    def _job_dir(self, job: str) -> Path:
        if not job or "/" in job or job in (".", ".."):
            raise ValueError(f"job {job!r} is not a snapshot job name (one path component, e.g. 'tiny-20261127-170900-f0')")
        return self._root / job


def snapshot_actor_name(node_id: str) -> str:
    return f"rayfleet_snapshots:{node_id}"


def get_or_create_snapshot_actor(node_id: str | None = None, *, root: str | None = None):
    """The snapshot actor of ``node_id`` (default: this process's node), created if absent:
    detached, named per node, ``num_cpus=0``, hard-pinned to the node. ``root`` (default: this Ray
    session's directory under ``DEFAULT_SNAPSHOT_ROOT``) only matters to the call that creates it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    node_id = node_id or context.get_node_id()
    root = root or session_snapshot_root(context.get_session_name())
    return ray.remote(SnapshotStoreActor).options(
        name=snapshot_actor_name(node_id), namespace="rayfleet", lifetime="detached",
        get_if_exists=True, num_cpus=0, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(root)


def release_job_snapshots(job: str, *, timeout_s: float = 5.0) -> int:
    """Free ``job``'s snapshots on every live node that has a snapshot actor; returns the bytes
    freed by the actors that answered within ``timeout_s``. Called when nothing will restore from
    them (a formation's ``fit`` returned), on the path to the next formation, hence the short wait:
    a node that just died may still be listed alive for seconds. The calls are not cancelled, so a
    slow actor still frees its files; a failed one leaves them to its fleet's teardown."""
    import ray

    refs = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        try:
            actor = ray.get_actor(snapshot_actor_name(node["NodeID"]), namespace="rayfleet")
        except ValueError:  # no snapshot was ever taken on that node
            continue
        refs.append(actor.release.remote(job))
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    freed = 0
    for ref in ready:
        with contextlib.suppress(ray.exceptions.RayError):
            freed += ray.get(ref)
    return freed
