"""Run a training job on the fleet: plan → layout → Ray Train ``TorchTrainer`` on that layout.

Design decisions:
- Everything that can fail on the user's input (spec, dataset, plan against memory, fleet too
  small) is checked in the driver before the trainer starts, so a bad job never reserves an
  accelerator (``prepare_launch`` is pure given the observed fleet). The spec and its dataset
  were checked once at the job's edge; here the job is its slices (``train_job``): the launcher
  plans from ``PlanInputs`` and hands the workers the loop and checkpoint slices, pickled.
- Workers go where the layout says. Ray Train takes one ``label_selector`` per worker, which
  pins each worker's node (``rayfleet.io/node``); the accelerator index on that node is what
  Ray hands out, so on an idle node bundle order equals rail order. Ray Train then numbers
  workers by (node id, GPU id), so each worker re-forms the default process group with its
  layout rank (``worker_ranks``); the number of workers that landed on their planned rail is
  reported as ``rail_matches``.
- Uniform ``resources_per_worker`` (a Ray Train limit): a job uses one accelerator kind's Ray
  resource (GPU for NVIDIA, XPU/NPU as custom resources). A plan whose DP replicas mix kinds is
  launched with node selectors only and holds the accelerators through a reservation
  placement group named ``rayfleet:train:<job>`` (``accelerator_reservation``), so Ray's
  accounting and the inventory still count them; the elastic driver's clean-up of an aborted
  formation leaves ``rayfleet:`` groups alone (this one is removed when its ``fit`` ends).
- Ray Train's controller restarts the worker group on a failure (``FailureConfig``); resuming
  from snapshots is the flash-checkpoint layer's job.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.planning import PlanInputs, job_plan, world_size_of
from rayfleet.jobs.train_job import CheckpointSettings, LoopConfig, TrainJob
from rayfleet.placement.layout import Layout, build_layout
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import get_accelerator
from rayfleet.platform.topology import AcceleratorSlot, FleetTopology

__all__ = ["TrainLaunch", "prepare_launch", "prepare_formation", "scaling_options", "reservation_bundles", "accelerator_reservation",
           "observe_fleet", "fit_once", "default_storage_path", "driver_node_actor_options"]

RESERVATION_PREFIX = "rayfleet:train:"
RESERVATION_TIMEOUT_S = 120.0
MIXED_WORKER_CPU = 0.01  # what a worker of a mixed-kind launch asks for (see scaling_options)


def driver_node_actor_options() -> dict[str, Any]:
    """Ray actor options that pin a job's control actor (its elastic signal, its metrics queue) to
    the driver's node, as Ray Train pins its controller. A ``num_cpus=0`` actor left to Ray can land
    on any node, cordoned ones included; when that node is lost (CI once saw a loaded raylet
    declared dead) the job loses its signal or its metrics while its workers live on, and never
    grows back. On the driver's node the actor shares the driver's fate: no new way to fail."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


@dataclass(frozen=True)
class TrainLaunch:
    """What the driver decided before starting any worker: job ``name``, its plan and layout."""

    name: str
    plan: ParallelPlan
    layout: Layout

    @property
    def slots(self) -> list[tuple[str, int]]:
        return [(s.node, s.index) for s in self.layout.rank_to_slot]

    def describe(self) -> str:
        nodes = ", ".join(f"{n}×{sum(1 for s in self.layout.rank_to_slot if s.node == n)}"
                          for n in self.layout.nodes())
        return f"{self.name}: {self.plan.describe()} on {self.layout.world_size} workers ({nodes})"


def prepare_launch(planning: PlanInputs, topology: FleetTopology, *, name: str, world_size: int | None = None,
                   held: set[AcceleratorSlot] = frozenset(), cordoned: set[str] = frozenset()) -> TrainLaunch:
    """Plan and lay out job ``name`` on the free part of ``topology`` (pure).

    ``world_size`` (an elastic formation's size) overrides the job's own (``resources.num_workers``,
    else the explicit plan's size, else every free accelerator).

    Raises:
        SpecError: the plan does not fit, or the fleet lacks the accelerators (naming the spec
            field that fixes it).
    """
    accelerator = planning.accelerator
    kinds = planning.accelerator_types  # a mixed plan (``plan.replica_accelerators``) runs on every kind it names
    free = sum(1 for n in topology.nodes if n.name not in cordoned and n.accelerator_type in kinds
               for s in n.slots if s not in held)
    world = world_size if world_size is not None else world_size_of(planning)
    if world is None:
        world = free
    if world > free:
        raise SpecError("resources.num_workers", world,
                        f"the fleet has {free} free {'/'.join(sorted(kinds))} accelerators",
                        "lower resources.num_workers (or the plan's degrees), or add/uncordon nodes")
    plan = job_plan(planning, world_size=world, accelerator=accelerator).plan
    layout = build_layout(plan, topology, held=held, cordoned=cordoned,
                          accelerator_type=None if plan.replica_accelerators else accelerator)
    return TrainLaunch(name=name, plan=plan, layout=layout)


def prepare_formation(job: TrainJob, topology: FleetTopology, *, world_size: int | None = None,
                      held: set[AcceleratorSlot] = frozenset(), cordoned: set[str] = frozenset()) -> TrainLaunch:
    """:func:`prepare_launch` for the elastic driver (``FormationRuntime.prepare``)."""
    return prepare_launch(job.planning, topology, name=job.name, world_size=world_size, held=held, cordoned=cordoned)


def scaling_options(launch: TrainLaunch) -> dict[str, Any]:
    """Keyword arguments of ``ray.train.ScalingConfig`` for the launch (pure)."""
    kinds = {get_accelerator(t).ray_resource for t in launch.layout.rank_to_accelerator}
    selectors = [{L.NODE: node} for node, _ in launch.slots]
    if len(kinds) == 1:
        resource = kinds.pop()
        use_gpu = resource == "GPU"
        resources = {resource: 1.0, "CPU": 0.0}
    else:
        # The reservation group holds the accelerators (``accelerator_reservation``); the workers
        # ask for a sliver of CPU only because Ray refuses bundles of nothing but zeros (measured:
        # "Bundles cannot be an empty dictionary or resources with only 0 values").
        use_gpu, resources = False, {"CPU": MIXED_WORKER_CPU}
    return {"num_workers": launch.layout.world_size, "use_gpu": use_gpu, "resources_per_worker": resources,
            "label_selector": selectors, "placement_strategy": "PACK"}


def default_storage_path() -> str:
    home = os.environ.get("RAYFLEET_HOME") or os.path.join(os.path.expanduser("~"), ".rayfleet")
    return os.path.join(home, "runs")


def observe_fleet() -> tuple[FleetTopology, set[AcceleratorSlot], set[str]]:
    """The live topology, slots held by other work, and cordoned nodes (driver connected to Ray)."""
    import ray

    from rayfleet.jobs.elastic.policy import slots_in_use
    from rayfleet.platform.ray_compat import available_resources_per_node

    nodes = ray.nodes()
    topology = FleetTopology.from_ray_nodes(nodes)
    # Accelerators taken by other work (a Serve replica, another job): a plan that counted on
    # them would wait for its placement group for good.
    available = available_resources_per_node()
    name_of = {n["NodeID"]: (n.get("Labels") or {}).get(L.NODE) for n in nodes if n.get("Alive")}
    by_name = {t.name: t for t in topology.nodes}
    free_by_node = {name: available.get(node_id, {}).get(get_accelerator(by_name[name].accelerator_type).ray_resource, 0)
                    for node_id, name in name_of.items() if name in by_name}
    held: set[AcceleratorSlot] = slots_in_use(topology, free_by_node)
    cordoned: set[str] = set()
    try:
        from rayfleet.platform.controller import get_controller

        status = ray.get(get_controller().status.remote(), timeout=10)
        for node in status.nodes:
            # A node that just (re)joined has no agent heartbeat yet: Ray reports it alive, so it
            # may take work (an elastic job grows onto it); one whose heartbeats stopped may not.
            joining = node.health == "unreachable" and node.last_heartbeat_age_s is None
            if node.cordoned or (node.health in ("suspect", "unreachable", "dead") and not joining):
                cordoned.add(node.topology.name)
    except Exception:  # noqa: BLE001 - no controller (plain `ray start` cluster): labels only
        pass
    return topology, held, cordoned


def reservation_bundles(launch: TrainLaunch) -> list[tuple[dict[str, float], dict[str, str]]] | None:
    """(bundle, label selector) per rank for a launch whose ranks need more than one kind of Ray
    accelerator resource (pure); ``None`` when one kind serves all (the workers hold theirs).

    Ray Train gives every worker the same resources, so such a launch's workers ask for no
    accelerator: the reservation group holds each rank's accelerator on its node instead, and
    Ray's accounting (and ``rayfleet status``) still count them as taken.
    """
    kinds = [get_accelerator(t).ray_resource for t in launch.layout.rank_to_accelerator]
    if len(set(kinds)) <= 1:
        return None
    return [({kind: 1.0}, {L.NODE: node}) for kind, (node, _) in zip(kinds, launch.slots)]


@contextmanager
def accelerator_reservation(launch: TrainLaunch, *, timeout_s: float = RESERVATION_TIMEOUT_S) -> Iterator[Any]:
    """Hold the accelerators of a mixed-kind launch in a placement group named
    ``rayfleet:train:<job>`` while the block runs (see ``reservation_bundles``); yields the group
    (``None`` when no reservation is needed).

    Raises:
        RayfleetError: the accelerators could not be reserved within ``timeout_s`` (a pending
            group would wait forever: Ray gives placement groups no deadline of their own).
    """
    bundles = reservation_bundles(launch)
    if bundles is None:
        yield None
        return
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([b for b, _ in bundles], strategy="PACK", name=RESERVATION_PREFIX + launch.name,
                            bundle_label_selector=[s for _, s in bundles])
    try:
        if not group.wait(timeout_s):
            wanted = Counter(f"{next(iter(b))} on {selector[L.NODE]}" for b, selector in bundles)
            raise RayfleetError(f"could not reserve the accelerators of {launch.describe()} within {timeout_s:.0f}s "
                                f"({', '.join(f'{n} {what}' for what, n in sorted(wanted.items()))}): other work holds "
                                "them. Fix: wait for it to finish, or lower resources.num_workers / the plan's degrees")
        yield group
    finally:
        remove_placement_group(group)


class _MetricsPrinter:
    """Drains rank 0's rows from the formation's control actor in the driver: logs each row,
    keeps the last, calls ``on_step``.

    Rank 0 sends each step's metrics to the control actor and the driver prints them: worker stdout
    reaches a job's log only through Ray's log streaming, which may still be in flight when the
    job ends, while the driver's own stdout is the job log ``rayfleet train`` and the SDK follow.
    """

    def __init__(self, control: Any, *, log: Callable[[str], None], on_step: Callable[[dict], None] | None) -> None:
        self.control, self.log, self.on_step = control, log, on_step
        self.last: dict[str, Any] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="rayfleet-metrics", daemon=True)

    def start(self) -> "_MetricsPrinter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def _drain(self) -> None:
        import ray

        while True:
            done = self._done.is_set()  # read before the last take: nothing put before it is missed
            try:  # a long poll: answered as soon as a row arrives
                rows = ray.get(self.control.take.remote(0.0 if done else 0.5), timeout=60)
            except Exception:  # noqa: BLE001 - the control actor died with its node: nothing left to drain
                if done or self._done.wait(1.0):
                    return
                continue
            for row in rows:
                self._show(row)
            if done and not rows:
                return

    def _show(self, row: dict[str, Any]) -> None:
        from rayfleet.jobs.training_run import format_metrics_line

        if "rank_note" in row:  # the workers' ranks were re-formed to the layout's (worker_ranks)
            self.log(row.pop("rank_note"))
        if "restored_from" in row:
            self.log(f"rayfleet checkpoint: restored step {row.pop('restored_step')} from "
                     f"{row.pop('restored_from')} ({row.pop('restore_reason', '') or 'snapshot verified on every rank'})")
        self.last.update(row)
        self.log(format_metrics_line(row))
        if self.on_step is not None:
            self.on_step(row)


def new_formation_control() -> Any:
    """A formation's control actor (metrics rows and stop flag; ``jobs.formation_control``) on the
    driver's node."""
    import ray

    from rayfleet.jobs.formation_control import FormationControl

    return ray.remote(FormationControl).options(**driver_node_actor_options()).remote()


def fit_once(launch: TrainLaunch, *, loop: LoopConfig, checkpoint: CheckpointSettings | None, run_dir: str,
             max_failures: int, log, control: Any = None, watch_stop: bool = False, on_trainer_start=None,
             on_step=None) -> dict[str, Any]:
    """One Ray Train ``fit`` of ``launch``; returns the last metrics (raises the run's error).
    ``loop`` / ``checkpoint``: the job's slices every worker runs with (pickled, not re-validated).
    ``control``: the formation's control actor (made here if None); ``watch_stop``: every rank
    follows its stop flag (elastic formations). ``on_step(metrics)`` is called in the driver for
    every step rank 0 reports."""
    import ray.train
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from rayfleet.jobs.process_group_backend import ProcessGroupConfig
    from rayfleet.jobs.worker_entry import train_loop_per_worker
    from rayfleet.platform.ray_compat import without_helper_actors

    log(f"rayfleet train: {launch.describe()}")
    control = control if control is not None else new_formation_control()
    config = {"loop": loop, "checkpoint": checkpoint, "plan": launch.plan, "slots": launch.slots,
              "run_dir": run_dir, "control": control, "watch_stop": watch_stop}
    trainer = without_helper_actors(DataParallelTrainer)(
        train_loop_per_worker,
        train_loop_config=config,
        # Ray Train's own group only bootstraps the workers: each one re-forms the default group
        # with its layout rank (NCCL where CUDA is present, gloo otherwise; ``worker_ranks``). gloo
        # here works on every fleet, including fake-GPU local fleets where NCCL is absent. Ray's
        # TorchTrainer would do the same, but it imports torch in the driver and the controller.
        backend_config=ProcessGroupConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(**scaling_options(launch)),
        run_config=ray.train.RunConfig(name=os.path.basename(run_dir), storage_path=os.path.dirname(run_dir),
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures)),
    )
    with accelerator_reservation(launch):
        printer = _MetricsPrinter(control, log=log, on_step=on_step).start()
        if on_trainer_start is not None:
            on_trainer_start(launch)
        try:
            result = trainer.fit()  # in the main thread: Ray Train installs signal handlers
        finally:
            printer.stop()
    if result.error is not None:
        raise result.error
    return {**printer.last, **(result.metrics or {})}
