"""Flash checkpoints: snapshot into node-local shared memory every N steps, persist every M-th
snapshot to storage in the background, restore from shared memory when valid else from storage.

Plugging it into a train loop (one instance per rank, constructed on every rank)::

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
from rayfleet.jobs.health_policy import LossAnomalyPolicy, SlowRankPolicy
from rayfleet.jobs.train_state import TrainHooks, TrainState
from rayfleet.platform.snapshot import DEFAULT_SNAPSHOT_ROOT, PendingSnapshot, RestoredSnapshot, SnapshotStore
from rayfleet.storage.checkpoint import (
    CheckpointInfo, discard_checkpoints_after, list_checkpoints, load_checkpoint, save_checkpoint,
)

__all__ = ["CheckpointState", "SnapshotEvent", "RestoreResult", "FlashCheckpointStats", "FlashCheckpointer",
           "FlashCheckpointHook", "checkpoint_state_of", "train_state_of"]


@dataclass(frozen=True)
class CheckpointState:
    """What a rank checkpoints. ``sharded``: nested dict of DTensors/tensors/objects (model and
    optimizer state dicts, reshardable); ``rank_local``: this rank's small state (data position,
    RNG states, step), restored as is (see ``RestoreResult.rank_local``)."""

    sharded: Mapping[str, Any]
    rank_local: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotEvent:
    """One snapshot taken by ``after_step``: how long it blocked the step, whether it was the
    cold (allocating) one, and whether a persist of it was scheduled."""

    step: int
    blocking_s: float
    cold: bool
    persist_scheduled: bool
    persist_wait_s: float


@dataclass(frozen=True)
class RestoreResult:
    """Where a restore came from (``"shm"``, ``"storage"`` or ``"none"``) and at which step.

    ``sharded`` is the template tree with its tensors filled in place and non-tensor leaves
    replaced by the saved values: use it (e.g. ``set_state_dict``). ``rank_local`` is this rank's
    saved dict (None after a resize, then see ``rank_local_by_rank``). ``reason`` says why
    shared memory was not used when it was not.
    """

    source: Literal["shm", "storage", "none"]
    step: int | None
    sharded: Any
    rank_local: dict | None
    rank_local_by_rank: Mapping[int, dict]
    reason: str


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
        self._last_snapshot: tuple[int, int, dict[int, _DTensorMeta], Any] | None = None  # step, slot, metas, spec
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
        leaves, spec = pytree.tree_flatten(dict(state.sharded))
        tensors, metas, objects = {}, {}, {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DTensor):
                metas[i] = _DTensorMeta(leaf.device_mesh, tuple(leaf.placements), leaf.shape, tuple(leaf.stride()))
                tensors[str(i)] = leaf.to_local()
            elif isinstance(leaf, torch.Tensor):
                tensors[str(i)] = leaf
            else:
                objects[i] = leaf
        payload = {"objects": objects, "rank_local": dict(state.rank_local), "treespec": str(spec)}
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
        self._last_snapshot = (step, pending.slot, metas, spec)
        self._commit_future = self._commit_pool.submit(self._commit, pending, metas, spec, persist)
        return SnapshotEvent(step, blocking, self.store.num_allocations > allocations, persist, wait_s)

    def _commit(self, pending: PendingSnapshot, metas: dict, spec: Any, persist: bool) -> None:
        self.store.commit(pending)
        if persist:
            self.store.pin_slot(pending.slot)  # before the next write can choose it
            self._persist_future = self._persist_pool.submit(self._persist_slot, pending, metas, spec)

    def _persist_slot(self, pending: PendingSnapshot, metas: dict, spec: Any) -> None:
        try:
            snap = self.store.load(pending.slot, verify=False)
            assert snap is not None and snap.step == pending.step, "a pinned slot changed under the persister"
            sharded = self._tree_from_snapshot(snap, metas, spec)
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
    def _tree_from_snapshot(snap: RestoredSnapshot, metas: dict, spec: Any) -> Any:
        objects = snap.objects["objects"]
        leaves = []
        for i in range(spec.num_leaves):
            if i in metas:
                leaves.append(_dtensor_over(snap.tensors[str(i)], metas[i]))
            elif str(i) in snap.tensors:
                leaves.append(snap.tensors[str(i)])
            else:
                leaves.append(objects[i])
        return pytree.tree_unflatten(leaves, spec)

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
        last_step, slot, metas, spec = self._last_snapshot
        if self._last_persisted_step != last_step:
            self.store.pin_slot(slot)
            self._persist_slot(PendingSnapshot(slot, last_step, (), 0, b""), metas, spec)
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
            result, reason = _restore_from_shm(self, template, at_most_step)
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


# -- restore from shared memory ----------------------------------------------------------------
def _copy_snapshot_into(snap, template_sharded: Any) -> Any | None:
    """Copy a snapshot's tensors into the template's (local) tensors in place; return the tree with
    restored non-tensor leaves, or None when the layout differs (nothing is trusted then)."""
    leaves, spec = pytree.tree_flatten(dict(template_sharded))
    if str(spec) != snap.objects.get("treespec"):
        return None
    objects = snap.objects["objects"]
    targets = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            src = snap.tensors.get(str(i))
            dst = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            if src is None or src.shape != dst.shape or src.dtype != dst.dtype:
                return None
            targets.append((dst, src))
        elif i not in objects:
            return None
    with torch.no_grad():
        for dst, src in targets:
            dst.copy_(src)
    restored = [objects[i] if not isinstance(leaf, torch.Tensor) else leaf for i, leaf in enumerate(leaves)]
    return pytree.tree_unflatten(restored, spec)


def _all_ok(ok: bool, group, world_size: int) -> bool:
    if world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _restore_from_shm(ckpt: FlashCheckpointer, template: CheckpointState,
                      at_most_step: int | None) -> tuple[RestoreResult | None, str]:
    """Try the newest snapshot step held by every rank. Returns (result or None, reason)."""
    local_steps = [info.step for info in ckpt.store.committed()
                   if at_most_step is None or info.step <= at_most_step] if ckpt.store is not None else []
    if ckpt.world_size > 1:
        gathered: list[list[int]] = [None] * ckpt.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, local_steps, group=ckpt._group)
    else:
        gathered = [local_steps]
    common = sorted(set.intersection(*(set(steps) for steps in gathered)), reverse=True)
    if not common:
        missing = [r for r, steps in enumerate(gathered) if not steps]
        return None, (f"shm: ranks {missing} hold no snapshot" if missing else "shm: no step held by every rank")
    for step in common:
        snap = ckpt.store.restore(step=step, verify=True)
        tree = _copy_snapshot_into(snap, template.sharded) if snap is not None else None
        if _all_ok(tree is not None, ckpt._group, ckpt.world_size):
            rank_local = dict(snap.objects["rank_local"])
            return RestoreResult("shm", step, tree, rank_local, {}, "shm: newest step valid on every rank"), ""
    return None, f"shm: steps {common} failed verification or layout on some rank"


# -- the train loop's hook (rayfleet.jobs.loop.train_worker(hooks=...)) -----------------------------
def checkpoint_state_of(state: TrainState) -> CheckpointState:
    """A loop ``TrainState`` as checkpoint state: model/optimizer reshardable, the rest rank-local."""
    return CheckpointState(sharded={"model": state.model, "optim": state.optimizer},
                           rank_local={"step": state.step, "data": dict(state.data), "rng": dict(state.rng),
                                       "extra": dict(state.extra)})


def train_state_of(result: RestoreResult, *, rank: int) -> TrainState:
    """The ``TrainState`` to hand to the loop's ``load_fn`` after a restore.

    After a resize there is no own rank-local state: the data position is global (take rank 0's),
    and a rank that existed before keeps its RNG state (new ranks take rank 0's).
    """
    local = result.rank_local
    if local is None:
        by_rank = result.rank_local_by_rank
        local = {**by_rank[0], "rng": by_rank.get(rank, by_rank[0])["rng"]}
    return TrainState(step=int(result.step), model=result.sharded["model"], optimizer=result.sharded["optim"],
                      data=local["data"], rng=local["rng"], extra=local.get("extra", {}))


class FlashCheckpointHook(TrainHooks):
    """Flash checkpoints for ``train_worker``: restore at start, snapshot after steps, flush at the end.

    Pickles (only settings until ``on_start`` builds the checkpointer on its rank), so it can be
    passed to Ray Train workers. ``use_node_actor`` takes the shared-memory root from the node's
    :class:`~rayfleet.platform.snapshot.SnapshotStoreActor` (inside Ray); otherwise ``shm_root``
    is used directly (``None``: storage only). Checkpoint steps count completed steps
    (``TrainState.step``). With ``loss_policy``, a NaN or spiking loss rolls the run back (through
    ``load_fn``) to the newest snapshot before the bad step; with ``slow_rank_policy``, slow ranks
    are flagged from ``metrics["step_time_s_per_rank"]``. Decisions go to ``decisions`` and
    ``on_decision``.
    """

    def __init__(self, *, job: str, snapshot_every: int, persist_every: int, checkpoint_uri: str | None,
                 keep: int = 3, shm_root: str | None = DEFAULT_SNAPSHOT_ROOT, use_node_actor: bool = False,
                 restore: bool = True, prefer: Literal["shm", "storage"] = "shm",
                 loss_policy: LossAnomalyPolicy | None = None, slow_rank_policy: SlowRankPolicy | None = None,
                 on_decision: Callable[[Any], None] | None = None) -> None:
        self.job, self.snapshot_every, self.persist_every = job, snapshot_every, persist_every
        self.checkpoint_uri, self.keep, self.shm_root = checkpoint_uri, keep, shm_root
        self.use_node_actor, self.restore, self.prefer = use_node_actor, restore, prefer
        self.loss_policy, self.slow_rank_policy, self.on_decision = loss_policy, slow_rank_policy, on_decision
        self.checkpointer: FlashCheckpointer | None = None
        self.restored: RestoreResult | None = None
        self.events: list[SnapshotEvent] = []
        self.decisions: list[Any] = []  # health decisions, in order (the controller records them)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "checkpointer": None}  # threads and process groups stay on their rank

    def on_start(self, *, rank: int, world_size: int, plan: Any, step: int, state_fn: Callable[[], TrainState],
                 load_fn: Callable[[TrainState], None]) -> None:
        if self.use_node_actor:
            from rayfleet.platform.snapshot import open_node_snapshot_store
            store = open_node_snapshot_store(self.job, rank)
        else:
            store = SnapshotStore(self.shm_root, job=self.job, rank=rank) if self.shm_root else None
        self.checkpointer = FlashCheckpointer(snapshot_every=self.snapshot_every, persist_every=self.persist_every,
                                              store=store, checkpoint_uri=self.checkpoint_uri, keep=self.keep)
        if not self.restore:
            return
        self.restored = self.checkpointer.restore(checkpoint_state_of(state_fn()), prefer=self.prefer)
        if self.restored.step is not None and self.restored.step >= step:
            load_fn(train_state_of(self.restored, rank=rank))
            if rank == 0:  # one line in the job log per resume (tests and operators read it)
                print(f"rayfleet checkpoint: restored step {self.restored.step} from {self.restored.source} "
                      f"({self.restored.reason or 'snapshot verified on every rank'})", flush=True)

    def after_step(self, step: int, *, metrics: Mapping[str, Any], sample_ids: tuple[int, ...],
                   state_fn: Callable[[], TrainState], load_fn: Callable[[TrainState], None]) -> None:
        if self.slow_rank_policy is not None and "step_time_s_per_rank" in metrics:
            times = dict(enumerate(metrics["step_time_s_per_rank"]))
            for decision in self.slow_rank_policy.observe(step + 1, times):
                self._decide(decision)
        if self.loss_policy is not None and "loss" in metrics:
            # The loss is global (same on every rank), so every rank takes the same decision and
            # the collective restore below lines up. Checked before snapshotting the bad step.
            decision = self.loss_policy.observe(step + 1, float(metrics["loss"]))
            if decision is not None:
                self._decide(decision)
                result = self.checkpointer.restore(checkpoint_state_of(state_fn()),
                                                   at_most_step=decision.restore_at_most_step)
                if result.step is not None:
                    load_fn(train_state_of(result, rank=self.checkpointer.rank))
                    self.loss_policy.reset()
                return
        event = self.checkpointer.after_step(step + 1, lambda: checkpoint_state_of(state_fn()))
        if event is not None:
            self.events.append(event)

    def _decide(self, decision: Any) -> None:
        self.decisions.append(decision)
        if self.on_decision is not None:
            self.on_decision(decision)

    def on_end(self, summary: Any, *, state_fn: Callable[[], TrainState]) -> None:
        state = state_fn()  # also on a stop (preemption): the newest state reaches storage
        try:
            self.checkpointer.flush(state.step, lambda: checkpoint_state_of(state))
        finally:
            self.checkpointer.close()
