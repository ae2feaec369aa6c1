"""Checkpoint store: sharded, reshardable, atomically committed training checkpoints at an fsspec URI.

Layout::

    {uri}/step_{N:08d}/.metadata            DCP's global metadata (tensor chunks -> files)
    {uri}/step_{N:08d}/__{r}_0.distcp       DCP data written by rank r (its shards)
    {uri}/step_{N:08d}/rank_{r:05d}.pt      rank r's rank-local state (data position, RNG, ...)
    {uri}/step_{N:08d}/manifest.json        written LAST: size + CRC-32 of every file above

Design decisions:
- torch.distributed.checkpoint (DCP) with its fsspec writer/reader, not our own format: DCP
  saves each rank's DTensor shards without gathering and loads them into a *different* sharding
  (another world size, FSDP2 or TP layout) by reading only the overlapping chunks. We subclass
  its writer only to hash files while they are written (see ``checkpoint_manifest``).
- Two kinds of state, passed separately because DCP would silently merge them otherwise:
  ``sharded`` (DTensors are sharded; plain tensors and objects are treated as *replicated* and
  written once) and ``rank_local`` (one small dict per rank, e.g. RNG states and the data
  position, written per rank with ``torch.save`` and loaded with ``weights_only=True``).
- Commit protocol: rank 0 removes an earlier attempt at the same step (manifest first), all
  ranks write, digests are all-gathered to rank 0, rank 0 writes the manifest, then a barrier.
  A directory without a valid manifest is never listed, so a writer killed anywhere before the
  manifest leaves the previous checkpoint as the latest.
- The caller passes the process group. The flash checkpointer persists from a background
  thread and so must pass a group of its own (collectives on the training group from two
  threads would interleave).
- Retention keeps the newest ``keep`` committed steps (``keep >= 1``: the newest committed one
  is never deleted) and removes uncommitted directories *older* than the newest committed one
  (a newer one may be a save still in progress).
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _DcpFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from rayfleet.storage.safe_dcp_reader import SafeFsspecReader
from torch.distributed.checkpoint.api import CheckpointException

from rayfleet.errors import SpecError
from rayfleet.storage.checkpoint_manifest import (
    MANIFEST, DigestLog, HashingStream, Manifest, VerifyResult, check_sizes, crc32_of_file,
    digest_of_bytes,
    now_unix_s, read_manifest, verify_step_dir, write_manifest,
)

__all__ = [
    "CheckpointInfo", "LoadedCheckpoint", "VerifyResult", "save_checkpoint", "load_checkpoint",
    "list_checkpoints", "latest_checkpoint", "verify_checkpoint", "apply_retention", "discard_checkpoints_after", "step_dirname",
]

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its root URI, step, directory URI, writer world size and size."""

    uri: str
    step: int
    path: str
    world_size: int
    num_bytes: int
    metadata: dict


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns besides filling ``sharded`` in place.

    ``rank_local`` is this rank's saved rank-local dict when the checkpoint was written at the
    same world size (else None: rank-local state has no meaning across a resize). After a
    resize, ``rank_local_by_rank`` maps *saving* ranks to their dicts for the caller to map:
    rank 0's, plus this rank's number if it existed (each rank reads at most two small files,
    not one per saving rank). It is empty when the world size did not change.
    """

    info: CheckpointInfo
    rank_local: dict | None
    rank_local_by_rank: Mapping[int, dict]


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def _rank_world(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _barrier(process_group: dist.ProcessGroup | None, world: int) -> None:
    if world > 1:
        dist.barrier(group=process_group)


class _HashingFileSystem(_DcpFsspecFileSystem):
    """DCP's fsspec filesystem, with data files hashed as they are written."""

    def __init__(self, log: DigestLog) -> None:
        super().__init__()
        self._log = log

    @contextlib.contextmanager
    def create_stream(self, path, mode):  # type: ignore[override]
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        with super().create_stream(path, mode) as stream:
            if "w" not in mode or not name.endswith(".distcp"):
                yield stream
                return
            hashing = HashingStream(stream, name, self._log.add)
            yield hashing
            hashing.close()  # no-op when DCP closed it already; records the digest otherwise


class _HashingFsspecWriter(FsspecWriter):
    def __init__(self, path: str, log: DigestLog) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self.fs = _HashingFileSystem(log)
        self.path = self.fs.init_path(path)


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns on every single-process save/load and on rewriting a step; both are intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint")
        yield


def _check_step(step: int) -> None:
    if not isinstance(step, int) or step < 0:
        raise SpecError("step", step, "a checkpoint step must be a non-negative int", "pass the train step")


def _rank_local_bytes(rank_local: Mapping[str, Any] | None) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(rank_local or {}), buffer)
    data = buffer.getvalue()
    try:  # fail at save time, not at the restore after a crash
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise SpecError("rank_local", sorted((rank_local or {}).keys()),
                        f"it holds a value torch.load(weights_only=True) refuses ({exc.__class__.__name__})",
                        "keep rank-local state to dicts/lists/tuples of ints, floats, str, bool, "
                        "None and tensors (e.g. torch.get_rng_state(), not numpy arrays)") from exc
    return data


def save_checkpoint(uri: str, *, step: int, sharded: Mapping[str, Any],
                    rank_local: Mapping[str, Any] | None = None,
                    process_group: dist.ProcessGroup | None = None, keep: int | None = None,
                    metadata: dict | None = None) -> CheckpointInfo:
    """Save one step collectively (every rank of ``process_group`` calls it) and commit it.

    ``sharded`` is a nested dict (e.g. ``{"model": ..., "optim": ...}``) of DTensors, tensors and
    plain objects; ``rank_local`` a small per-rank dict. With ``keep``, rank 0 applies retention
    after the commit. Returns the committed checkpoint's info on every rank.
    """
    _check_step(step)
    rank_local_data = _rank_local_bytes(rank_local)
    rank, world = _rank_world(process_group)
    fs, root = fsspec.core.url_to_fs(uri)
    step_path = _join(root, step_dirname(step))
    if rank == 0:
        if fs.exists(step_path):  # an earlier (torn or committed) attempt: uncommit it first
            if fs.exists(_join(step_path, MANIFEST)):
                fs.rm(_join(step_path, MANIFEST))
            fs.rm(step_path, recursive=True)
        fs.makedirs(step_path, exist_ok=True)
    _barrier(process_group, world)

    log = DigestLog()
    writer = _HashingFsspecWriter(fs.unstrip_protocol(step_path), log)
    with _quiet_single_process():
        dcp.save(dict(sharded), storage_writer=writer, process_group=process_group, no_dist=world == 1)
    name = f"rank_{rank:05d}.pt"
    with fs.open(_join(step_path, name), "wb") as f:
        f.write(rank_local_data)
    log.add(name, digest_of_bytes(rank_local_data))

    rank_digests = dict(log.name_to_digest)
    if world > 1:
        gathered: list[dict] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, rank_digests, group=process_group)
    else:
        gathered = [rank_digests]
    manifest = None
    if rank == 0:
        files = {n: d for per_rank in gathered for n, d in per_rank.items()}
        files[_DCP_METADATA] = crc32_of_file(fs, _join(step_path, _DCP_METADATA))
        manifest = Manifest(step=step, world_size=world, files=files, metadata=dict(metadata or {}),
                            created_unix_s=now_unix_s())
        write_manifest(fs, step_path, manifest)
        if keep is not None:
            apply_retention(uri, keep=keep)
    _barrier(process_group, world)
    num_bytes = manifest.num_bytes if manifest else sum(d.num_bytes for p in gathered for d in p.values())
    return CheckpointInfo(uri=uri, step=step, path=fs.unstrip_protocol(step_path), world_size=world,
                          num_bytes=num_bytes, metadata=dict(metadata or {}))


def _step_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[int, str]]:
    if not fs.exists(root):
        return []
    out = []
    for entry in fs.ls(root, detail=False):
        match = _STEP_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            out.append((int(match.group(1)), entry.rstrip("/")))
    return sorted(out)


def list_checkpoints(uri: str) -> list[CheckpointInfo]:
    """Committed checkpoints under ``uri``, oldest first (manifest valid, files present, sizes right)."""
    fs, root = fsspec.core.url_to_fs(uri)
    out = []
    for step, path in _step_dirs(fs, root):
        manifest = read_manifest(fs, path)
        if manifest is None or manifest.step != step or check_sizes(fs, path, manifest):
            continue
        out.append(CheckpointInfo(uri=uri, step=step, path=fs.unstrip_protocol(path),
                                  world_size=manifest.world_size, num_bytes=manifest.num_bytes,
                                  metadata=manifest.metadata))
    return out


def latest_checkpoint(uri: str) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``uri``, or None. A half-written step is never it."""
    committed = list_checkpoints(uri)
    return committed[-1] if committed else None


def verify_checkpoint(uri: str, step: int | None = None) -> VerifyResult:
    """Read every file of a checkpoint and compare with its manifest.

    ``uri`` is either the root (then ``step``, default: the newest step directory, committed or
    not) or a step directory itself.
    """
    fs, root = fsspec.core.url_to_fs(uri)
    name = root.rstrip("/").rsplit("/", 1)[-1]
    match = _STEP_RE.match(name)
    if match and step is None:
        return verify_step_dir(fs, root, expect_step=int(match.group(1)))
    dirs = _step_dirs(fs, root)
    if step is None:
        if not dirs:
            return VerifyResult(uri, False, None, ("no step_* directories",))
        step = dirs[-1][0]
    return verify_step_dir(fs, _join(root, step_dirname(step)), expect_step=step)


def discard_checkpoints_after(uri: str, step: int) -> list[int]:
    """Delete every step directory newer than ``step`` (after a rollback those steps belong to an
    abandoned timeline and must never become "latest" again). Not collective: call on one rank."""
    fs, root = fsspec.core.url_to_fs(uri)
    deleted = []
    for newer, path in _step_dirs(fs, root):
        if newer <= step:
            continue
        if fs.exists(_join(path, MANIFEST)):
            fs.rm(_join(path, MANIFEST))
        fs.rm(path, recursive=True)
        deleted.append(newer)
    return deleted


def apply_retention(uri: str, *, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` committed steps, and torn steps older than the newest
    committed one. Returns the deleted steps. Not collective: call it on one rank."""
    if not isinstance(keep, int) or keep < 1:
        raise SpecError("keep", keep, "retention must keep at least the newest committed checkpoint",
                        "set keep to an int >= 1")
    fs, root = fsspec.core.url_to_fs(uri)
    committed = {info.step for info in list_checkpoints(uri)}
    if not committed:
        return []
    keep_steps = set(sorted(committed)[-keep:])
    newest = max(committed)
    deleted = []
    for step, path in _step_dirs(fs, root):
        if step in keep_steps or (step not in committed and step > newest):
            continue
        if fs.exists(_join(path, MANIFEST)):  # uncommit before deleting data
            fs.rm(_join(path, MANIFEST))
        fs.rm(path, recursive=True)
        deleted.append(step)
    return deleted


def load_checkpoint(uri: str, *, sharded: Mapping[str, Any], step: int | None = None,
                    process_group: dist.ProcessGroup | None = None,
                    verify_checksums: bool = True) -> LoadedCheckpoint:
    """Load a committed checkpoint collectively, filling ``sharded`` **in place**.

    ``sharded`` is a template with the same keys as saved, laid out for the *current* world
    (DTensors of the new sharding, e.g. from a freshly parallelized model and
    ``get_state_dict``); DCP reads the overlapping chunks, so any world size works. ``step``
    defaults to the latest committed one. Raises ``SpecError`` when there is none or it is corrupt.
    ``verify_checksums`` (default on) reads every file against the manifest's CRC-32s first;
    pass False to skip that read when the storage is trusted and the load is latency-critical.
    """
    rank, world = _rank_world(process_group)
    fs, root = fsspec.core.url_to_fs(uri)
    if step is None:
        info = latest_checkpoint(uri)
        if info is None:
            raise SpecError("checkpoint_uri", uri, "no committed checkpoint there (no step_* with a valid manifest)",
                            "point it at the job's checkpoint directory, or start without restoring")
    else:
        _check_step(step)
        info = next((c for c in list_checkpoints(uri) if c.step == step), None)
        if info is None:
            raise SpecError("step", step, f"no committed checkpoint for that step under {uri!r}",
                            f"use one of {[c.step for c in list_checkpoints(uri)]} or step=None for the latest")
    step_path = _join(root, step_dirname(info.step))
    if verify_checksums:
        result = verify_step_dir(fs, step_path, expect_step=info.step)
        if not result.ok:
            raise SpecError("checkpoint_uri", info.path, "corrupt checkpoint: " + "; ".join(result.problems),
                            "load an earlier step (apply_retention keeps several) or re-save")
    try:
        with _quiet_single_process():
            dcp.load(sharded, storage_reader=SafeFsspecReader(fs.unstrip_protocol(step_path)),  # type: ignore[arg-type]
                     process_group=process_group, no_dist=world == 1)
    except CheckpointException as exc:
        causes = "; ".join(f"rank {r}: {e[0].__class__.__name__}: {e[0]}" for r, e in exc.failures.items())
        raise SpecError("sharded", info.path, f"the template does not fit the checkpoint ({causes})",
                        "build the template from the same model/optimizer (keys, dtypes and global shapes)") from exc
    wanted = [rank] if info.world_size == world else sorted({0, rank} & set(range(info.world_size)))
    by_rank = {}
    for r in wanted:
        with fs.open(_join(step_path, f"rank_{r:05d}.pt"), "rb") as f:
            by_rank[r] = torch.load(io.BytesIO(f.read()), weights_only=True)
    if info.world_size == world:
        return LoadedCheckpoint(info=info, rank_local=by_rank[rank], rank_local_by_rank={})
    return LoadedCheckpoint(info=info, rank_local=None, rank_local_by_rank=by_rank)
