"""Flash checkpoints: snapshot into node-local shared memory every N steps, persist every M-th
snapshot to storage in the background, restore from shared memory when valid else from storage.

The train loop's hook is :class:`~rayfleet.jobs.checkpoint.hook.FlashCheckpointHook`;
restoring from shared memory is :mod:`rayfleet.jobs.checkpoint.restore`. Plugging it into a train
loop (one instance per rank, constructed on every rank)::

    ckpt = FlashCheckpointer(snapshot_every=10, persist_every=5, store=SnapshotStore(job=j, rank=r),
                             checkpoint_uri="s3://bucket/job", keep=3)
    result = ckpt.restore(CheckpointState(sharded={"model": msd, "optim": osd}))   # at start
    ...after each optimizer step:
    ckpt.after_step(step, lambda: CheckpointState(sharded=..., rank_local={"data": pos, "rng": ...}))
    ...on shutdown / preemption:  ckpt.flush();  ckpt.close()

Design decisions:
- Only the copy into pre-touched shared memory blocks the step. The CRC and commit record
  (commit thread) and the write to storage (persist thread) run in the background, on the
  shared-memory copy, so training may change its tensors right after ``after_step`` returns.
- The *same steps* are snapshotted and persisted on every rank (``step % snapshot_every == 0``;
  every ``persist_every``-th of those is persisted), because a persist is a collective DCP save.
  At most one persist is in flight; if the next one is due before it ends, ``after_step`` waits
  (counted in ``stats.persist_wait_s``): skipping would need the ranks to agree, waiting does not.
- Background persists use a gloo process group of their own, created at construction (a
  collective: construct on every rank), because collectives of two threads on the training group
  would interleave.
- Restore is collective too: ranks all-gather the steps they hold in shared memory and try the
  common ones newest first; a step is taken only when every rank verified its snapshot (CRC) and
  found the layout of its template (a MIN all-reduce of a success flag). Otherwise all ranks fall
  back to storage (DCP reshards to the current world size). A rank whose node changed has no
  snapshot, so the whole group uses storage — never a mix of steps.
- State is a pytree: tensor leaves (DTensor -> its local shard) go to the shared-memory slots,
  everything else (optimizer hyper-parameters, ``rank_local``) into the snapshot's small
  objects blob. DTensor metadata (mesh, placements, global shape) is kept in memory to rebuild
  DTensors for the reshardable persist; a restore from shared memory requires the same layout
  (same tree, same local shapes), which a same-size restart has.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from rayfleet.errors import SpecError
from rayfleet.jobs.checkpoint.restore import CheckpointState, RestoreResult, restore_from_shm
from rayfleet.platform.snapshot import PendingSnapshot, RestoredSnapshot, SnapshotStore
from rayfleet.storage.checkpoint import (
    CheckpointInfo, discard_checkpoints_after, list_checkpoints, load_checkpoint, save_checkpoint,
)

# CheckpointState and RestoreResult live with the restore code; they are part of this API.
__all__ = ["CheckpointState", "SnapshotEvent", "RestoreResult", "FlashCheckpointStats", "FlashCheckpointer"]


@dataclass(frozen=True)
class SnapshotEvent:
    """One snapshot taken by ``after_step``: how long it blocked the step, whether it was the
    cold (allocating) one, and whether a persist of it was scheduled."""

    step: int
    blocking_s: float
    cold: bool
    persist_scheduled: bool
    persist_wait_s: float


@dataclass
class FlashCheckpointStats:
    blocking_s: list[float] = field(default_factory=list)
    persist_s: list[float] = field(default_factory=list)
    persist_wait_s: float = 0.0
    persisted_steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _DTensorMeta:
    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


def _dtensor_over(local: torch.Tensor, meta: _DTensorMeta) -> DTensor:
    """A DTensor whose local shard is ``local`` (a shared-memory view), for DCP to save."""
    if meta.mesh.device_type == local.device.type:
        return DTensor.from_local(local, meta.mesh, meta.placements, run_check=False,
                                  shape=meta.shape, stride=meta.stride)
    # A GPU mesh over a CPU shard: ``from_local`` would copy the whole shard back to the GPU.
    # The internal constructor keeps it on the CPU (DCP only reads the chunk metadata and the
    # bytes). Not exercised on CPU-only machines.
    spec = DTensorSpec(meta.mesh, meta.placements,
                       tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


class FlashCheckpointer:
    """Flash checkpoints for one rank. Not thread-safe: call from the train loop's thread."""

    def __init__(self, *, snapshot_every: int, persist_every: int, store: SnapshotStore | None,
                 checkpoint_uri: str | None, keep: int = 3,
                 process_group: dist.ProcessGroup | None = None) -> None:
        for name, value in (("snapshot_every", snapshot_every), ("persist_every", persist_every), ("keep", keep)):
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"checkpoint.{name}", value, "must be an int >= 1", f"set checkpoint.{name}: 1 or more")
        if store is None and checkpoint_uri is None:
            raise SpecError("checkpoint", None, "neither a snapshot store nor a checkpoint_uri was given",
                            "give checkpoint.uri (storage) and/or a node snapshot store")
        self.snapshot_every, self.persist_every, self.keep = snapshot_every, persist_every, keep
        self.store, self.checkpoint_uri = store, checkpoint_uri
        self.stats = FlashCheckpointStats()
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        # Own group for background collectives (see module docstring); built collectively, now.
        if process_group is not None:
            self._group = process_group if self.world_size == 1 else dist.new_group(
                ranks=dist.get_process_group_ranks(process_group), backend="gloo")
        else:
            self._group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._commit_pool = ThreadPoolExecutor(1, thread_name_prefix="rayfleet-snapshot-commit")
        self._persist_pool = ThreadPoolExecutor(1, thread_name_prefix="rayfleet-persist")
        self._commit_future: Future | None = None
        self._persist_future: Future | None = None
        self._persist_lock = threading.Lock()
        self._last_snapshot: tuple[int, int, dict[int, _DTensorMeta], Any] | None = None  # step, slot, metas, treespec
        self._last_persisted_step: int | None = None

    # -- taking snapshots ------------------------------------------------------------------------
    def _persist_due(self, step: int) -> bool:
        return self.checkpoint_uri is not None and (step // self.snapshot_every) % self.persist_every == 0

    def after_step(self, step: int, state_fn: Callable[[], CheckpointState]) -> SnapshotEvent | None:
        """Snapshot when ``step`` is a multiple of ``snapshot_every`` (``state_fn`` is only called
        then); schedule a background persist for every ``persist_every``-th snapshot."""
        if step % self.snapshot_every:
            return None
        return self._snapshot(step, state_fn(), persist=self._persist_due(step))

    def _snapshot(self, step: int, state: CheckpointState, *, persist: bool) -> SnapshotEvent:
        start = time.perf_counter()
        self._wait_commit()  # the previous snapshot's slot must be committed before reusing slots
        wait_s = 0.0
        if persist:
            wait_s = self._wait_persist()
        leaves, treespec = pytree.tree_flatten(dict(state.sharded))
        tensors, metas, objects = {}, {}, {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DTensor):
                metas[i] = _DTensorMeta(leaf.device_mesh, tuple(leaf.placements), leaf.shape, tuple(leaf.stride()))
                tensors[str(i)] = leaf.to_local()
            elif isinstance(leaf, torch.Tensor):
                tensors[str(i)] = leaf
            else:
                objects[i] = leaf
        payload = {"objects": objects, "rank_local": dict(state.rank_local), "treespec": str(treespec)}
        if self.store is None:  # storage only: persist synchronously from the live state
            if persist:
                self._save(step, state.sharded, dict(state.rank_local))
            blocking = time.perf_counter() - start
            self.stats.blocking_s.append(blocking)
            return SnapshotEvent(step, blocking, False, persist, wait_s)
        allocations = self.store.num_allocations
        pending = self.store.write(step, tensors, payload)
        blocking = time.perf_counter() - start
        self.stats.blocking_s.append(blocking)
        self._last_snapshot = (step, pending.slot, metas, treespec)
        self._commit_future = self._commit_pool.submit(self._commit, pending, metas, treespec, persist)
        return SnapshotEvent(step, blocking, self.store.num_allocations > allocations, persist, wait_s)

    def _commit(self, pending: PendingSnapshot, metas: dict, treespec: pytree.TreeSpec, persist: bool) -> None:
        self.store.commit(pending)
        if persist:
            self.store.pin_slot(pending.slot)  # before the next write can choose it
            self._persist_future = self._persist_pool.submit(self._persist_slot, pending, metas, treespec)

    def _persist_slot(self, pending: PendingSnapshot, metas: dict, treespec: pytree.TreeSpec) -> None:
        try:
            snap = self.store.load(pending.slot, verify=False)
            assert snap is not None and snap.step == pending.step, "a pinned slot changed under the persister"
            sharded = self._tree_from_snapshot(snap, metas, treespec)
            self._save(snap.step, sharded, snap.objects["rank_local"])
        finally:
            self.store.unpin_slot(pending.slot)

    def _save(self, step: int, sharded: Mapping[str, Any], rank_local: dict) -> CheckpointInfo:
        start = time.perf_counter()
        with self._persist_lock:
            info = save_checkpoint(self.checkpoint_uri, step=step, sharded=sharded, rank_local=rank_local,
                                   process_group=self._group, keep=self.keep)
            self._last_persisted_step = step
        self.stats.persist_s.append(time.perf_counter() - start)
        self.stats.persisted_steps.append(step)
        return info

    @staticmethod
    def _tree_from_snapshot(snap: RestoredSnapshot, metas: dict, treespec: pytree.TreeSpec) -> Any:
        objects = snap.objects["objects"]
        leaves = []
        for i in range(treespec.num_leaves):
            if i in metas:
                leaves.append(_dtensor_over(snap.tensors[str(i)], metas[i]))
            elif str(i) in snap.tensors:
                leaves.append(snap.tensors[str(i)])
            else:
                leaves.append(objects[i])
        return pytree.tree_unflatten(leaves, treespec)

    def _wait_commit(self, timeout: float | None = None) -> None:
        if self._commit_future is not None:
            self._commit_future.result(timeout)  # re-raises a background failure here, in the loop

    def wait_committed(self, timeout: float | None = None) -> int | None:
        """Wait until the newest snapshot is committed (restorable from shared memory), not for
        any persist. Returns its step (None before the first snapshot). Raises
        ``TimeoutError`` after ``timeout`` seconds and re-raises a failed background commit."""
        self._wait_commit(timeout)
        return self._last_snapshot[0] if self._last_snapshot is not None else None

    def _wait_persist(self) -> float:
        start = time.perf_counter()
        self._wait_commit()
        if self._persist_future is not None:
            self._persist_future.result()
        waited = time.perf_counter() - start
        self.stats.persist_wait_s += waited
        return waited

    def flush(self, step: int | None = None, state_fn: Callable[[], CheckpointState] | None = None
              ) -> int | None:
        """Persist the newest snapshot now and wait for it (collective; call on every rank at
        shutdown or preemption). With ``step`` and ``state_fn``, snapshot the current state first.
        Returns the persisted step, or None when there is nothing to persist."""
        if step is not None and state_fn is not None and (self._last_snapshot is None or self._last_snapshot[0] != step):
            self._snapshot(step, state_fn(), persist=False)
        self._wait_persist()
        if self.checkpoint_uri is None or self._last_snapshot is None:
            return self._last_persisted_step
        last_step, slot, metas, treespec = self._last_snapshot
        if self._last_persisted_step != last_step:
            self.store.pin_slot(slot)
            self._persist_slot(PendingSnapshot(slot, last_step, (), 0, b""), metas, treespec)
        return self._last_persisted_step

    def close(self) -> None:
        """Wait for background work and stop the threads (does not flush)."""
        try:
            self._wait_persist()
        finally:
            self._commit_pool.shutdown(wait=True)
            self._persist_pool.shutdown(wait=True)

    # -- restoring -------------------------------------------------------------------------------
    def restore(self, template: CheckpointState, *, prefer: Literal["shm", "storage"] = "shm",
                at_most_step: int | None = None) -> RestoreResult:
        """Fill ``template.sharded`` (laid out for the current world) from the newest snapshot all
        ranks hold in shared memory, else from the latest committed checkpoint in storage.
        Collective: call on every rank.

        ``at_most_step`` is for rollbacks (``RollbackDecision.restore_at_most_step``): only steps
        up to it are considered, and newer snapshots and checkpoints are discarded afterwards so
        that the abandoned timeline never becomes "latest" again.
        """
        self._wait_persist()  # a persist in flight must not race the discard or the load
        reason = "prefer='storage'"
        result = None
        if prefer == "shm":
            result, reason = restore_from_shm(self.store, template, at_most_step, group=self._group,
                                              world_size=self.world_size)
        if result is None:
            result = self._restore_from_storage(template, at_most_step, reason)
        if at_most_step is not None and result.step is not None:
            if self.store is not None:
                self.store.discard_after(result.step)
            if self.checkpoint_uri is not None and self.rank == 0:
                discard_checkpoints_after(self.checkpoint_uri, result.step)
            if self.world_size > 1:
                dist.barrier(group=self._group)
        return result

    def _restore_from_storage(self, template: CheckpointState, at_most_step: int | None, reason: str) -> RestoreResult:
        committed = [c.step for c in list_checkpoints(self.checkpoint_uri)] if self.checkpoint_uri else []
        eligible = [s for s in committed if at_most_step is None or s <= at_most_step]
        if not eligible:
            return RestoreResult("none", None, template.sharded, None, {},
                                 reason + "; no committed checkpoint in storage" +
                                 (f" at or before step {at_most_step}" if at_most_step is not None else ""))
        sharded = dict(template.sharded)
        with torch.no_grad():  # templates may hold parameters that require grad
            loaded = load_checkpoint(self.checkpoint_uri, sharded=sharded, step=max(eligible),
                                     process_group=self._group)
        self._last_persisted_step = loaded.info.step
        return RestoreResult("storage", loaded.info.step, sharded, loaded.rank_local, loaded.rank_local_by_rank, reason)
