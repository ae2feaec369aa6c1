"""The shared autoscaler's home inside the fleet controller: reports in, decisions out.

Design decisions:
- The shells (training jobs, Serve deployments) *report* small observation dataclasses and
  *take* their decisions from an inbox; the controller never imports their internals, and they
  never see its state. Reports older than ``report_ttl_s`` are ignored: a shell whose driver
  died must not steer the policy forever.
- Decisions stay typed end to end: the inbox holds ``InboxEntry(decision, decided_at_s)`` with
  the policy's frozen decision objects, which pickle across the Ray boundary; each shell
  dispatches on the decision's type with ``match``. Only the event log flattens them.
- Nothing here imports Ray: the controller passes in what needs it (``free_accelerators``,
  ``request_nodes``, ``record``), so this class runs as-is in unit tests and notebooks.
- ``step`` is serialized (``_step_lock``): the loop's state threads through steps.
- Training jobs admitted through queues are governed by the controller's admission book
  (``attach_queues``): every observation carries how far each may grow by its queue's rules
  (``QueueGrowthLimits``), and every resize the policy decides is told to the book, so its
  quota accounting follows the job's size (a job grown above its quota is borrowing and can be
  reclaimed). Serve pools admitted through a queue (``ServeObservation.pool_key``) are told to
  the book the same way: what their replicas hold on every report, their new size on every
  ``ScaleServe``. Lock order: ``_step_lock`` -> the book's lock -> ``_lock``; the book is never
  called under ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Mapping, Protocol

from rayfleet.platform.autoscaler.lending import free_beside_serve
from rayfleet.platform.autoscaler.loop import AutoscalerLoop
from rayfleet.platform.autoscaler.policy import AutoscalerPolicy
from rayfleet.platform.autoscaler.types import (
    AutoscalerConfig, Decision, FleetObservation, GrowTraining, InboxEntry, QueueGrowthLimits, RequestNodes,
    ScaleServe, ServeObservation, ShrinkTraining, TrainingObservation, decision_subject,
)

__all__ = ["SharedAutoscaler", "QueueAccounts", "REPORT_TTL_S"]

log = logging.getLogger(__name__)
REPORT_TTL_S = 30.0

# (node -> free accelerators, node -> accelerator type) of the live, uncordoned nodes
FreeAccelerators = Callable[[], tuple[Mapping[str, int], Mapping[str, str]]]
Record = Callable[[str, str, str, dict], None]  # (subject, kind, cause, detail)


class QueueAccounts(Protocol):
    """What the autoscaler needs of the queues' admission book (see module doc)."""

    def growth_limits(self) -> QueueGrowthLimits: ...

    def resized(self, job_name: str, new_size: int, reason: str) -> bool: ...

    def pool_held(self, name: str, held: int) -> bool: ...


class SharedAutoscaler:
    """Reports, inboxes and the background loop of the shared autoscaler (thread-safe)."""

    def __init__(self, *, free_accelerators: FreeAccelerators, request_nodes: Callable[[RequestNodes], None],
                 record: Record, report_ttl_s: float = REPORT_TTL_S) -> None:
        self.free_accelerators, self.request_nodes, self.record = free_accelerators, request_nodes, record
        self.report_ttl_s = report_ttl_s
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self.serve: dict[str, ServeObservation] = {}
        self.training: dict[str, TrainingObservation] = {}
        self._reported_at: dict[str, float] = {}  # "serve/<name>" | "train/<id>" -> wall time
        self._inbox: dict[str, list[InboxEntry]] = defaultdict(list)
        self._loop: AutoscalerLoop | None = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._queues: QueueAccounts | None = None

    def attach_queues(self, queues: QueueAccounts) -> None:
        """Govern the growth of queue-admitted jobs by ``queues`` (the controller's admission book)."""
        self._queues = queues

    # -- the shells' side -----------------------------------------------------------------------
    def report_serve(self, observation: ServeObservation | None, deployment: str | None = None) -> None:
        with self._lock:
            name = deployment if observation is None else observation.deployment
            if observation is None:
                self.serve.pop(name, None)
            else:
                self.serve[name] = observation
            self._reported_at[f"serve/{name}"] = time.time()
        if observation is not None and observation.pool_key and self._queues is not None:  # not under _lock
            running = observation.running_replicas + observation.pending_replicas
            self._queues.pool_held(observation.pool_key, running * observation.accelerators_per_replica)

    def report_training(self, observation: TrainingObservation | None, job_id: str | None = None) -> None:
        with self._lock:
            job = job_id if observation is None else observation.job_id
            if observation is None:
                self.training.pop(job, None)
            else:
                self.training[job] = observation
            self._reported_at[f"train/{job}"] = time.time()

    def take(self, target: str) -> list[InboxEntry]:
        """Decisions for a job id or deployment name, oldest first; they leave the inbox."""
        with self._lock:
            return self._inbox.pop(target, [])

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- one step -------------------------------------------------------------------------------
    def gather(self, now: float) -> FleetObservation:
        """Free accelerators per node plus the shells' fresh reports."""
        free, types = self.free_accelerators()
        fresh = time.time() - self.report_ttl_s
        with self._lock:
            serve = tuple(o for n, o in self.serve.items() if self._reported_at.get(f"serve/{n}", 0) >= fresh)
            training = tuple(o for j, o in self.training.items() if self._reported_at.get(f"train/{j}", 0) >= fresh)
        limits = self._queues.growth_limits() if self._queues is not None else QueueGrowthLimits()
        return FleetObservation(now_s=now, free_by_node=dict(free), node_type=dict(types), serve=serve,
                                training=training, queue_limits=limits)

    def idle_by_type(self) -> dict[str, int]:
        """Idle accelerators per type for queue admission: free ones less the room kept for Serve
        replicas on their way (a job shrunk to lend one holds less, and its record says so, while
        the replica does not hold the accelerator yet)."""
        free, types = self.free_accelerators()
        fresh = time.time() - self.report_ttl_s
        with self._lock:
            serve = [o for n, o in self.serve.items() if self._reported_at.get(f"serve/{n}", 0) >= fresh]
        out: dict[str, int] = defaultdict(int)
        for node, count in free_beside_serve(free, serve).items():
            out[types[node]] += count
        return dict(out)

    def act(self, decision: Decision) -> None:
        """Carry out one of the policy's decisions; the queues' book learns a training job's new size."""
        self.carry_out(decision)
        match decision:
            case GrowTraining(job_id=job, new_size=size, reason=why) | ShrinkTraining(job_id=job, new_size=size,
                                                                                      reason=why):
                if self._queues is not None:
                    self._queues.resized(job, size, why)
            case ScaleServe(deployment=deployment, target_replicas=target, reason=why):
                with self._lock:
                    pool = self.serve.get(deployment)
                if self._queues is not None and pool is not None and pool.pool_key:
                    self._queues.resized(pool.pool_key, target * pool.accelerators_per_replica, why)

    def carry_out(self, decision: Decision) -> None:
        """Node requests go to Ray's autoscaler; every other decision to its shell's inbox."""
        match decision:
            case RequestNodes():
                self.request_nodes(decision)
            case _:
                with self._lock:
                    self._inbox[decision_subject(decision)].append(InboxEntry(decision, time.time()))

    def configure(self, config: Mapping | None = None) -> AutoscalerLoop:
        """The loop (built on first use); ``config`` replaces the policy and starts a fresh state."""
        with self._lock:
            if self._loop is None or config is not None:
                policy = AutoscalerPolicy(AutoscalerConfig(**(config or {})))
                self._loop = AutoscalerLoop(policy, gather=self.gather, act=self.act, record=self.record)
            return self._loop

    def step(self, now: float | None = None, *, gather=None, act=None) -> tuple[Decision, ...]:
        """One step; ``gather(now)``/``act(decision)`` may replace the built-in ones (tests, notebooks)."""
        loop = self.configure()
        now = time.time() if now is None else now
        with self._step_lock:
            if gather is None and act is None:
                return loop.step(now)
            once = AutoscalerLoop(loop.policy, gather=gather or loop.gather, act=act or loop.act,
                                  record=loop.record, state=loop.state)
            decisions = once.step(now)
            loop.state = once.state
            return decisions

    # -- the background loop --------------------------------------------------------------------
    def start(self, interval_s: float, config: Mapping | None = None, *, stopped: threading.Event) -> None:
        """Step every ``interval_s`` seconds until ``stop()`` (or ``stopped``, the controller's end)."""
        self.stop()
        self.configure(config)
        halt = self._halt = threading.Event()

        def run() -> None:
            while not halt.wait(interval_s) and not stopped.is_set():
                try:
                    self.step()
                except Exception:  # keep the loop alive through transient errors
                    log.exception("autoscaler step failed")

        self._thread = threading.Thread(target=run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop the loop and empty the inboxes (nobody would act on them). Returns whether one ran."""
        thread = self._thread
        if thread is None:
            return False
        self._halt.set()
        thread.join(timeout=30)
        self._thread = None
        with self._lock:
            self._inbox.clear()
        return True
