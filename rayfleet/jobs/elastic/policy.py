"""The elastic training policy: how large a formation, and what to do when one ends (pure).

A *formation* is one Ray Train ``fit`` of a fixed layout; an elastic job runs as a sequence of
formations, re-planned between them (see :mod:`rayfleet.jobs.elastic.driver`). Everything here
is a pure function of what the driver observed — no Ray, clock or I/O — so it is unit-tested in
milliseconds:

- ``choose_world_size``: the largest size within ``[min_workers, max_workers]`` the free
  accelerators hold, in whole model replicas.
- ``size_formation``: the launch of the largest such size whose plan works (a batch that does
  not split over N replicas is retried one replica smaller), planned around lent accelerators
  (``attribute_lent``: a borrower Ray already counts is not counted twice). Too few free
  accelerators raise ``CapacityShortage``, which the driver waits out after a formation ends
  (Ray frees its accelerators asynchronously).
- ``watch_formation``: while a formation runs, whether it must end — a node of its layout died
  (``node_lost``) or the fleet could hold a larger one (``grow``).
- ``after_formation``: the driver's next state once a formation's ``fit`` returned or raised.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping

from rayfleet.errors import SpecError
from rayfleet.jobs.train_job import TrainJob

__all__ = [
    "CapacityShortage", "attribute_lent", "choose_world_size", "free_accelerators", "size_formation", "replica_slots", "FormationEnd", "EndKind",
    "watch_formation", "DriverState", "after_formation",
]


class CapacityShortage(SpecError):
    """Not even ``resources.elastic.min_workers`` accelerators are free (no plan was tried).

    Unlike a plan that does not work at any size, this can pass by itself: right after a
    formation ends, Ray reports its accelerators as taken until its workers are gone.
    """


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


def free_accelerators(topology: Any, *, accelerator: str, held: Collection, cordoned: Collection[str]) -> int:
    """Accelerators of type ``accelerator`` on uncordoned nodes that no other work holds."""
    return sum(1 for n in topology.nodes if n.name not in cordoned and n.accelerator_type == accelerator
               for s in n.slots if s not in held)


def slots_in_use(topology: Any, free_by_node: Mapping[str, float]) -> set:
    """Slots other work holds, from each node's free accelerator count (pure).

    Ray counts a node's free accelerators but not which: a Serve replica or another tenant asks
    for ``GPU: 1``, not a rail. A node with ``k`` of its ``n`` accelerators taken has its top
    ``k`` slots marked held, so a plan never counts on more accelerators than the node has free.
    A node missing from ``free_by_node`` is taken as fully free (no live counts for it).
    """
    held = set()
    for node in topology.nodes:
        if node.name not in free_by_node:
            continue
        taken = max(0, node.num_accelerators - int(free_by_node[node.name]))
        held.update(sorted(node.slots, key=lambda s: s.index, reverse=True)[:taken])
    return held


def attribute_lent(topology: Any, held: Collection, placed: Iterable) -> set:
    """``held`` (Ray's per-node counts, marked on each node's top slots) with the marks moved onto
    ``placed``: lent slots whose borrowers already run, so Ray's count includes them (pure).

    Ray says *how many* accelerators of a node are taken, not which. A lent slot whose borrower
    runs is one of those taken; marked on the top slots as well as held as lent, it would count
    twice and the job would plan one accelerator short per placed loan. So on each node the
    count stays Ray's, the placed lent slots take their share of it first, and only the rest
    is marked on the node's other top slots.
    """
    held, placed = set(held), set(placed)
    out: set = set()
    for node in topology.nodes:
        slots = set(node.slots)
        taken = len(held & slots)
        mine = sorted(placed & slots, key=lambda s: s.index)[:taken]
        rest = sorted(slots - set(mine), key=lambda s: s.index, reverse=True)[:taken - len(mine)]
        out.update(mine, rest)
    known = {s for n in topology.nodes for s in n.slots}
    return out | (held - known)


def size_formation(job: TrainJob, observed: tuple, *, prepare: Callable[..., Any], lent: Iterable = (),
                   lent_placed: Iterable = (), max_size: int | None = None, at_least: int | None = None) -> Any:
    """The largest launch of ``job`` the observed fleet holds (elastic), else its fixed size.

    ``observed``: ``(topology, held slots, cordoned nodes)``; ``prepare(job, topology,
    world_size=, held=, cordoned=)`` plans one size (``train_launcher.prepare_formation``, pure;
    ``world_size=None``: the job's own size); ``lent``: slots the autoscaler lent away (planned
    around); ``lent_placed``: those of them whose borrowers run (Ray counts them already, see
    ``attribute_lent``); ``max_size``: the autoscaler's target size; ``at_least``: the fewest
    workers to accept (a grow decision's target, while its accelerators are being released).

    Raises:
        CapacityShortage: too few free accelerators for ``resources.elastic.min_workers`` (or
            for ``at_least``).
        SpecError: no plan works at any size from the largest free one down to the minimum
            (naming the last plan's error).
    """
    topology, held, cordoned = observed
    held = attribute_lent(topology, held, set(lent_placed) & set(lent)) | set(lent)
    elastic = job.elastic
    if elastic is None:
        return prepare(job, topology, world_size=None, held=held, cordoned=cordoned)
    replica = job.replica_size
    top = elastic.max_workers if max_size is None else max(elastic.min_workers, min(max_size, elastic.max_workers))
    free = free_accelerators(topology, accelerator=job.accelerator, held=held, cordoned=cordoned)
    size = choose_world_size(free, min_workers=elastic.min_workers, max_workers=top, replica_size=replica)
    if at_least is not None and size is not None and size < at_least:
        raise CapacityShortage("resources.elastic.max_workers", at_least,
                               f"{free} free {job.accelerator} accelerator(s) hold {size} workers, not the "
                               f"{at_least} the autoscaler grew the job to", "wait for them to be released")
    last_error: SpecError | None = None
    while size is not None and size >= elastic.min_workers:
        try:
            return prepare(job, topology, world_size=size, held=held, cordoned=cordoned)
        except SpecError as err:  # e.g. the batch does not split over this many replicas: try smaller
            last_error = err
            size -= replica
    if last_error is None:
        raise CapacityShortage("resources.elastic.min_workers", elastic.min_workers,
                               f"the fleet cannot hold even the minimum formation ({free} free "
                               f"{job.accelerator} accelerator(s) on uncordoned nodes)",
                               "free or add accelerators, or lower resources.elastic.min_workers")
    raise SpecError("resources.elastic.min_workers", elastic.min_workers,
                    f"the fleet cannot hold even the minimum formation ({last_error})",
                    "free or add accelerators, or lower resources.elastic.min_workers")


def replica_slots(layout: Any) -> list[list[Any]]:
    """Slots of each DP replica of a layout: replica ``i`` = the ranks whose dp coordinate is ``i``."""
    out: list[list[Any]] = [[] for _ in range(layout.plan.dp)]
    for rank, slot in enumerate(layout.rank_to_slot):
        out[layout.plan.coords(rank).dp].append(slot)
    return out


class EndKind(str, enum.Enum):
    """Why a formation was ended from outside (``fit`` finishing on its own has no end)."""

    NODE_LOST = "node_lost"  # a node of the layout died: the Train run is aborted
    GROW = "grow"  # the fleet holds a larger formation: all ranks stop after the same step


@dataclass(frozen=True)
class FormationEnd:
    kind: EndKind
    detail: str = ""


def watch_formation(*, layout_nodes: Collection[str], alive_nodes: Collection[str], size: int,
                    min_workers: int, max_workers: int, replica_size: int,
                    free_if_regrown: Callable[[], int] | None) -> FormationEnd | None:
    """One look at the fleet during a formation of ``size`` workers on ``layout_nodes``.

    ``free_if_regrown()`` counts the accelerators a new formation could use (this formation's
    own included); ``None`` when growth is not this watcher's call (fixed-size job, or the
    shared autoscaler decides). It is only called when growth is possible.
    """
    lost = sorted(set(layout_nodes) - set(alive_nodes))
    if lost:
        return FormationEnd(EndKind.NODE_LOST, f"node {', '.join(lost)} of the layout died")
    if free_if_regrown is None or size >= max_workers:
        return None
    bigger = choose_world_size(free_if_regrown(), min_workers=min_workers, max_workers=max_workers,
                               replica_size=replica_size)
    if bigger is not None and bigger > size:
        return FormationEnd(EndKind.GROW, f"the fleet now holds {bigger} workers (running {size})")
    return None


class DriverState(str, enum.Enum):
    """The elastic driver's states (Ray Train v2's controller names its states the same way)."""

    SCHEDULING = "SCHEDULING"  # observe the fleet and size the next formation
    PAUSED = "PAUSED"  # preempted whole by the autoscaler: wait for accelerators to come back
    RUNNING = "RUNNING"  # a formation's fit is in progress
    RESIZING = "RESIZING"  # a formation stopped after a step to re-form at another size
    RECOVERING = "RECOVERING"  # a node of the formation died: clean up, then re-plan
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"


def after_formation(*, step: int, steps: int, end: FormationEnd | None, resized: bool,
                    failed: bool) -> tuple[DriverState, str]:
    """The next state once a formation's ``fit`` returned (or raised: ``failed``), with why.

    >>> after_formation(step=24, steps=24, end=FormationEnd(EndKind.GROW), resized=False, failed=False)[0]
    <DriverState.FINISHED: 'FINISHED'>
    """
    if failed:
        if end is not None and end.kind is EndKind.NODE_LOST:
            return DriverState.RECOVERING, end.detail
        return DriverState.ERRORED, "the formation failed"
    if step >= steps:
        return DriverState.FINISHED, f"step {step} of {steps} done"  # a resize that came with the last step is moot
    if end is not None and end.kind is EndKind.GROW:
        return DriverState.RESIZING, end.detail
    if resized:
        return DriverState.RESIZING, "the autoscaler resized the job"
    return DriverState.FINISHED, f"the run ended at step {step} of {steps}"
