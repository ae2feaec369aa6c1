"""Live admission of training jobs through the queues (pure: no Ray, clock or I/O).

The fleet controller keeps one :class:`AdmissionRecord` per training job that waits in or was
admitted through a queue, and runs :func:`admission_step` whenever a job arrives or leaves and
on every reconcile. The decisions themselves are :func:`rayfleet.platform.queues.admit` and
:func:`~rayfleet.platform.queues.admission_order` -- the functions the simulator runs -- so the
live fleet and the simulator admit, borrow and reclaim by the same rules.

Design decisions:
- **Jobs without a queue run as before.** A spec's ``queue`` defaults to ``"default"``; while no
  queue of that name is declared, such a job is admitted directly (``route`` answers ``None``)
  and counts against no queue. Declaring ``default`` puts those jobs under its rules too. Any
  other queue name must be declared: an unknown one is refused with the fix.
- **The queues govern the accelerators their roots are guaranteed.** When the roots declare a
  quota of a type, admission hands out at most that many of it (minus what the tree's jobs
  hold), even on a larger fleet: the rest belongs to work outside the queues (jobs without a
  queue, Serve pools). Roots without a quota of a type leave it bounded by the idle fleet
  (``governed_free``). This is Kueue's model (a cohort lends only its members' nominal quota)
  and is what lets a queue "reclaim what another branch borrowed" on a fleet that is not full.
- **Accelerators promised are not free.** A job admitted at ``size`` holds nothing in Ray's
  accounting until its workers start; its driver reports what its running formation holds
  (``held``), and ``size - held`` is subtracted from Ray's idle count until then.
- **Reclaims are orders, not effects**: the step returns which running job shrinks to what
  (:class:`ReclaimOrder`); the controller delivers them as the autoscaler's own
  ``ShrinkTraining`` decisions to the job's shell (elastic: whole DP replicas after a flash
  snapshot; opportunistic: preempted whole, back to ``QUEUED`` keeping its submission time). The
  admitted job waits (``waiting_for``) until every job it reclaimed from has let go.
- **Growth is admission's business too.** The shared autoscaler grows admitted elastic jobs into
  idle accelerators; :func:`growth_limits` tells its pure policy how far each may go by the same
  rules (``Queue.ceiling_of``, ``queue_usage``, the roots' governed quota), and :func:`resized`
  is the record after a resize it decided: ``size`` follows the job, so what it grew above its
  quota counts as borrowed and is reclaimed like any borrowed accelerator.
- **Serve pools are records too** (``serve_pool``; built by ``serve_admission``): the same
  steps admit them, their ``size`` counts against their queue as a training job's does, and
  ``growth_limits`` caps how far the autoscaler's lending may grow them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterable, Mapping, Sequence

from rayfleet.errors import SpecError
from rayfleet.platform.autoscaler.types import QueueGrowthLimits
from rayfleet.platform.queues import JobClass, QueueTree, Reclaim, Workload, admission_order, admit, queue_usage

__all__ = ["DEFAULT_QUEUE", "AdmissionState", "AdmissionRequest", "AdmissionRecord", "ReclaimOrder",
           "AdmissionStep", "route", "governed_free", "admission_step", "settled", "growth_limits", "resized"]

DEFAULT_QUEUE = "default"


class AdmissionState(str, Enum):
    QUEUED = "QUEUED"  # waiting in its queue (reason and place in line on the record)
    ADMITTED = "ADMITTED"  # may hold ``size`` accelerators


@dataclass(frozen=True)
class AdmissionRequest:
    """A training job asking its queue for accelerators (sizes in accelerators of one type).

    ``job_id`` is the Ray submission id (what ``rayfleet job list`` shows); ``name`` the job's
    name, which is also its autoscaler shell's inbox (reclaims are delivered there).
    """

    job_id: str
    name: str
    queue: str
    accelerator_type: str
    min_size: int
    max_size: int
    replica_size: int
    job_class: JobClass = JobClass.GUARANTEED
    priority: int = 0
    serve_pool: bool = False  # a Serve pool (``serve_admission``): no driver heartbeats, grows by lending

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "name": self.name, "queue": self.queue,
                "accelerator_type": self.accelerator_type, "min_size": self.min_size, "max_size": self.max_size,
                "replica_size": self.replica_size, "job_class": self.job_class.value, "priority": self.priority,
                "serve_pool": self.serve_pool}

    @classmethod
    def from_json(cls, data: Mapping) -> "AdmissionRequest":
        return cls(**{**data, "job_class": JobClass(data.get("job_class", JobClass.GUARANTEED.value))})


@dataclass(frozen=True)
class AdmissionRecord:
    """A job's place in the queues. ``position``: its place in its queue's line while QUEUED
    (1 = next); ``held``: accelerators its running formation holds, as its driver reports."""

    request: AdmissionRequest
    state: AdmissionState
    submitted_at: float
    size: int = 0
    reason: str = ""
    position: int = 0
    borrowed: int = 0
    admitted_at: float = 0.0
    waiting_for: tuple[str, ...] = ()
    times_admitted: int = 0
    held: int = 0

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @classmethod
    def running(cls, work: Workload) -> "AdmissionRecord":
        """The record of a workload that runs at its size and holds it (the simulator's jobs)."""
        request = AdmissionRequest(job_id=work.job_id, name=work.job_id, queue=work.queue,
                                   accelerator_type=work.accelerator_type, min_size=work.min_size,
                                   max_size=work.max_size, replica_size=work.replica_size,
                                   job_class=work.job_class, priority=work.priority)
        return cls(request=request, state=AdmissionState.ADMITTED, submitted_at=work.started_at, size=work.size,
                   admitted_at=work.started_at, held=work.size)

    def workload(self) -> Workload:
        r = self.request
        return Workload(job_id=r.job_id, queue=r.queue, accelerator_type=r.accelerator_type, size=self.size,
                        min_size=r.min_size, max_size=r.max_size, replica_size=r.replica_size,
                        job_class=r.job_class, priority=r.priority,
                        started_at=self.admitted_at if self.state is AdmissionState.ADMITTED else self.submitted_at)

    def to_json(self) -> dict:
        return {"request": self.request.to_json(), "state": self.state.value, "submitted_at": self.submitted_at,
                "size": self.size, "reason": self.reason, "position": self.position, "borrowed": self.borrowed,
                "admitted_at": self.admitted_at, "waiting_for": list(self.waiting_for),
                "times_admitted": self.times_admitted, "held": self.held}

    @classmethod
    def from_json(cls, data: Mapping) -> "AdmissionRecord":
        return cls(**{**data, "request": AdmissionRequest.from_json(data["request"]),
                      "state": AdmissionState(data["state"]), "waiting_for": tuple(data.get("waiting_for", ()))})


@dataclass(frozen=True)
class ReclaimOrder:
    """Shrink running job ``victim`` as ``reclaim`` says, for admitted job ``for_job``."""

    victim: AdmissionRecord  # as it was before the reclaim
    reclaim: Reclaim
    for_job: str


@dataclass(frozen=True)
class AdmissionStep:
    records: tuple[AdmissionRecord, ...]  # every record after the step
    admitted: tuple[AdmissionRecord, ...] = ()  # admitted (or re-admitted) in this step
    reclaims: tuple[ReclaimOrder, ...] = ()
    events: tuple[tuple[str, str, str, dict], ...] = ()  # (subject, kind, cause, detail)


def route(tree: QueueTree, queue: str) -> str | None:
    """The leaf queue a job of ``queue`` waits in, or ``None``: admitted directly (no queue).

    Raises:
        SpecError: ``queue`` is not declared (and is not the undeclared default), or not a leaf.
    """
    if queue not in tree.queues:
        if queue == DEFAULT_QUEUE:
            return None
        known = sorted(tree.queues)
        raise SpecError("queue", queue, "no such queue on this fleet" + (f" (queues: {', '.join(known)})" if known else
                                                                          " (it declares no queues)"),
                        f"declare it (`rayfleet queue apply queues.yaml`, or `rayfleet queue create {queue} "
                        "--quota H100=8`), name a declared leaf queue, or leave `queue` unset to run outside the queues")
    if not tree.is_leaf(queue):
        leaves = sorted(q for q in tree.queues if tree.is_leaf(q) and queue in tree.path(q))  # under this parent
        raise SpecError("queue", queue, "is a parent queue; jobs wait in leaf queues",
                        f"name one of its leaves: {', '.join(leaves)}")
    return queue


def governed_free(tree: QueueTree, running: Sequence[Workload], kind: str, idle: int) -> int:
    """Accelerators of ``kind`` admission may hand out: the idle ones, capped by what the roots'
    quotas leave (see module doc). ``idle``: Ray's idle count minus what admitted jobs were
    promised and do not hold yet."""
    return max(0, int(min(idle, _governed_room(tree, running, kind))))


def _governed_room(tree: QueueTree, running: Sequence[Workload], kind: str) -> float:
    """What the roots' quotas of ``kind`` leave to the queues' jobs (unbounded without any)."""
    roots = [q for q in tree.queues.values() if q.parent is None]
    cap = sum(q.quota_of(kind) for q in roots)
    if cap <= 0:
        return math.inf
    usage = queue_usage(tree, running, kind)
    return cap - sum(usage[q.name] for q in roots)


def settled(victim: AdmissionRecord | None) -> bool:
    """Whether a job reclaimed from has let go: gone, preempted and holding nothing, or running
    at its new size."""
    if victim is None:
        return True
    if victim.state is AdmissionState.QUEUED:
        return victim.held == 0
    return victim.held == victim.size


def _in_tree(tree: QueueTree, record: AdmissionRecord) -> bool:
    return record.request.queue in tree.queues and tree.is_leaf(record.request.queue)


def admission_step(tree: QueueTree, records: Iterable[AdmissionRecord], *, ray_idle: Mapping[str, int],
                   now: float) -> AdmissionStep:
    """Admit what fits now, in admission order; reclaim by the queues' rules (see module doc).

    ``ray_idle``: accelerator type -> idle accelerators Ray reports on live, uncordoned nodes.
    Records of jobs whose queue has gone stay QUEUED with that reason.
    """
    by_id = {r.job_id: r for r in records}
    events: list[tuple[str, str, str, dict]] = []
    admitted: list[AdmissionRecord] = []
    orders: list[ReclaimOrder] = []

    def running() -> list[Workload]:
        return [r.workload() for r in by_id.values() if r.state is AdmissionState.ADMITTED and _in_tree(tree, r)]

    idle = dict(ray_idle)
    for r in by_id.values():
        if r.state is AdmissionState.ADMITTED:
            kind = r.request.accelerator_type
            idle[kind] = idle.get(kind, 0) - max(0, r.size - r.held)
    pending = [r for r in by_id.values() if r.state is AdmissionState.QUEUED]
    for record in [r for r in pending if not _in_tree(tree, r)]:
        by_id[record.job_id] = _waiting(record, f"queue {record.request.queue} is gone or has child queues", events)
    in_tree = [r.workload() for r in pending if _in_tree(tree, r)]
    for work in admission_order(tree, in_tree):
        record, kind = by_id[work.job_id], work.accelerator_type
        current = running()
        free = governed_free(tree, current, kind, idle.get(kind, 0))
        decision = admit(tree, replace(work, size=0), running=current, free={kind: free})
        if not decision.admitted:
            by_id[record.job_id] = _waiting(record, decision.reason, events)
            continue
        freed = 0
        for reclaim in decision.reclaims:
            victim = by_id[reclaim.job_id]
            orders.append(ReclaimOrder(victim=victim, reclaim=reclaim, for_job=record.job_id))
            freed += reclaim.freed
            if reclaim.preempted:
                by_id[victim.job_id] = replace(victim, state=AdmissionState.QUEUED, size=0, borrowed=0,
                                               reason=f"preempted: {reclaim.reason}", waiting_for=())
            else:
                by_id[victim.job_id] = replace(victim, size=reclaim.new_size,
                                               borrowed=max(0, victim.borrowed - reclaim.freed))
            events.append((f"job:{victim.request.name}", "queue_reclaim", reclaim.reason,
                           {"job_id": victim.job_id, "queue": victim.request.queue, "new_size": reclaim.new_size,
                            "freed": reclaim.freed, "for_job": record.job_id}))
        idle[kind] = idle.get(kind, 0) - decision.size + freed
        new = replace(record, state=AdmissionState.ADMITTED, size=decision.size, reason=decision.reason, position=0,
                      borrowed=decision.borrowed, admitted_at=now, times_admitted=record.times_admitted + 1,
                      waiting_for=tuple(r.job_id for r in decision.reclaims), held=0)
        by_id[record.job_id] = new
        admitted.append(new)
        events.append((f"job:{record.request.name}", "queue_admitted", decision.reason,
                       {"job_id": record.job_id, "queue": record.request.queue, "size": decision.size,
                        "borrowed": decision.borrowed, "waited_s": round(now - record.submitted_at, 1)}))
    _number_lines(tree, by_id)
    return AdmissionStep(records=tuple(by_id.values()), admitted=tuple(admitted), reclaims=tuple(orders),
                         events=tuple(events))


def growth_limits(tree: QueueTree, records: Iterable[AdmissionRecord]) -> QueueGrowthLimits:
    """How far each admitted job may grow by the queues' rules, for the autoscaler's policy.

    The rules are admission's (``queues.admit``'s first two, and ``governed_free``): no queue on
    the job's path above its quota + borrow limit, the roots' jobs within the roots' quota of the
    type, a guaranteed job within its leaf queue's quota. Growth only ever takes idle
    accelerators (the policy grows into free ones), so growing above the leaf's quota is
    borrowing: once the record follows the new size (:func:`resized`) a lender inside its quota
    reclaims it like any borrowed accelerator. A job QUEUED (preempted whole, waiting for
    re-admission) gets ceiling 0: only admission starts it again. Keys are the jobs' names (their
    shells' inboxes, the autoscaler's job ids).

    Example: root queues team-a and team-b, quota 2 H100 each, team-b's borrow limit 2; one job,
    in team-b, admitted at 2 (max 8). Its ceiling is 4; its limits ``H100 in queue team-b`` (room
    2 = 2 + 2 - 2) and ``H100 of the roots' quota`` (room 2 = 4 - 2).
    """
    records = list(records)
    running = [r.workload() for r in records if r.state is AdmissionState.ADMITTED and _in_tree(tree, r)]
    usage_of = {kind: queue_usage(tree, running, kind) for kind in {w.accelerator_type for w in running}}
    governed_of = {kind: _governed_room(tree, running, kind) for kind in usage_of}  # once per type, not per job
    ceiling, granted, limits, room, promised = {}, {}, {}, {}, {}
    for record in records:
        request, name, kind = record.request, record.request.name, record.request.accelerator_type
        bounded: dict[str, int] = {}
        if record.state is AdmissionState.ADMITTED:
            promised[kind] = promised.get(kind, 0) + max(0, record.size - record.held)
        if record.state is AdmissionState.QUEUED:
            top = 0  # preempted or not admitted yet: only admission starts it
        elif not _in_tree(tree, record):
            top = record.size  # its queue is gone: it keeps what it has
        else:
            usage = usage_of[kind]
            mine: dict[str, float] = {f"{kind} in queue {q}": tree.queues[q].ceiling_of(kind) - usage[q]
                                      for q in tree.path(request.queue)}
            mine[f"{kind} of the roots' quota"] = governed_of[kind]
            if request.job_class is JobClass.GUARANTEED:
                mine[f"{kind} in queue {request.queue}'s quota"] = (tree.queues[request.queue].quota_of(kind)
                                                                    - usage[request.queue])
            bounded = {key: max(0, int(value)) for key, value in mine.items() if value != math.inf}
            # A Serve pool's max_size is Serve's own range; lending grows it beyond, within its queue
            most = (1 << 30) if request.serve_pool else request.max_size
            alone = min(bounded.values(), default=most)
            extra = max(0, min(most - record.size, alone))
            top = record.size + extra // request.replica_size * request.replica_size
        room.update(bounded)
        ceiling[name] = min(ceiling.get(name, top), top)  # a name twice (resubmitted): the tighter
        granted[name], limits[name] = record.size, tuple(sorted(bounded))
    return QueueGrowthLimits(job_to_ceiling=ceiling, job_to_granted=granted, job_to_limits=limits,
                             limit_to_room=room, promised={k: v for k, v in promised.items() if v > 0})


def resized(tree: QueueTree, records: Iterable[AdmissionRecord], *, job_id: str, new_size: int,
            reason: str) -> AdmissionRecord:
    """Admitted job ``job_id``'s record once the autoscaler resized it to ``new_size`` (grown into
    idle accelerators, or shrunk to lend them to Serve). ``borrowed`` is recomputed as ``admit``
    computes it: what its leaf queue then holds above its quota, at most the job's own size.

    Raises:
        KeyError: no record of ``job_id``.
    """
    by_id = {r.job_id: r for r in records}
    record = by_id[job_id]
    kind, queue = record.request.accelerator_type, record.request.queue
    borrowed = 0
    if _in_tree(tree, record):
        others = [r.workload() for r in by_id.values() if r.job_id != job_id and r.state is AdmissionState.ADMITTED
                  and _in_tree(tree, r)]
        held_by_others = queue_usage(tree, others, kind)[queue]
        borrowed = min(new_size, max(0, held_by_others + new_size - tree.queues[queue].quota_of(kind)))
    return replace(record, size=new_size, borrowed=borrowed,
                   reason=f"resized {record.size}->{new_size} by the autoscaler: {reason}")


def _waiting(record: AdmissionRecord, reason: str, events: list) -> AdmissionRecord:
    if reason != record.reason:
        events.append((f"job:{record.request.name}", "queue_waiting", reason,
                       {"job_id": record.job_id, "queue": record.request.queue}))
    return replace(record, reason=reason)


def _number_lines(tree: QueueTree, by_id: dict[str, AdmissionRecord]) -> None:
    """Give every QUEUED job its place in its queue's line (admission order, 1 = next)."""
    waiting = [r for r in by_id.values() if r.state is AdmissionState.QUEUED]
    ordered = admission_order(tree, [r.workload() for r in waiting if _in_tree(tree, r)])
    place: dict[str, int] = {}
    for work in ordered:
        place[work.queue] = place.get(work.queue, 0) + 1
        by_id[work.job_id] = replace(by_id[work.job_id], position=place[work.queue])
    for r in waiting:
        if not _in_tree(tree, r):
            by_id[r.job_id] = replace(r, position=0)


def request_sizes(*, min_workers: int, max_workers: int, replica_size: int) -> tuple[int, int]:
    """(min, max) rounded to whole DP replicas (min up, max down), as :class:`Workload` needs.

    Raises:
        SpecError: no whole number of replicas lies in the range.
    """
    low = math.ceil(min_workers / replica_size) * replica_size
    high = (max_workers // replica_size) * replica_size
    if low <= 0 or low > high:
        raise SpecError("resources.elastic", (min_workers, max_workers),
                        f"holds no whole number of data-parallel replicas of {replica_size} accelerator(s)",
                        f"use min_workers/max_workers that are multiples of {replica_size}")
    return low, high
