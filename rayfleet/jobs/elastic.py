"""Elastic training: re-form a job on the live fleet when a node is lost or capacity returns.

Design decisions:
- The job driver owns elasticity, not Ray Train's ``(min, max)`` workers: a new size means a
  new *plan* (the degrees, the micro-batches per replica) and a new *layout* (which rail each
  rank sits on), which only the planner can give. So each formation is one Ray Train ``fit`` of
  a fixed layout; between formations the driver re-observes the fleet and re-plans. Worker
  deaths inside a formation stay Ray Train's business (group restart, restore from shared
  memory); a formation ends when
  * a node of its layout dies: Ray Train would keep trying to place the pinned workers there,
    so the watcher aborts the run by killing this job's Train controller, or
  * the fleet can hold a larger formation: the watcher raises the job's ``ElasticSignal``;
    every rank polls it after each step and all stop after the same step (the flash hook
    flushes the newest state to storage on the way out).
- The next formation restores from the job's one checkpoint URI: DCP reshards model and
  optimizer to the new world size, and the data position is global, so no sample is skipped or
  repeated across a resize.
- ``choose_world_size`` is a pure function (tested without Ray): the largest size within
  ``[min_workers, max_workers]`` that the free accelerators hold, in whole model replicas.
- The shared autoscaler reaches the job through ``AutoscalerShell`` (last section): it reports
  the job to the fleet controller and turns the controller's Shrink/GrowTraining decisions into
  the same stop-after-a-step-and-re-form as above, planning around the accelerators it lent.
  While the controller's autoscaler runs, it alone grows the job (the watcher's own
  grow-on-free-capacity is off), so two loops never disagree about the job's size.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.spec import TrainJobSpec

__all__ = ["choose_world_size", "ElasticSignal", "run_elastic", "FormationEnd", "AutoscalerShell"]

WATCH_INTERVAL_S = 1.0
REPORT_INTERVAL_S = 1.0  # the training shell's report/inbox period
MAX_FORMATIONS = 20  # a guard against flapping capacity, not a tuning knob


def choose_world_size(free: int, *, min_workers: int, max_workers: int, replica_size: int = 1) -> int | None:
    """Largest world size ``<= min(free, max_workers)``, a multiple of ``replica_size``, ``>= min_workers``.

    >>> choose_world_size(7, min_workers=2, max_workers=8, replica_size=2)
    6
    >>> choose_world_size(1, min_workers=2, max_workers=8) is None
    True
    """
    top = min(free, max_workers)
    size = top - top % max(1, replica_size)
    return size if size >= min_workers and size > 0 else None


class ElasticSignal:
    """A flag every rank polls after each step (a detached-free, ``num_cpus=0`` Ray actor)."""

    def __init__(self) -> None:
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = reason

    def clear(self) -> None:
        self.reason = ""

    def should_stop(self) -> bool:
        return bool(self.reason)

    def get(self) -> str:
        return self.reason


@dataclass(frozen=True)
class FormationEnd:
    """Why a formation ended: ``finished``, ``grow`` (stopped to take more accelerators) or ``node_lost``."""

    kind: str
    detail: str = ""


def _free_for(spec: TrainJobSpec, topology: Any, held: set, cordoned: set) -> int:
    accelerator = spec.resources.accelerator
    return sum(1 for n in topology.nodes if n.name not in cordoned and n.accelerator_type == accelerator
               for s in n.slots if s not in held)


def _launch_on_fleet(spec: TrainJobSpec, observed: tuple, *, lent: tuple = (), max_size: int | None = None) -> Any:
    """The largest launch of ``spec`` the observed fleet holds (elastic), else its fixed size.
    ``lent``: slots the autoscaler lent away (planned around); ``max_size``: its target size."""
    from rayfleet.jobs.launcher import prepare_launch

    topology, held, cordoned = observed
    held = set(held) | set(lent)
    elastic = spec.resources.elastic
    if elastic is None:
        return prepare_launch(spec, topology, held=held, cordoned=cordoned)
    replica = spec.plan.replica_size if spec.plan is not None else 1
    top = elastic.max_workers if max_size is None else max(elastic.min_workers, min(max_size, elastic.max_workers))
    size = choose_world_size(_free_for(spec, topology, held, cordoned), min_workers=elastic.min_workers,
                             max_workers=top, replica_size=replica)
    last_error: SpecError | None = None
    while size is not None and size >= elastic.min_workers:
        sized = spec.model_copy(update={"resources": spec.resources.model_copy(update={"num_workers": size})})
        try:
            return prepare_launch(sized, topology, held=held, cordoned=cordoned)
        except SpecError as err:  # e.g. the batch does not split over this many replicas: try smaller
            last_error = err
            size -= replica
    raise SpecError("resources.elastic.min_workers", elastic.min_workers,
                    f"the fleet cannot hold even the minimum formation ({last_error or 'too few free accelerators'})",
                    "free or add accelerators, or lower resources.elastic.min_workers")


def _kill_train_controller(log) -> bool:
    """Abort this job's Ray Train run by killing its controller (it runs on the driver's node)."""
    import ray
    from ray.util.state import list_actors

    from ray._private.worker import get_dashboard_url

    url = get_dashboard_url()
    job_id = ray.get_runtime_context().get_job_id()
    actors = list_actors(address=url if "://" in url else f"http://{url}", filters=[("class_name", "=", "TrainController"),
                                                              ("state", "=", "ALIVE"), ("job_id", "=", job_id)])
    for actor in actors:
        try:
            os.kill(actor.pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            continue
    log("rayfleet elastic: no live Train controller to abort")
    return False


def _remove_orphan_placement_groups(log) -> int:
    """Remove the placement groups an aborted formation left behind (this job's, not rayfleet's).

    Killing the Train controller stops its restart loop but not the group it was still trying
    to place: once the lost node returns, that group would hold its accelerators forever.
    """
    import ray
    from ray._private.worker import get_dashboard_url
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group
    from ray.util.state import list_placement_groups

    url = get_dashboard_url()
    job_id = ray.get_runtime_context().get_job_id()
    removed = 0
    for pg in list_placement_groups(address=url if "://" in url else f"http://{url}",
                                    filters=[("creator_job_id", "=", job_id)], detail=True, limit=1000):
        if pg.state == "REMOVED" or (pg.name or "").startswith("rayfleet:"):
            continue
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg.placement_group_id))))
        removed += 1
    if removed:
        log(f"rayfleet elastic: removed {removed} placement group(s) of the aborted formation")
    return removed


class _Watcher:
    """Watches the fleet during one formation; ends it on node loss or when it could grow."""

    def __init__(self, spec: TrainJobSpec, launch: Any, stop_signal: Any, log,
                 shell: "AutoscalerShell | None" = None) -> None:
        self.spec, self.launch, self.stop_signal, self.log, self.shell = spec, launch, stop_signal, log, shell
        self.end: FormationEnd | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayfleet-elastic", daemon=True)

    def start(self) -> "_Watcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import ray

        from rayfleet.jobs.launcher import observe_fleet

        nodes = set(self.launch.layout.nodes())
        size = self.launch.layout.world_size
        while not self._halt.wait(WATCH_INTERVAL_S):
            try:
                alive = {n["Labels"].get("rayfleet.io/node") for n in ray.nodes() if n.get("Alive")}
                lost = sorted(nodes - alive)
                if lost:
                    self.end = FormationEnd("node_lost", f"node {', '.join(lost)} of the layout died")
                    self.log(f"rayfleet elastic: {self.end.detail}; aborting this formation to re-plan")
                    _kill_train_controller(self.log)
                    return
                elastic = self.spec.resources.elastic
                if elastic is None or size >= elastic.max_workers:
                    continue
                if self.shell is not None and self.shell.manages_growth:
                    continue  # the shared autoscaler decides when this job grows
                topology, held, cordoned = observe_fleet()
                mine = {(s.node, s.index) for s in self.launch.layout.rank_to_slot}
                held = {s for s in held if (s.node, s.index) not in mine}
                free = _free_for(self.spec, topology, held, cordoned)
                replica = self.spec.plan.replica_size if self.spec.plan is not None else 1
                bigger = choose_world_size(free, min_workers=elastic.min_workers, max_workers=elastic.max_workers,
                                           replica_size=replica)
                if bigger is not None and bigger > size:
                    self.end = FormationEnd("grow", f"the fleet now holds {bigger} workers (running {size})")
                    self.log(f"rayfleet elastic: {self.end.detail}; stopping after the next step to grow")
                    ray.get(self.stop_signal.set.remote(self.end.detail))
                    return
            except Exception as exc:  # noqa: BLE001 - a watcher hiccup must not kill the job
                self.log(f"rayfleet elastic: watcher: {exc}")


def _record(job: str, kind: str, cause: str, detail: dict) -> None:
    try:
        from rayfleet.platform.controller import get_controller

        get_controller().record_job_event.remote(job, kind, cause, detail)
    except Exception:  # noqa: BLE001 - a plain Ray cluster has no controller
        pass


def run_elastic(spec: TrainJobSpec, *, job_dir: str, max_failures: int, log) -> dict[str, Any]:
    """Run ``spec`` to completion through as many formations as the fleet requires."""
    import ray

    from rayfleet.jobs.launcher import fit_once, observe_fleet

    elastic = spec.resources.elastic is not None and spec.checkpoint is not None
    shell = AutoscalerShell.attach(spec, log) if elastic else None
    last: dict[str, Any] = {}
    try:
        for formation in range(MAX_FORMATIONS):
            if shell is not None:
                shell.wait_while_paused()
            version = shell.version if shell is not None else 0
            launch = _launch_on_fleet(spec, observe_fleet(), lent=shell.lent_slots() if shell else (),
                                      max_size=shell.target if shell else None)
            stop_signal = ray.remote(num_cpus=0)(ElasticSignal).remote() if elastic else None
            watcher = _Watcher(spec, launch, stop_signal, log, shell) if elastic else None
            if formation:
                log(f"rayfleet elastic: formation {formation} with {launch.layout.world_size} workers")
                _record(spec.name, "elastic_reform", f"formation {formation}",
                        {"workers": launch.layout.world_size, "plan": launch.plan.describe()})

            def started(_launch, watcher=watcher, stop_signal=stop_signal, launch=launch, version=version) -> None:
                watcher.start()
                if shell is not None:
                    shell.begin(launch, stop_signal, version)

            try:
                # the run directory's name also keys the ranks' shared-memory snapshots: unique per formation
                run_dir = os.path.join(job_dir, f"{os.path.basename(job_dir)}-f{formation}")
                last.update(fit_once(spec, launch, run_dir=run_dir,
                                     max_failures=max_failures, log=log, stop_signal=stop_signal,
                                     on_trainer_start=started if watcher else None,
                                     on_step=shell.on_step if shell is not None else None))
            except Exception as exc:
                if watcher is None:
                    raise
                watcher.stop()
                if shell is not None:
                    shell.between()
                if watcher.end is None or watcher.end.kind != "node_lost":
                    raise
                _record(spec.name, "node_lost", watcher.end.detail, {"workers": launch.layout.world_size})
                _remove_orphan_placement_groups(log)
                time.sleep(WATCH_INTERVAL_S)  # let the controller see the node gone before re-planning
                continue
            if watcher is not None:
                watcher.stop()
                resized = shell.between() if shell is not None else None
                if int(last.get("step", 0)) >= spec.steps:
                    return last  # finished: a resize that came with the last step is moot
                if watcher.end is not None and watcher.end.kind == "grow":
                    _record(spec.name, "grow", watcher.end.detail, {"workers": launch.layout.world_size})
                    continue
                if resized is not None:
                    continue
            return last
    finally:
        if shell is not None:
            shell.close()
    raise RayfleetError(f"elastic job {spec.name} re-formed {MAX_FORMATIONS} times without finishing; "
                        "the fleet's capacity is flapping. Fix: stabilize the fleet or narrow resources.elastic")


# -- the shared autoscaler's training shell ------------------------------------------------------------


def replica_slots(launch: Any) -> list[list[Any]]:
    """Slots of each DP replica of a launch, replica ``i`` = the ranks whose dp coordinate is ``i`` (pure)."""
    plan, slots = launch.layout.plan, launch.layout.rank_to_slot
    out: list[list[Any]] = [[] for _ in range(plan.dp)]
    for rank, slot in enumerate(slots):
        out[plan.coords(rank).dp].append(slot)
    return out


class AutoscalerShell:
    """This job's side of the shared autoscaler (a thread in the job driver).

    Every ``interval_s`` it reports a ``TrainingObservation`` (size, bounds, class, the nodes of
    each DP replica, the last flash snapshot) to the fleet controller and takes the decisions in
    the job's inbox:
    - ``ShrinkTraining``: the named DP replicas' slots are *lent* (the next formations plan
      around them), the target size drops, and the running formation's ``ElasticSignal`` is
      raised: all ranks stop after the same step, the flash hook flushes the state, and
      ``run_elastic`` re-forms at the smaller size, restoring with resharding. ``new_size == 0``
      (a whole preemption) pauses the job after that flush until a ``GrowTraining`` comes.
    - ``GrowTraining``: lent slots come back (those on the decision's nodes first), the target
      rises, and the formation is stopped the same way to re-form larger.
    A decision that arrives while a formation is being sized is not lost: ``version`` counts
    decisions and ``begin`` raises the new formation's signal at once when it moved.
    """

    def __init__(self, spec: TrainJobSpec, controller: Any, log, *, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.spec, self.controller, self.log, self.interval_s = spec, controller, log, interval_s
        self.target: int | None = None  # None: as large as the fleet holds
        self.version = 0  # decisions taken so far
        self.manages_growth = False
        self._lent: list[Any] = []
        self._lock = threading.RLock()
        self._launch: Any = None
        self._signal: Any = None
        self._resize: dict | None = None  # the decision that ends the running formation
        self._resized_at: tuple[float, str] | None = None  # decision time, description (until a formation begins)
        self._first_step_of: tuple[float, str] | None = None  # ... then until that formation's first step
        self._stop_pending = ""  # a stop to signal to the running formation (retried every tick)
        self._stepping = False  # the running formation has reported a step (its workers hold their accelerators)
        self._admitted = 0
        self._snapshot = (0, 0.0)  # (step, wall time) of the newest flash snapshot
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayfleet-autoscaler-shell", daemon=True)

    @classmethod
    def attach(cls, spec: TrainJobSpec, log) -> "AutoscalerShell | None":
        """A started shell, or ``None`` on a plain Ray cluster (no fleet controller)."""
        import ray

        try:
            from rayfleet.platform.controller import get_controller

            controller = get_controller()
            ray.get(controller.ping.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - no controller: nobody to report to
            return None
        shell = cls(spec, controller, log)
        shell._thread.start()
        return shell

    # -- called by run_elastic --------------------------------------------------------------
    def lent_slots(self) -> tuple:
        with self._lock:
            return tuple(self._lent)

    def begin(self, launch: Any, stop_signal: Any, version: int) -> None:
        """A formation started (sized when ``version`` decisions had been taken)."""
        with self._lock:
            self._launch, self._signal, self._resize, self._stepping = launch, stop_signal, None, False
            self._admitted = self._admitted or launch.layout.world_size
            moved = version != self.version
            # the resize's first step is this formation's first step
            self._first_step_of, self._resized_at = self._resized_at, None
        if moved:
            self._stop_pending = "a resize decision arrived while this formation was being sized"
        self._report()

    def between(self) -> dict | None:
        """The formation ended; returns the resize decision that ended it, if any."""
        with self._lock:
            resize, self._resize, self._launch, self._signal = self._resize, None, None, None
        return resize

    def wait_while_paused(self) -> None:
        """Block while the job is preempted whole (target 0), reporting all along."""
        while self.target == 0 and not self._halt.is_set():
            time.sleep(self.interval_s)

    def on_step(self, metrics: dict) -> None:
        step = int(metrics.get("step", 0))
        every = self.spec.checkpoint.every_n_steps if self.spec.checkpoint is not None else 0
        with self._lock:
            if every and step % every == 0:
                self._snapshot = (step, time.time())
            pending, self._first_step_of = self._first_step_of, None
            self._stepping = True
        if pending is not None:
            decided_at, what = pending
            size = self._launch.layout.world_size if self._launch is not None else 0
            cause = f"{what}: first step at {size} workers {time.time() - decided_at:.1f}s after the decision"
            self.log(f"rayfleet elastic: {cause}")
            _record_event(self.controller, f"job:{self.spec.name}", "autoscaler_training_resized", cause,
                          {"workers": size, "decision_to_step_s": round(time.time() - decided_at, 2)})

    def close(self) -> None:
        self._halt.set()
        self._thread.join(timeout=10)
        try:
            self.controller.report_training.remote(None, self.spec.name)
        except Exception:  # noqa: BLE001 - the controller may be gone at shutdown
            pass

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        import ray

        while not self._halt.wait(self.interval_s):
            try:
                self.manages_growth = bool(ray.get(self.controller.autoscaler_running.remote(), timeout=60))
                for decision in ray.get(self.controller.take_decisions.remote(self.spec.name), timeout=60):
                    self._apply(decision)
                if self._stop_pending:
                    self._stop_formation(self._stop_pending)
                self._report()
            except Exception as exc:  # noqa: BLE001 - a hiccup must not kill the job
                self.log(f"rayfleet elastic: autoscaler shell: {exc!r}")

    def _apply(self, decision: dict) -> None:
        kind, reason = decision["type"], decision["reason"]
        with self._lock:
            size = self._size()
            if kind == "ShrinkTraining":
                slots = replica_slots(self._launch) if self._launch is not None else []
                for index in decision["replicas"]:
                    if index < len(slots):
                        self._lent.extend(slots[index])
                self.target = int(decision["new_size"])
            elif kind == "GrowTraining":
                give_back = max(0, int(decision["new_size"]) - size)
                nodes = list(decision["nodes"])
                self._lent.sort(key=lambda s: s.node not in nodes)  # the decision's nodes come back first
                del self._lent[:give_back]
                self.target = int(decision["new_size"])
            else:
                return
            self.version += 1
            self._resized_at = (float(decision.get("decided_at") or time.time()),
                                f"{kind} {size}->{self.target}")
            self._resize = decision
            self._stop_pending = reason
        self.log(f"rayfleet elastic: autoscaler: {reason}")

    def _stop_formation(self, reason: str) -> None:
        import ray

        with self._lock:
            signal = self._signal
        if signal is not None:  # all ranks stop after the same step; the flash hook flushes
            ray.get(signal.set.remote(f"autoscaler: {reason}"), timeout=60)
        with self._lock:
            if self._signal is signal:
                self._stop_pending = ""

    def _size(self) -> int:
        return self._launch.layout.world_size if self._launch is not None else (self.target or 0)

    def _report(self) -> None:
        from rayfleet.platform.autoscaler_policy import TrainingObservation
        from rayfleet.platform.queues import JobClass

        elastic = self.spec.resources.elastic
        with self._lock:
            launch = self._launch
            if launch is None and self.target is None:
                return
            resizing = launch is None or self._resize is not None or not self._stepping
            if not resizing:
                size = launch.layout.world_size
                nodes = tuple(tuple(dict.fromkeys(s.node for s in r)) for r in replica_slots(launch))
            else:  # between formations, or stopping to resize: what the job is about to be
                size, nodes = self.target or 0, ()
            snap_step, snap_at = self._snapshot
            replica = self.spec.plan.replica_size if self.spec.plan is not None else 1
            observation = TrainingObservation(
                job_id=self.spec.name, queue=self.spec.queue, accelerator_type=self.spec.resources.accelerator,
                job_class=JobClass.ELASTIC, size=size, min_size=elastic.min_workers, max_size=elastic.max_workers,
                replica_size=replica, replica_nodes=nodes, priority=self.spec.priority,
                admitted_size=self._admitted or size, last_snapshot_step=snap_step, last_snapshot_at_s=snap_at,
                resizing=resizing)
        self.controller.report_training.remote(observation)


def _record_event(controller: Any, subject: str, kind: str, cause: str, detail: dict) -> None:
    try:
        controller.record_event.remote(subject, kind, cause, detail)
    except Exception:  # noqa: BLE001 - events are best effort
        pass
