"""A training job's side of the shared autoscaler (a thread in the job's driver).

Built on the shells' common skeleton (:class:`~rayfleet.platform.autoscaler.shell.AutoscalerShellBase`:
take → apply → report). Every ``interval_s`` it reports a ``TrainingObservation`` (size, bounds,
class, the nodes of each DP replica, the last flash snapshot) and applies the typed decisions in
the job's inbox:

- ``ShrinkTraining``: the named DP replicas' slots are *lent* (the next formations plan around
  them), the target size drops, and the running formation's stop signal is raised: all ranks
  stop after the same step, the flash hook flushes the state, and the driver re-forms at the
  smaller size, restoring with resharding. ``new_size == 0`` (a whole preemption) pauses the job
  after that flush until a ``GrowTraining`` comes.
- ``GrowTraining``: lent slots come back (those on the decision's nodes first), the target
  rises, and the formation is stopped the same way to re-form larger.

A decision that arrives while a formation is being sized is not lost: ``version`` counts
decisions, and ``begin`` raises the new formation's signal at once when it moved. The time from
a decision to the first step at the new size is recorded as ``autoscaler_training_resized``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from rayfleet.jobs.elastic.policy import replica_slots
from rayfleet.jobs.train_job import TrainJob
from rayfleet.platform.autoscaler.shell import AutoscalerShellBase, RayChannel, ShellChannel
from rayfleet.platform.autoscaler.types import Decision, GrowTraining, ShrinkTraining, TrainingObservation
from rayfleet.platform.queues import JobClass

__all__ = ["TrainingShell", "REPORT_INTERVAL_S"]

REPORT_INTERVAL_S = 1.0


class TrainingShell(AutoscalerShellBase):
    """See module doc. The driver calls ``begin``/``between``/``on_step``/``wait_while_paused``."""

    observation_type = TrainingObservation

    def __init__(self, job: TrainJob, channel: ShellChannel, log: Callable[[str], None], *,
                 interval_s: float = REPORT_INTERVAL_S) -> None:
        super().__init__(channel, inbox=job.name, subject=f"job:{job.name}", interval_s=interval_s, log=log,
                         thread_name="rayfleet-autoscaler-shell")
        self.job = job
        self.target_size: int | None = None  # None: as large as the fleet holds
        self.version = 0  # decisions taken so far
        self.manages_growth = False
        self.governed = False  # admitted through a queue: growth beyond the grant is the controller's call
        self._lent: list[Any] = []
        self._lent_placed: set[Any] = set()  # lent before the running formation began: their borrowers run
        self._lock = threading.RLock()
        self._launch: Any = None
        self._signal: Any = None
        self._resize: Decision | None = None  # the decision that ends the running formation
        self._resized_at: tuple[float, str] | None = None  # decision time, description (until a formation begins)
        self._first_step_of: tuple[float, str] | None = None  # ... then until that formation's first step
        self._stop_pending = ""  # a stop to signal to the running formation (retried every tick)
        self._stepping = False  # the running formation has reported a step (its workers hold their accelerators)
        self._admitted = 0
        self._snapshot = (0, 0.0)  # (step, wall time) of the newest flash snapshot

    @classmethod
    def attach(cls, job: TrainJob, log: Callable[[str], None], *, target_size: int | None = None,
               governed: bool = False) -> "TrainingShell | None":
        """A started shell, or ``None`` on a plain Ray cluster (no fleet controller to report to).

        ``target_size``: the size the job's queue admitted it at (its formations stay within it);
        ``governed``: the queue admission, not the job's own watcher, decides when it grows."""
        import ray

        try:
            from rayfleet.platform.controller import get_controller

            controller = get_controller()
            ray.get(controller.ping.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - no controller: nobody to report to
            return None
        shell = cls(job, RayChannel(controller), log)
        shell.target_size, shell.governed = target_size, governed
        shell.manages_growth = governed
        return shell.start()

    # -- called by the driver -------------------------------------------------------------------
    def lent_slots(self) -> tuple:
        with self._lock:
            return tuple(self._lent)

    def placed_lent_slots(self) -> tuple:
        """Lent slots whose borrowers Ray already counts as taken.

        A Serve shell places its borrower only once the lender holds its new layout (its
        ``_wait_for_room``), so a slot lent before the running formation began is taken by
        then; one lent since is still free until this job re-forms around it.
        """
        with self._lock:
            return tuple(s for s in self._lent if s in self._lent_placed)

    def begin(self, launch: Any, stop_signal: Any, version: int) -> None:
        """A formation started (sized when ``version`` decisions had been taken)."""
        with self._lock:
            self._launch, self._signal, self._resize, self._stepping = launch, stop_signal, None, False
            self._lent_placed = set(self._lent)
            self._admitted = self._admitted or launch.layout.world_size
            if version != self.version:
                self._stop_pending = "a resize decision arrived while this formation was being sized"
            # the resize's first step is this formation's first step
            self._first_step_of, self._resized_at = self._resized_at, None
        self.report()

    def between(self) -> Decision | None:
        """The formation ended; returns the resize decision that ended it, if any."""
        with self._lock:
            resize, self._resize, self._launch, self._signal = self._resize, None, None, None
        return resize

    def wait_while_paused(self) -> None:
        """Block while the job is preempted whole (target 0); the thread reports all along."""
        while self.target_size == 0 and not self.stopped:
            time.sleep(self.interval_s)

    def on_step(self, metrics: dict) -> None:
        step = int(metrics.get("step", 0))
        every = self.job.checkpoint.every_n_steps if self.job.checkpoint is not None else 0
        with self._lock:
            if every and step % every == 0:
                self._snapshot = (step, time.time())
            pending, self._first_step_of = self._first_step_of, None
            self._stepping = True
            size = self._launch.layout.world_size if self._launch is not None else 0
        if pending is not None:
            decided_at, what = pending
            after_s = time.time() - decided_at
            cause = f"{what}: first step at {size} workers {after_s:.1f}s after the decision"
            self.log(f"rayfleet elastic: {cause}")
            self.event("autoscaler_training_resized", cause, {"workers": size, "decision_to_step_s": round(after_s, 2)})

    # -- the skeleton's steps ---------------------------------------------------------------------
    def before_take(self) -> None:
        self.manages_growth = self.governed or self.channel.autoscaler_running()

    def apply(self, decision: Decision, decided_at_s: float) -> None:
        with self._lock:
            size = self._size()
            match decision:
                case ShrinkTraining(new_size=new_size) if new_size == self.target_size:
                    return  # taken already (a controller restart sends unfinished queue reclaims again)
                case ShrinkTraining(replicas=replicas, new_size=new_size):
                    slots = replica_slots(self._launch.layout) if self._launch is not None else []
                    for index in replicas:
                        if index < len(slots):
                            self._lent.extend(slots[index])
                case GrowTraining(nodes=nodes, new_size=new_size):
                    give_back = max(0, new_size - size)
                    self._lent.sort(key=lambda s: s.node not in nodes)  # the decision's nodes come back first
                    del self._lent[:give_back]
                case _:
                    return
            self.target_size = int(new_size)
            self.version += 1
            self._resized_at = (decided_at_s, f"{type(decision).__name__} {size}->{self.target_size}")
            self._resize = decision
            self._stop_pending = decision.reason
        self.log(f"rayfleet elastic: autoscaler: {decision.reason}")

    def after_apply(self) -> None:
        if self._stop_pending:
            self._stop_formation(self._stop_pending)

    def observe(self) -> TrainingObservation | None:
        job, elastic = self.job, self.job.elastic
        assert elastic is not None  # a shell is attached to elastic jobs only
        with self._lock:
            launch = self._launch
            if launch is None and self.target_size is None:
                return None
            # Paused (preempted whole, between formations at target 0): it holds nothing and
            # re-forms only when grown, so it is not resizing; reporting it as resizing made the
            # policy hold back all growth, its own included (seen: never grown back).
            paused = launch is None and self.target_size == 0
            resizing = not paused and (launch is None or self._resize is not None or not self._stepping)
            if not resizing and not paused:
                size = launch.layout.world_size
                nodes = tuple(tuple(dict.fromkeys(s.node for s in r)) for r in replica_slots(launch.layout))
            else:  # paused, between formations, or stopping to resize: what the job is about to be
                size, nodes = self.target_size or 0, ()
            snap_step, snap_at = self._snapshot
            return TrainingObservation(
                job_id=job.name, queue=job.queue, accelerator_type=job.accelerator,
                job_class=JobClass(job.queue_class), size=size, min_size=elastic.min_workers, max_size=elastic.max_workers,
                replica_size=job.replica_size, replica_nodes=nodes, priority=job.priority, admitted_size=self._admitted or size,
                last_snapshot_step=snap_step, last_snapshot_at_s=snap_at, resizing=resizing)

    # -- helpers ------------------------------------------------------------------------------------
    def _stop_formation(self, reason: str) -> None:
        with self._lock:
            signal = self._signal
        if signal is not None:  # all ranks stop after the same step; the flash hook flushes
            signal.set(f"autoscaler: {reason}")
        with self._lock:
            if self._signal is signal:
                self._stop_pending = ""

    def _size(self) -> int:
        return self._launch.layout.world_size if self._launch is not None else (self.target_size or 0)
