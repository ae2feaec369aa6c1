"""Hierarchical queues, quotas, borrowing, reclaim and gang admission (pure: no Ray, clock or I/O).

Design decisions:
- Queues form a tree (``root -> org -> team``). Each queue has a *guaranteed quota* of
  accelerators per type and a *borrow limit*: how far above its quota it may go by borrowing
  idle quota. A child's guarantee must be backed by its parent: the children's quotas of a type
  sum to at most the parent's (checked when the tree is built).
- Jobs belong to leaf queues. A queue's usage is the sum over its subtree.
- Borrowing only ever uses *idle* accelerators; it never preempts anything. Borrowed capacity
  is lent, not given: a lender that wants its quota back reclaims it.
- Reclaim follows the lowest common ancestor (LCA) rule, the hierarchical form of Kueue's
  cohort rule: requester ``R`` may take accelerators from a job in leaf ``V`` only if ``B`` —
  the child of ``LCA(R, V)`` on ``V``'s side — is above its quota, and at most by ``B``'s
  excess; and only if ``R``'s own branch at that level stays within its quota. So a team never
  loses accelerators its org is entitled to because a sibling org is busy.
- Job classes: ``guaranteed`` jobs run only inside their queue's quota and are never shrunk or
  preempted; ``elastic`` jobs may be shrunk down to their minimum in whole data-parallel
  replicas (after a flash snapshot, so no work is lost beyond the restart); ``opportunistic``
  jobs are preempted whole. Reclaim takes the cheapest first: elastic shrinks before
  opportunistic preemptions, then lowest job priority, then the most recently started (LIFO,
  least work since start).
- Gang admission: a job starts at the largest size in ``[min_size, max_size]`` (a multiple of
  its DP replica size) that fits, never below ``min_size``. Admission is a pure function of the
  tree, the running jobs and the free accelerators; the caller carries the decision out.
- Pydantic (:class:`QueueSpec`) validates queue definitions at the edge (CLI, SDK, controller);
  inside, queues are frozen dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rayfleet.errors import SpecError
from rayfleet.platform.catalogue import accelerator_names

__all__ = [
    "JobClass", "QueueSpec", "Queue", "QueueTree", "Workload", "Reclaim", "AdmissionDecision",
    "parse_queue_spec", "parse_queue_file", "queue_usage", "admit", "admission_order",
]

UNLIMITED = math.inf


class JobClass(str, Enum):
    GUARANTEED = "guaranteed"
    ELASTIC = "elastic"
    OPPORTUNISTIC = "opportunistic"


class QueueSpec(BaseModel):
    """A queue definition as a user writes it (YAML, CLI, SDK)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    parent: str | None = None
    quota: dict[str, int] = Field(default_factory=dict)
    borrow_limit: dict[str, int] | None = None  # None: may borrow any idle accelerator
    priority: int = 0

    @field_validator("quota", "borrow_limit")
    @classmethod
    def _known_types(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        for kind, count in (value or {}).items():
            if kind not in accelerator_names():
                raise ValueError(f"unknown accelerator type {kind!r}; known: {', '.join(accelerator_names())}")
            if count < 0:
                raise ValueError(f"{kind}={count} is negative")
        return value


@dataclass(frozen=True)
class Queue:
    """A validated queue. ``borrow_limit`` maps type -> extra accelerators; absent = unlimited."""

    name: str
    parent: str | None = None
    quota: Mapping[str, int] = field(default_factory=dict)
    borrow_limit: Mapping[str, int] | None = None
    priority: int = 0

    def quota_of(self, kind: str) -> int:
        return int(self.quota.get(kind, 0))

    def ceiling_of(self, kind: str) -> float:
        """Most this queue's subtree may hold of ``kind``: quota + borrow limit."""
        if self.borrow_limit is None:
            return UNLIMITED
        return self.quota_of(kind) + int(self.borrow_limit.get(kind, 0))

    def to_json(self) -> dict:
        return {"name": self.name, "parent": self.parent, "quota": dict(self.quota),
                "borrow_limit": None if self.borrow_limit is None else dict(self.borrow_limit),
                "priority": self.priority}


_FIXES = {
    "name": "use lower-case letters, digits, '.', '_' or '-' (at most 63 characters), e.g. 'team-a'",
    "quota": "give counts per accelerator type, e.g. quota={'H100': 64}",
    "borrow_limit": "give extra accelerators per type, e.g. borrow_limit={'H100': 16}, or leave it unset",
    "priority": "use an integer; larger runs first",
}


def parse_queue_spec(data: Mapping | QueueSpec) -> Queue:
    """Validate one queue definition; raise :class:`SpecError` naming the field, value and fix."""
    if isinstance(data, QueueSpec):
        spec = data
    else:
        try:
            spec = QueueSpec.model_validate(dict(data))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "queue"
            top = str(err["loc"][0]) if err["loc"] else "queue"
            raise SpecError(f"queue.{loc}", err.get("input"), err["msg"],
                            _FIXES.get(top, f"remove the field; allowed: {', '.join(QueueSpec.model_fields)}")) from None
    return Queue(name=spec.name, parent=spec.parent, quota=dict(spec.quota),
                 borrow_limit=None if spec.borrow_limit is None else dict(spec.borrow_limit),
                 priority=spec.priority)


def parse_queue_file(data: object, *, source: str = "queues.yaml") -> list[Queue]:
    """The queues of a ``rayfleet queue apply`` file (already parsed from YAML): ``{queues: [...]}``
    or a plain list, each item the fields of :class:`QueueSpec` (Kueue users declare their
    ClusterQueues the same way: one file, applied as a whole)."""
    items = data.get("queues") if isinstance(data, Mapping) else data
    if not isinstance(items, list) or not items:
        raise SpecError(source, type(data).__name__, "holds no list of queues",
                        "write `queues:` followed by items such as `- {name: team-a, quota: {H100: 8}}`")
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise SpecError(f"{source}: queues[{index}]", item, "is not a mapping of queue fields",
                            "give name, parent, quota, borrow_limit and priority per queue")
        out.append(parse_queue_spec(item))
    return out


@dataclass(frozen=True)
class QueueTree:
    """Validated queue hierarchy. Build with :meth:`build`."""

    queues: Mapping[str, Queue]
    _paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        paths = {}
        for name in self.queues:
            out, cur, seen = [], name, set()
            while cur is not None and cur in self.queues and cur not in seen:
                seen.add(cur)
                out.append(cur)
                cur = self.queues[cur].parent
            paths[name] = tuple(out)
        object.__setattr__(self, "_paths", paths)  # memo: admission asks for paths per job

    @classmethod
    def build(cls, queues: Iterable[Queue]) -> "QueueTree":
        by_name: dict[str, Queue] = {}
        for q in queues:
            if q.name in by_name:
                raise SpecError("queue.name", q.name, "defined twice", "give every queue a unique name")
            by_name[q.name] = q
        for q in by_name.values():
            if q.parent is not None and q.parent not in by_name:
                raise SpecError(f"queue {q.name}.parent", q.parent, "no such queue",
                                f"create the parent first or use one of {sorted(by_name)}")
            seen, cur = {q.name}, q.parent
            while cur is not None:
                if cur in seen:
                    raise SpecError(f"queue {q.name}.parent", q.parent, "makes a cycle", "parents must form a tree")
                seen.add(cur)
                cur = by_name[cur].parent
        tree = cls(queues=by_name)
        for q in by_name.values():
            kids = tree.children(q.name)
            for kind in {k for c in kids for k in c.quota}:
                total = sum(c.quota_of(kind) for c in kids)
                if total > q.quota_of(kind):
                    raise SpecError(f"queue {q.name}.quota.{kind}", q.quota_of(kind),
                                    f"its children are guaranteed {total} in all, more than it holds",
                                    f"raise {q.name}'s {kind} quota to at least {total} or lower the children's")
        return tree

    def children(self, name: str | None) -> list[Queue]:
        return [q for q in self.queues.values() if q.parent == name]

    def is_leaf(self, name: str) -> bool:
        return not self.children(name)

    def path(self, name: str) -> list[str]:
        """``name`` and its ancestors, leaf first."""
        if name not in self.queues:
            raise SpecError("queue", name, "no such queue", f"use one of {sorted(self.queues)} (`rayfleet queue list`)")
        return list(self._paths[name])

    def with_queue(self, queue: Queue) -> "QueueTree":
        return QueueTree.build([q for q in self.queues.values() if q.name != queue.name] + [queue])

    def without(self, name: str) -> "QueueTree":
        self.path(name)
        if self.children(name):
            raise SpecError("queue", name, "has child queues", "delete its children first")
        return QueueTree.build([q for q in self.queues.values() if q.name != name])


@dataclass(frozen=True)
class Workload:
    """A training job as the queues see it. Sizes are accelerators of ``accelerator_type``."""

    job_id: str
    queue: str
    accelerator_type: str
    size: int  # current size (0 while pending)
    min_size: int
    max_size: int
    replica_size: int = 1  # accelerators per data-parallel replica
    job_class: JobClass = JobClass.ELASTIC
    priority: int = 0
    started_at: float = 0.0  # for LIFO victim order and FIFO admission order

    def __post_init__(self) -> None:
        if self.replica_size < 1 or self.min_size % self.replica_size or self.max_size % self.replica_size:
            raise SpecError(f"job {self.job_id}.min_size/max_size", (self.min_size, self.max_size),
                            f"must be whole multiples of the DP replica size {self.replica_size}",
                            "round the sizes to whole data-parallel replicas")
        if not 0 < self.min_size <= self.max_size:
            raise SpecError(f"job {self.job_id}.min_size", self.min_size, f"must be in 1..max_size={self.max_size}",
                            "set 0 < min_size <= max_size")

    def releasable(self) -> int:
        """Accelerators a reclaim may take: down to the minimum (elastic), all (opportunistic)."""
        if self.job_class is JobClass.GUARANTEED:
            return 0
        if self.job_class is JobClass.OPPORTUNISTIC:
            return self.size
        return self.size - self.min_size


@dataclass(frozen=True)
class Reclaim:
    """Take accelerators from a running job: shrink it to ``new_size`` (0 = preempted whole)."""

    job_id: str
    new_size: int
    freed: int
    reason: str

    @property
    def preempted(self) -> bool:
        return self.new_size == 0


@dataclass(frozen=True)
class AdmissionDecision:
    job_id: str
    admitted: bool
    size: int
    reason: str
    reclaims: tuple[Reclaim, ...] = ()
    borrowed: int = 0  # accelerators above the leaf queue's quota


def queue_usage(tree: QueueTree, running: Iterable[Workload], kind: str) -> dict[str, int]:
    """Accelerators of ``kind`` held by each queue's subtree."""
    usage = {name: 0 for name in tree.queues}
    for w in running:
        if w.accelerator_type != kind or w.size <= 0:
            continue
        for name in tree.path(w.queue):
            usage[name] += w.size
    return usage


def _branches(tree: QueueTree, requester: str, victim: str) -> tuple[str | None, str | None]:
    """(requester's branch, victim's branch) just below their lowest common ancestor."""
    r_path, v_path = tree.path(requester)[::-1], tree.path(victim)[::-1]  # root first
    i = 0
    while i < min(len(r_path), len(v_path)) and r_path[i] == v_path[i]:
        i += 1
    return (r_path[i] if i < len(r_path) else None, v_path[i] if i < len(v_path) else None)


def _victim_order(w: Workload) -> tuple:
    return (0 if w.job_class is JobClass.ELASTIC else 1, w.priority, -w.started_at, w.job_id)


def _plan_reclaim(tree: QueueTree, job: Workload, size: int, need: int, running: Sequence[Workload],
                  usage: Mapping[str, int]) -> tuple[Reclaim, ...] | None:
    excess = {name: usage[name] - tree.queues[name].quota_of(job.accelerator_type) for name in tree.queues}
    reclaims: list[Reclaim] = []
    got = 0
    for w in sorted(running, key=_victim_order):
        if got >= need:
            break
        if w.accelerator_type != job.accelerator_type or w.releasable() <= 0 or w.queue == job.queue:
            continue
        mine, theirs = _branches(tree, job.queue, w.queue)
        if theirs is None or mine is None or excess[theirs] <= 0:
            continue  # the victim's branch is within its quota: nothing there is borrowed from us
        if usage[mine] + size > tree.queues[mine].quota_of(job.accelerator_type):
            continue  # we would be borrowing ourselves at that level: borrowing never preempts
        if w.job_class is JobClass.OPPORTUNISTIC:
            take, new_size = w.size, 0  # cannot be split; may overshoot the branch's excess
            why = f"preempted whole: queue {theirs} borrows {excess[theirs]} above quota, reclaimed by {job.queue}"
        else:
            want = min(need - got, excess[theirs], w.releasable())
            replicas = math.ceil(want / w.replica_size)
            take = min(replicas * w.replica_size, w.releasable())
            new_size = w.size - take
            why = (f"shrunk by {take // w.replica_size} DP replica(s) to {new_size}: queue {theirs} borrows "
                   f"{excess[theirs]} above quota, reclaimed by {job.queue}")
        for name in tree.path(w.queue):
            excess[name] -= take
        got += take
        reclaims.append(Reclaim(job_id=w.job_id, new_size=new_size, freed=take, reason=why))
    return tuple(reclaims) if got >= need else None


def admit(tree: QueueTree, job: Workload, *, running: Sequence[Workload], free: Mapping[str, int],
          usage: Mapping[str, int] | None = None) -> AdmissionDecision:
    """Decide whether pending ``job`` starts now, at what size, and what it reclaims.

    ``free`` maps accelerator type -> idle accelerators (that can take this job's replicas).
    Tries sizes from ``max_size`` down to ``min_size`` in whole replicas (gang admission: never
    below the minimum). ``usage`` may pass ``queue_usage(tree, running, type)`` when the caller
    admits many jobs against the same running set (the simulator does).
    """
    kind = job.accelerator_type
    if not tree.is_leaf(job.queue):
        raise SpecError(f"job {job.job_id}.queue", job.queue, "is not a leaf queue", "submit jobs to a leaf queue")
    path = tree.path(job.queue)
    usage = queue_usage(tree, running, kind) if usage is None else usage
    idle = int(free.get(kind, 0))
    leaf = tree.queues[job.queue]
    reasons: list[str] = []
    for size in range(job.max_size, job.min_size - 1, -job.replica_size):
        over = [q for q in path if usage[q] + size > tree.queues[q].ceiling_of(kind)]
        if over:
            reasons.append(f"{size}: queue {over[0]} would exceed quota+borrow limit")
            continue
        within = usage[job.queue] + size <= leaf.quota_of(kind)
        borrowed = max(0, usage[job.queue] + size - leaf.quota_of(kind))
        if job.job_class is JobClass.GUARANTEED and not within:
            reasons.append(f"{size}: guaranteed jobs run only inside their queue's quota")
            continue
        if idle >= size:
            how = "within quota" if within else f"borrowing {borrowed} idle accelerator(s)"
            return AdmissionDecision(job.job_id, True, size, f"admitted at {size} {kind} {how}", borrowed=borrowed)
        if within:
            plan = _plan_reclaim(tree, job, size, size - idle, running, usage)
            if plan is not None:
                return AdmissionDecision(job.job_id, True, size,
                                         f"admitted at {size} {kind} within quota, reclaiming {size - idle} "
                                         f"from {len(plan)} borrowing job(s)", reclaims=plan)
        reasons.append(f"{size}: {idle} idle" + (", not enough borrowed capacity to reclaim" if within else ""))
    return AdmissionDecision(job.job_id, False, 0, "waiting (gang minimum "
                             f"{job.min_size} does not fit): " + "; ".join(reasons[-2:]))


def admission_order(tree: QueueTree, pending: Iterable[Workload]) -> list[Workload]:
    """Pending jobs in the order admission should try them: queue priority, job priority, FIFO."""
    def key(w: Workload) -> tuple:
        return (-max(tree.queues[q].priority for q in tree.path(w.queue)), -w.priority, w.started_at, w.job_id)
    return sorted(pending, key=key)
