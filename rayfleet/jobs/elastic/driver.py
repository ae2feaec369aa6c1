"""The training job's driver: an explicit state machine over *formations* (no Ray in this file).

A formation is one Ray Train ``fit`` of a fixed layout. The driver owns elasticity, not Ray
Train's ``(min, max)`` workers: a new size means a new plan (degrees, micro-batches per replica)
and a new layout (which rail each rank sits on), which only the planner gives. So between
formations the driver re-observes the fleet and re-plans; worker deaths *inside* a formation
stay Ray Train's business (group restart, restore from shared memory).

States and transitions (Ray Train v2's controller is the model; every transition is logged as
``rayfleet elastic: A -> B (why)`` and kept in ``transitions``)::

    SCHEDULING --sized--> RUNNING --fit returned, steps done--> FINISHED
        |  ^                 |----a node of the layout died---> RECOVERING --cleaned up--> SCHEDULING
        |  |                 |----stopped to grow / resized---> RESIZING ----------------> SCHEDULING
        |  +--accelerators back-- PAUSED <--target 0 (preempted whole by the autoscaler)
        +--fleet cannot hold the minimum / flapping / fit failed--> ERRORED (raises)

Design decisions:
- Side effects live behind ``FormationRuntime`` (Ray: :mod:`rayfleet.jobs.elastic.formation`): observe
  the fleet, run one formation's ``fit`` with its watcher, clean up after an aborted one, record
  events. Decisions are the pure functions of :mod:`rayfleet.jobs.elastic.policy`. So the whole
  machine is unit-tested with a fake ``fit`` and no Ray.
- The next formation restores from the job's one checkpoint URI: DCP reshards model and
  optimizer to the new world size, and the data position is global, so no sample is skipped or
  repeated across a resize.
- The shared autoscaler reaches the job through its shell (:mod:`rayfleet.jobs.elastic.training_shell`):
  it lends accelerators (planned around), moves the target size, pauses the job at target 0,
  and stops a formation to re-form. While the controller's autoscaler runs, it alone grows the
  job (the watcher's own grow-on-free-capacity is off), so two loops never disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.elastic.policy import (CapacityShortage, DriverState, FormationEnd, after_formation,
                                         choose_world_size, size_formation)
from rayfleet.jobs.train_job import TrainJob
from rayfleet.platform.autoscaler.types import GrowTraining

__all__ = ["ElasticDriver", "FormationRuntime", "FormationOutcome", "Transition", "MAX_FORMATIONS"]

MAX_FORMATIONS = 20  # a guard against flapping capacity, not a tuning knob
RECOVERY_PAUSE_S = 1.0  # let the controller see a lost node gone before re-planning
# After a formation ends, Ray frees its accelerators asynchronously (workers exit, the placement
# group goes, the GCS's resource view catches up: seconds on a loaded host). A re-plan that
# finds too few free waits for them this many polls, RELEASE_POLL_S apart, before it errs.
RELEASE_POLLS = 120
RELEASE_POLL_S = 1.0
# A grow decision was made on accelerators the policy saw free, but the formation it ends (and a
# lent replica being removed) gives its own back asynchronously: a re-plan that fits only fewer
# workers than the decision's target waits this many polls for the rest before it forms smaller.
# Seen live (vLLM lend, 2026-11-29): the grow-back formed at 1 of 2 workers and the policy had to
# grow it again, a second stop, snapshot and worker-group start (about 30 s on 2 cores).
GROW_RELEASE_POLLS = 30


@dataclass(frozen=True)
class FormationOutcome:
    """How one formation's ``fit`` ended: its last metrics, why it was ended from outside (if it
    was), and the error it raised (if it did)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    end: FormationEnd | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Transition:
    source: DriverState
    target: DriverState
    reason: str


class FormationRuntime(Protocol):
    """The driver's side effects (Ray in production, plain functions in tests)."""

    def observe(self) -> tuple:
        """(topology, slots held by other work, cordoned node names) of the live fleet."""

    def prepare(self, job: TrainJob, topology: Any, *, world_size: int | None, held: set, cordoned: set) -> Any:
        """Plan and lay out ``job`` at ``world_size`` (``None``: its own) on the free fleet
        (``train_launcher.prepare_formation``)."""

    def run(self, launch: Any, *, run_dir: str, watch: bool, on_start: Callable[[Any], None],
            on_step: Callable[[dict], None] | None) -> FormationOutcome:
        """One ``fit`` of ``launch``; ``watch``: end it on node loss / growth; ``on_start(stop_signal)``
        once the trainer starts. Never raises: errors come back in the outcome."""

    def clean_up_aborted(self) -> None:
        """Release what an aborted formation left behind (its placement groups)."""

    def record(self, kind: str, cause: str, detail: dict) -> None:
        """An event about this job, recorded with the fleet controller (best effort)."""

    def pause(self, seconds: float) -> None: ...


class ElasticDriver:
    """Runs ``job`` to completion through as many formations as the fleet requires (see module doc)."""

    def __init__(self, job: TrainJob, runtime: FormationRuntime, *, job_dir: str, shell: Any = None,
                 log: Callable[[str], None] = print, max_formations: int = MAX_FORMATIONS) -> None:
        self.job, self.runtime, self.job_dir, self.shell, self.log = job, runtime, job_dir, shell, log
        self.max_formations = max_formations
        self.elastic = job.is_elastic
        self.state = DriverState.SCHEDULING
        self.transitions: list[Transition] = []
        self.formation = -1  # index of the current (or last) formation
        self.launch: Any = None
        self.version = 0  # the shell's decision count when the current formation was sized
        self.last: dict[str, Any] = {}
        self.outcome: FormationOutcome | None = None
        self.error: BaseException | None = None
        self.growing = False  # the next formation follows a grow decision (see GROW_RELEASE_POLLS)

    def run(self) -> dict[str, Any]:
        """The last metrics once FINISHED; raises the error that put the driver in ERRORED."""
        try:
            while True:
                match self.state:
                    case DriverState.SCHEDULING:
                        self._schedule()
                    case DriverState.PAUSED:
                        self.shell.wait_while_paused()
                        self.growing = True
                        self._to(DriverState.SCHEDULING, "the autoscaler gave accelerators back")
                    case DriverState.RUNNING:
                        self._run_formation()
                    case DriverState.RESIZING:
                        self._resize()
                    case DriverState.RECOVERING:
                        self._recover()
                    case DriverState.FINISHED:
                        return self.last
                    case DriverState.ERRORED:
                        raise self.error
        finally:
            if self.shell is not None:
                self.shell.close()

    # -- states ---------------------------------------------------------------------------------
    def _to(self, target: DriverState, reason: str) -> None:
        self.transitions.append(Transition(self.state, target, reason))
        self.log(f"rayfleet elastic: {self.state.value} -> {target.value} ({reason})")
        self.state = target

    def _fail(self, error: BaseException, reason: str) -> None:
        self.error = error
        self._to(DriverState.ERRORED, reason)

    def _schedule(self) -> None:
        shell = self.shell
        if self.formation + 1 >= self.max_formations:
            self._fail(RayfleetError(
                f"elastic job {self.job.name} re-formed {self.max_formations} times without finishing; the "
                "fleet's capacity is flapping. Fix: stabilize the fleet or narrow resources.elastic"),
                f"{self.max_formations} formations")
            return
        if shell is not None and shell.target_size == 0:
            self._to(DriverState.PAUSED, "preempted whole by the autoscaler")
            return
        self.version = shell.version if shell is not None else 0
        try:
            launch = self._size()
        except SpecError as err:
            self._fail(err, f"no formation fits: {err}")
            return
        self.formation += 1
        self.launch = launch
        size = launch.layout.world_size
        if self.formation:
            # the job log's one line per re-formation (tests and operators read it)
            self.log(f"rayfleet elastic: formation {self.formation} with {size} workers")
            self.runtime.record("elastic_reform", f"formation {self.formation}",
                                {"workers": size, "plan": launch.plan.describe()})
        self._to(DriverState.RUNNING, f"formation {self.formation}: {launch.plan.describe()} on {size} workers")

    def _size(self) -> Any:
        """``size_formation`` on a fresh look at the fleet; after a formation (``formation >= 0``)
        a capacity shortage is waited out for ``RELEASE_POLLS`` polls (see ``RELEASE_POLLS``), and
        after a grow decision a fleet short of its target for ``GROW_RELEASE_POLLS``."""
        shell = self.shell
        polls = RELEASE_POLLS if self.formation >= 0 else 0
        target, self.growing = self._grow_target(), False
        attempt = 0
        while True:
            at_least = target if attempt < GROW_RELEASE_POLLS else None
            try:
                return size_formation(self.job, self.runtime.observe(), prepare=self.runtime.prepare,
                                      lent=shell.lent_slots() if shell is not None else (),
                                      lent_placed=shell.placed_lent_slots() if shell is not None else (),
                                      max_size=shell.target_size if shell is not None else None, at_least=at_least)
            except CapacityShortage as err:
                if at_least is None and attempt >= polls:
                    raise
                if attempt == 0 or (target is not None and attempt == GROW_RELEASE_POLLS):
                    wait_s = (GROW_RELEASE_POLLS if at_least is not None else polls - attempt) * RELEASE_POLL_S
                    self.log(f"rayfleet elastic: waiting up to {wait_s:g}s for accelerators to be released ({err})")
                attempt += 1
                self.runtime.pause(RELEASE_POLL_S)

    def _grow_target(self) -> int | None:
        """The size a grow decision asked for (a valid size within the job's bounds), if one
        ended the last formation or ended a pause."""
        shell, elastic = self.shell, self.job.elastic
        if not self.growing or shell is None or not shell.target_size or elastic is None:
            return None
        return choose_world_size(shell.target_size, min_workers=elastic.min_workers, max_workers=elastic.max_workers,
                                 replica_size=self.job.replica_size)

    def _run_formation(self) -> None:
        shell, launch, version = self.shell, self.launch, self.version

        def started(stop_signal: Any) -> None:
            if shell is not None:
                shell.begin(launch, stop_signal, version)

        # the run directory's name also keys the ranks' shared-memory snapshots: unique per formation
        run_dir = os.path.join(self.job_dir, f"{os.path.basename(self.job_dir)}-f{self.formation}")
        outcome = self.outcome = self.runtime.run(
            launch, run_dir=run_dir, watch=self.elastic, on_start=started,
            on_step=shell.on_step if shell is not None else None)
        self.last.update(outcome.metrics)
        decision = shell.between() if shell is not None else None
        resized, self.growing = decision is not None, isinstance(decision, GrowTraining)
        target, reason = after_formation(step=int(self.last.get("step", 0)), steps=self.job.steps,
                                         end=outcome.end, resized=resized, failed=outcome.error is not None)
        if target is DriverState.ERRORED:
            self._fail(outcome.error, f"formation {self.formation} failed: {outcome.error!r}")
        else:
            self._to(target, reason)

    def _resize(self) -> None:
        end = self.outcome.end if self.outcome is not None else None
        if end is not None:  # the watcher stopped it to grow
            self.runtime.record(end.kind.value, end.detail, {"workers": self.launch.layout.world_size})
        else:  # the autoscaler's resize (its decision is the cause): when the formation let go, for handover timing
            self.runtime.record("formation_stopped", f"formation {self.formation} stopped to re-form",
                                {"workers": self.launch.layout.world_size, "step": int(self.last.get("step", 0))})
        self._to(DriverState.SCHEDULING, "re-plan at the new size")

    def _recover(self) -> None:
        self.runtime.record("node_lost", self.outcome.end.detail, {"workers": self.launch.layout.world_size})
        self.runtime.clean_up_aborted()
        self.runtime.pause(RECOVERY_PAUSE_S)
        self._to(DriverState.SCHEDULING, "re-plan on the nodes left")
