"""Node-local shared-memory snapshots of a training rank's state (flash checkpoints).

Layout, per (job, rank), under a tmpfs root (``/dev/shm/rayfleet-<uid>/snapshots/<ray session>`` in a
fleet: one private directory per user, mode 0700, so users sharing a node cannot read or plant
snapshots; one per Ray session, so a fleet frees its own: :mod:`rayfleet.platform.snapshot_paths`)::

    {root}/{job}/rank_{r:05d}/slot_{k}.data      tensors packed back to back (64-byte aligned)
    {root}/{job}/rank_{r:05d}/slot_{k}.objects   small non-tensor state (torch.save bytes)
    {root}/{job}/rank_{r:05d}/slot_{k}.json      commit record: step, layout, sizes, CRC-32s

Design decisions:
- Files on tmpfs, not Ray objects or process memory: a file outlives the training process that
  wrote it, and a restarted process on the same node maps it again without any copy through
  Ray. The per-node :class:`SnapshotStoreActor` owns the directory's lifecycle and answers
  "what is there" (it lists commit records); the data never passes through it.
- Buffers are mapped once (``UntypedStorage.from_file(shared=True)``) and pre-touched on first
  use; later snapshots only ``copy_`` into them. First touch of tmpfs pages costs ≈ 2 s/GiB,
  a copy into touched pages ≈ 0.06 s/GiB: reuse is what makes a snapshot cheap.
- Two phases: :meth:`SnapshotStore.write` (the copy; the only part that blocks a train step)
  and :meth:`SnapshotStore.commit` (CRC-32 of the data, then the commit record written to a
  temporary name and renamed into place). Before a slot is overwritten its commit record is
  deleted, so a crash at any point between leaves that slot invalid and the other slots as they
  were: a torn snapshot is never restored.
- ``num_slots`` (default 2) rotating slots: the newest committed snapshot stays valid while the
  next is written. A slot can be pinned (the persister reads it); a write never picks a pinned
  slot. With 2 slots and one pinned, the other slot is reused even if it holds the newest
  snapshot — during that copy the pinned (older) one is the valid fallback.
- CRC-32 (zlib; it releases the GIL) is computed at commit, off the step's critical path, and
  checked at restore.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from rayfleet.platform.snapshot_node import (DEFAULT_SNAPSHOT_ROOT, SnapshotStoreActor, _make_private_dirs,
                                             get_or_create_snapshot_actor, list_snapshots,
                                             release_job_snapshots, snapshot_actor_name)

__all__ = [
    "DEFAULT_SNAPSHOT_ROOT", "SnapshotStore", "PendingSnapshot", "SnapshotInfo", "RestoredSnapshot",
    "TensorEntry", "list_snapshots", "SnapshotStoreActor", "snapshot_actor_name",
    "get_or_create_snapshot_actor", "open_node_snapshot_store", "release_job_snapshots",
]


_ALIGN = 64
_FORMAT = "rayfleet-snapshot/1"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a slot's data file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class PendingSnapshot:
    """A slot whose data was written but not yet committed (not restorable yet)."""

    slot: int
    step: int
    layout: tuple[TensorEntry, ...]
    num_bytes: int
    objects: bytes


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot: which slot holds which step, and its size."""

    slot: int
    step: int
    num_bytes: int


@dataclass(frozen=True)
class RestoredSnapshot:
    """A verified snapshot. ``tensors`` are views into shared memory, valid until that slot is
    written again: copy them out before the next :meth:`SnapshotStore.write`."""

    step: int
    slot: int
    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a snapshot commit record")
    return dtype


def _plan_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[TensorEntry, ...], int]:
    entries, offset = [], 0
    for key, t in tensors.items():
        num_bytes = t.numel() * t.element_size()
        entries.append(TensorEntry(key, str(t.dtype), tuple(t.shape), offset, num_bytes))
        offset += -(-num_bytes // _ALIGN) * _ALIGN
    return tuple(entries), offset


def _view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    raw = buffer[entry.offset: entry.offset + entry.num_bytes]
    return raw.view(_dtype_from_name(entry.dtype)).view(entry.shape)


def _crc32(buffer: torch.Tensor, num_bytes: int) -> int:
    return zlib.crc32(memoryview(buffer[:num_bytes].numpy()))


class SnapshotStore:
    """The shared-memory snapshot slots of one (job, rank). Used directly by the training process.

    Thread-safety: ``write`` from one thread (the train loop), ``commit``/``pin``/``restore``
    from any thread; slot bookkeeping is under a lock.
    """

    def __init__(self, root: str | os.PathLike = DEFAULT_SNAPSHOT_ROOT, *, job: str, rank: int,
                 num_slots: int = 2) -> None:
        if num_slots < 2:
            raise ValueError("num_slots must be >= 2 so the previous snapshot survives a torn write")
        self.directory = Path(root) / job / f"rank_{rank:05d}"
        _make_private_dirs(self.directory)
        self.num_slots = num_slots
        self.num_allocations = 0  # (re)mapped + pre-touched buffers, for tests and benchmarks
        self._buffers: dict[int, torch.Tensor] = {}
        self._pinned: dict[int, int] = {}
        self._pending: set[int] = set()  # written, not yet committed: never chosen for a write
        self._lock = threading.Lock()

    # -- files -------------------------------------------------------------------------------
    def _path(self, slot: int, suffix: str) -> Path:
        return self.directory / f"slot_{slot}.{suffix}"

    def _record(self, slot: int) -> dict | None:
        try:
            record = json.loads(self._path(slot, "json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return record if record.get("format") == _FORMAT else None

    def _buffer(self, slot: int, num_bytes: int, *, touch: bool) -> torch.Tensor:
        """The slot's mapped buffer, at least ``num_bytes`` long (grown and touched if not)."""
        buffer = self._buffers.get(slot)
        if buffer is not None and buffer.numel() >= num_bytes:
            return buffer
        path = self._path(slot, "data")
        existing = path.stat().st_size if path.exists() else 0
        size = max(num_bytes, existing, _ALIGN)
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=size)
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        if touch:
            buffer.zero_()  # pay the page faults now, not inside a later step's copy
            self.num_allocations += 1
        self._buffers[slot] = buffer
        return buffer

    # -- writing -----------------------------------------------------------------------------
    def _choose_slot(self) -> int:
        steps = {s: (r["step"] if (r := self._record(s)) else -1) for s in range(self.num_slots)}
        free = [s for s in range(self.num_slots) if s not in self._pinned and s not in self._pending]
        if not free:
            raise RuntimeError(f"all {self.num_slots} snapshot slots are pinned or awaiting commit; "
                               "commit the pending snapshot before writing the next")
        return min(free, key=lambda s: (steps[s], s))

    def write(self, step: int, tensors: Mapping[str, torch.Tensor],
              objects: Mapping[str, Any] | None = None) -> PendingSnapshot:
        """Copy ``tensors`` (CPU or device) into a free slot. Blocks only for the copy.

        The slot's previous commit record is removed first: until :meth:`commit`, the slot is invalid.
        """
        layout, num_bytes = _plan_layout(tensors)
        buffer_objects = io.BytesIO()
        torch.save(dict(objects or {}), buffer_objects)
        with self._lock:
            slot = self._choose_slot()
            self._pending.add(slot)
        try:
            self._path(slot, "json").unlink(missing_ok=True)
            if slot not in self._buffers or self._buffers[slot].numel() < num_bytes:
                # Size every slot at once: the first snapshot is the cold one, later ones only copy.
                # A slot holding a committed snapshot is left alone (touching zeroes it).
                for other in range(self.num_slots):
                    if other == slot or (other not in self._pinned and other not in self._pending
                                        and self._record(other) is None):
                        self._buffer(other, num_bytes, touch=True)
            buffer = self._buffers[slot]
            for entry, t in zip(layout, tensors.values()):
                _view(buffer, entry).copy_(t.detach())
        except BaseException:
            with self._lock:
                self._pending.discard(slot)
            raise
        return PendingSnapshot(slot=slot, step=step, layout=layout, num_bytes=num_bytes,
                               objects=buffer_objects.getvalue())

    def commit(self, pending: PendingSnapshot) -> SnapshotInfo:
        """Checksum the written data and publish the slot (atomic rename of its commit record)."""
        buffer = self._buffers[pending.slot]
        self._path(pending.slot, "objects").write_bytes(pending.objects)
        record = {
            "format": _FORMAT, "step": pending.step, "num_bytes": pending.num_bytes,
            "data_crc32": _crc32(buffer, pending.num_bytes),
            "objects_crc32": zlib.crc32(pending.objects), "objects_bytes": len(pending.objects),
            "layout": [[e.key, e.dtype, list(e.shape), e.offset, e.num_bytes] for e in pending.layout],
        }
        tmp = self._path(pending.slot, "json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._path(pending.slot, "json"))
        with self._lock:
            self._pending.discard(pending.slot)
        return SnapshotInfo(slot=pending.slot, step=pending.step, num_bytes=pending.num_bytes)

    def snapshot(self, step: int, tensors: Mapping[str, torch.Tensor],
                 objects: Mapping[str, Any] | None = None) -> SnapshotInfo:
        """``write`` then ``commit`` (synchronous; the flash checkpointer commits in the background)."""
        return self.commit(self.write(step, tensors, objects))

    # -- reading -----------------------------------------------------------------------------
    def committed(self) -> list[SnapshotInfo]:
        """Committed snapshots (commit record present), newest first. Not checksum-verified."""
        out = []
        for slot in range(self.num_slots):
            if (record := self._record(slot)) is not None:
                out.append(SnapshotInfo(slot=slot, step=int(record["step"]), num_bytes=int(record["num_bytes"])))
        return sorted(out, key=lambda i: -i.step)

    def load(self, slot: int, *, verify: bool = True) -> RestoredSnapshot | None:
        """The snapshot in ``slot`` if committed and (optionally) its checksums match, else None."""
        record = self._record(slot)
        if record is None:
            return None
        num_bytes = int(record["num_bytes"])
        path = self._path(slot, "data")
        if not path.exists() or path.stat().st_size < num_bytes:
            return None
        buffer = self._buffer(slot, num_bytes, touch=False)
        try:
            objects_raw = self._path(slot, "objects").read_bytes()
        except FileNotFoundError:
            return None
        if verify and (zlib.crc32(objects_raw) != record["objects_crc32"]
                       or _crc32(buffer, num_bytes) != record["data_crc32"]):
            return None
        layout = [TensorEntry(k, d, tuple(s), o, n) for k, d, s, o, n in record["layout"]]
        tensors = {e.key: _view(buffer, e) for e in layout}
        objects = torch.load(io.BytesIO(objects_raw), weights_only=True)
        return RestoredSnapshot(step=int(record["step"]), slot=slot, tensors=tensors, objects=objects)

    def restore(self, *, step: int | None = None, verify: bool = True) -> RestoredSnapshot | None:
        """The newest valid snapshot (or the one at ``step``), or None when there is none."""
        for info in self.committed():
            if step is not None and info.step != step:
                continue
            restored = self.load(info.slot, verify=verify)
            if restored is not None:
                return restored
        return None

    def pin_slot(self, slot: int) -> None:
        """Keep ``write`` away from ``slot`` until :meth:`unpin_slot` (e.g. while it is persisted)."""
        with self._lock:
            self._pinned[slot] = self._pinned.get(slot, 0) + 1

    def unpin_slot(self, slot: int) -> None:
        with self._lock:
            self._pinned[slot] -= 1
            if not self._pinned[slot]:
                del self._pinned[slot]

    @contextlib.contextmanager
    def pin(self, slot: int) -> Iterator[None]:
        self.pin_slot(slot)
        try:
            yield
        finally:
            self.unpin_slot(slot)

    def discard_after(self, step: int) -> list[int]:
        """Invalidate committed snapshots newer than ``step`` (after a rollback); returns their steps."""
        dropped = []
        for info in self.committed():
            if info.step > step and info.slot not in self._pinned:
                self._path(info.slot, "json").unlink(missing_ok=True)
                dropped.append(info.step)
        return dropped

    def destroy(self) -> None:
        """Delete this rank's slots (the job finished; frees the shared memory)."""
        self._buffers.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def open_node_snapshot_store(job: str, rank: int, *, num_slots: int = 2) -> SnapshotStore:
    """In a Ray worker: this rank's :class:`SnapshotStore` under the root owned by its node's
    snapshot actor (created on first use). The files are then accessed directly, not via Ray."""
    import ray

    root = ray.get(get_or_create_snapshot_actor().root.remote())
    return SnapshotStore(root, job=job, rank=rank, num_slots=num_slots)
