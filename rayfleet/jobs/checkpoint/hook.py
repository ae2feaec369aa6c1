"""Flash checkpoints in the train loop: ``FlashCheckpointHook`` (``train_worker(hooks=...)``).

Restore at start (shared memory, else storage), snapshot after steps, flush at the end (also on
a stop: a preempted or resized formation's newest state reaches storage). With health policies,
a NaN or spiking loss rolls the run back to the newest snapshot before the bad step and slow
ranks are flagged; the decisions go to ``on_decision`` (the worker records them with the fleet
controller).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping

from rayfleet.jobs.checkpoint.flash import FlashCheckpointer, SnapshotEvent
from rayfleet.jobs.checkpoint.restore import CheckpointState, RestoreResult
from rayfleet.jobs.health.policy import LossAnomalyPolicy, SlowRankPolicy
from rayfleet.jobs.train_state import TrainHooks, TrainState
from rayfleet.platform.snapshot import DEFAULT_SNAPSHOT_ROOT, SnapshotStore

__all__ = ["FlashCheckpointHook", "checkpoint_state_of", "train_state_of"]


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
