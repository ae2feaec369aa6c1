"""The Ray side of the elastic driver: run one formation, watch it, abort it, clean up after it.

Design decisions:
- ``RayFormations`` is the production :class:`~rayfleet.jobs.elastic.driver.FormationRuntime`;
  the driver's decisions stay in :mod:`rayfleet.jobs.elastic.policy` and
  :mod:`rayfleet.jobs.elastic.driver`, the side effects are here.
- Ending a formation from outside, two ways:
  * a node of its layout dies: Ray Train would keep trying to place the pinned workers there,
    so the watcher aborts the run by SIGKILLing this job's Train controller (it runs on the
    driver's node), and afterwards the driver removes the placement group the controller was
    still trying to place (else, once the node returns, it would hold its accelerators forever);
  * the fleet could hold a larger formation, or the autoscaler resized the job: the stop flag of
    the formation's control actor (``jobs.formation_control``, which also carries rank 0's
    metrics rows) is raised and all ranks stop after the same step (the flash hook flushes the
    newest state to storage). Each rank's flag thread long-polls it, answered the moment it is raised.
- The watcher is a daemon thread; its decision each second is ``elastic.policy.watch_formation``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

from rayfleet.jobs.elastic.driver import ElasticDriver, FormationOutcome
from rayfleet.jobs.train_job import TrainJob
from rayfleet.jobs.elastic.policy import EndKind, FormationEnd, free_accelerators, watch_formation
from rayfleet.platform import labels as L
from rayfleet.platform.fleet_events import record_fleet_event

__all__ = ["RayFormations", "run_training", "kill_train_controller",
           "remove_orphan_placement_groups"]

WATCH_INTERVAL_S = 1.0


class _SignalRef:
    """The driver's handle on a formation's stop flag (its ``FormationControl`` actor; ``set`` waits for it)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def set(self, reason: str) -> None:
        import ray

        ray.get(self.actor.set.remote(reason), timeout=60)


def kill_train_controller(log: Callable[[str], None]) -> bool:
    """Abort this job's Ray Train run by killing its controller (it runs on the driver's node)."""
    import ray
    from ray.util.state import list_actors

    from rayfleet.platform.ray_compat import dashboard_url

    job_id = ray.get_runtime_context().get_job_id()
    actors = list_actors(address=dashboard_url(), filters=[("class_name", "=", "TrainController"),
                                                           ("state", "=", "ALIVE"), ("job_id", "=", job_id)])
    for actor in actors:
        try:
            os.kill(actor.pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            continue
    log("rayfleet elastic: no live Train controller to abort")
    return False


def remove_orphan_placement_groups(log: Callable[[str], None]) -> int:
    """Remove the placement groups an aborted formation left behind (this job's, not rayfleet's own
    ``rayfleet:``-named groups). Returns how many."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.state import list_placement_groups

    from rayfleet.platform.ray_compat import dashboard_url, placement_group_from_hex

    job_id = ray.get_runtime_context().get_job_id()
    removed = 0
    for pg in list_placement_groups(address=dashboard_url(), filters=[("creator_job_id", "=", job_id)],
                                    detail=True, limit=1000):
        if pg.state == "REMOVED" or (pg.name or "").startswith("rayfleet:"):
            continue
        remove_placement_group(placement_group_from_hex(pg.placement_group_id))
        removed += 1
    if removed:
        log(f"rayfleet elastic: removed {removed} placement group(s) of the aborted formation")
    return removed


class _Watcher:
    """Watches the fleet during one formation and ends it (see module doc)."""

    def __init__(self, job: TrainJob, launch: Any, stop_signal: Any, log: Callable[[str], None],
                 grows_itself: Callable[[], bool]) -> None:
        self.job, self.launch, self.stop_signal, self.log, self.grows_itself = job, launch, stop_signal, log, grows_itself
        self.end: FormationEnd | None = None
        # Set by the formation's first step: only then do its workers hold their accelerators, so
        # the live free counts ``_free_if_regrown`` reads no longer show them as free too (seen
        # before this flag: "the fleet now holds 4 workers (running 2)" on every re-formation).
        self.stepping = threading.Event()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayfleet-elastic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _free_if_regrown(self) -> int:
        from rayfleet.jobs.train_launcher import observe_fleet

        topology, held, cordoned = observe_fleet()  # held: by live counts, this formation's own too
        accelerator = self.job.accelerator
        kind = {n.name: n.accelerator_type for n in topology.nodes}
        mine = {(s.node, s.index) for s in self.launch.layout.rank_to_slot
                if s.node not in cordoned and kind.get(s.node) == accelerator}
        return free_accelerators(topology, accelerator=accelerator, held=held, cordoned=cordoned) + len(mine)

    def _run(self) -> None:
        import ray

        elastic, layout = self.job.elastic, self.launch.layout
        while not self._halt.wait(WATCH_INTERVAL_S):
            try:
                alive = {n["Labels"].get(L.NODE) for n in ray.nodes() if n.get("Alive")}
                end = watch_formation(
                    layout_nodes=layout.nodes(), alive_nodes=alive, size=layout.world_size,
                    min_workers=elastic.min_workers, max_workers=elastic.max_workers,
                    replica_size=self.job.replica_size,
                    free_if_regrown=self._free_if_regrown if self.grows_itself() and self.stepping.is_set() else None)
                if end is None:
                    continue
                self.end = end
                if end.kind is EndKind.NODE_LOST:
                    self.log(f"rayfleet elastic: {end.detail}; aborting this formation to re-plan")
                    kill_train_controller(self.log)
                else:
                    self.log(f"rayfleet elastic: {end.detail}; stopping after the next step to grow")
                    self.stop_signal.set(end.detail)
                return
            except Exception as exc:  # noqa: BLE001 - a watcher hiccup must not kill the job
                self.log(f"rayfleet elastic: watcher: {exc}")


class RayFormations:
    """The driver's side effects on a live Ray cluster (``FormationRuntime``)."""

    def __init__(self, job: TrainJob, *, max_failures: int, log: Callable[[str], None], shell: Any = None,
                 ticket: Any = None) -> None:
        self.job, self.max_failures, self.log, self.shell = job, max_failures, log, shell
        self.ticket = ticket  # the queue admission's ticket: told what each formation holds

    def observe(self) -> tuple:
        from rayfleet.jobs.train_launcher import observe_fleet

        return observe_fleet()

    def prepare(self, job: TrainJob, topology: Any, *, world_size: int | None, held: set, cordoned: set) -> Any:
        from rayfleet.jobs.train_launcher import prepare_formation

        return prepare_formation(job, topology, world_size=world_size, held=held, cordoned=cordoned)

    def run(self, launch: Any, *, run_dir: str, watch: bool, on_start: Callable[[Any], None],
            on_step: Callable[[dict], None] | None) -> FormationOutcome:
        import ray

        from rayfleet.jobs.train_launcher import fit_once, new_formation_control

        control = new_formation_control()  # rank 0's rows, and the stop flag when watched
        stop_signal = _SignalRef(control) if watch else None
        shell = self.shell
        watcher = _Watcher(self.job, launch, stop_signal, self.log,
                           grows_itself=lambda: shell is None or not shell.manages_growth) if watch else None

        def started(_launch: Any) -> None:
            watcher.start()
            on_start(stop_signal)

        ticket = self.ticket

        def stepped(row: dict) -> None:
            if watcher is not None:
                watcher.stepping.set()
            if ticket is not None:  # its first step: the formation's workers hold their accelerators
                ticket.holding(launch.layout.world_size)
            if on_step is not None:
                on_step(row)

        try:
            metrics = fit_once(launch, loop=self.job.loop, checkpoint=self.job.checkpoint, run_dir=run_dir,
                               max_failures=self.max_failures, log=self.log,
                               control=control, watch_stop=watch, on_trainer_start=started if watcher else None,
                               on_step=stepped if watcher or ticket else on_step)
        except Exception as exc:  # noqa: BLE001 - the driver decides (node lost: re-plan; else: fail)
            return FormationOutcome(end=self._stop(watcher), error=exc)
        finally:
            if ticket is not None:
                ticket.holding(0)
            self._free_snapshots(os.path.basename(run_dir.rstrip("/")))
        return FormationOutcome(metrics=metrics, end=self._stop(watcher))

    def _free_snapshots(self, run_name: str) -> None:
        """The formation's node snapshots (tmpfs, i.e. memory) once its ``fit`` returned: its
        worker restarts are over and the next formation restores from the persisted checkpoint."""
        from rayfleet.platform.snapshot_node import release_job_snapshots

        try:
            freed = release_job_snapshots(run_name)
        except Exception as exc:  # noqa: BLE001 - the job's outcome does not depend on it; the fleet's teardown frees them
            self.log(f"rayfleet checkpoint: could not free the snapshots of {run_name}: {exc!r}")
            return
        if freed:
            self.log(f"rayfleet checkpoint: freed {freed / 2**20:.1f} MiB of {run_name}'s node snapshots")

    @staticmethod
    def _stop(watcher: _Watcher | None) -> FormationEnd | None:
        if watcher is None:
            return None
        watcher.stop()
        return watcher.end

    def clean_up_aborted(self) -> None:
        remove_orphan_placement_groups(self.log)

    def record(self, kind: str, cause: str, detail: dict) -> None:
        record_fleet_event(f"job:{self.job.name}", kind, cause, detail)

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)


TRAIN_CONTROLLER_POLL_S = "0.5"


def run_training(job: TrainJob, *, storage_path: str | None = None, max_failures: int | None = None,
                 log: Callable[[str], None] = print, job_id: str | None = None) -> dict[str, Any]:
    """Admit ``job`` through its queue, then plan, lay out and train it (a validated spec's
    slices, ``train_job``) on the connected cluster; returns the last metrics.

    Admission (``jobs.admission_gate``) comes first, before any accelerator is asked of Ray: a job
    in a declared queue waits QUEUED until the fleet controller admits it, and an elastic one
    then runs at most at the size granted (its shell's target; the queue may shrink it later).
    ``job_id``: the Ray submission id its queue record is kept under.

    An elastic job (``resources.elastic`` + ``checkpoint``) is re-formed by the driver when a
    node of its layout is lost (smaller plan, checkpoint resharded), when capacity returns
    (larger plan) and when the shared autoscaler resizes it, until it finishes.
    """
    from rayfleet.jobs.admission_gate import AdmissionTicket
    from rayfleet.jobs.train_launcher import default_storage_path
    from rayfleet.jobs.elastic.training_shell import TrainingShell

    if max_failures is None:  # restarts only make sense when there is a snapshot to resume from
        max_failures = job.checkpoint.max_failures if job.checkpoint is not None else 0
    # Ray Train's controller (which takes this from the driver's environment) polls its workers
    # every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default: a formation's end, a worker group's
    # start and a failure are each seen up to one poll late, and a resize or lend waits for two of
    # them. 0.5 s cut kill -> next step from 11.5 to 9.7 s, for a status call twice a second. A
    # value the job's environment sets wins.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", TRAIN_CONTROLLER_POLL_S)
    # Ray Train's preemption watcher (an actor per worker group, polling the GCS for drained nodes
    # every 5 s) is off unless the job's environment turns it on: the fleet's node agents report
    # lost and cordoned nodes and this driver re-forms the job on them (ElasticDriver). It cost
    # 2 CPU s per job start on the local fleet, about 5% of a small job's.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    storage = storage_path or default_storage_path()
    job_dir = os.path.join(storage, f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if job.checkpoint is not None and job.checkpoint.uri is None:
        # one checkpoint location for every re-formation of the job
        job = job.with_checkpoint_uri(os.path.join(job_dir, "checkpoints"))
    ticket = AdmissionTicket.open(job, log, job_id=job_id or job.name)
    try:
        granted = ticket.wait() if ticket is not None else None
        shell = (TrainingShell.attach(job, log, target_size=granted, governed=ticket is not None)
                 if job.is_elastic else None)
        runtime = RayFormations(job, max_failures=max_failures, log=log, shell=shell, ticket=ticket)
        return ElasticDriver(job, runtime, job_dir=job_dir, shell=shell, log=log).run()
    finally:
        if ticket is not None:
            ticket.close()
