"""The simulated fleet's mutable state: free accelerators per node and running training jobs.

Design decisions:
- Nodes are kept in buckets by free count so that best-fit placement of a replica and "how
  many replicas of size r fit" are O(accelerators per node), not O(nodes): the 8,192-accelerator
  run places thousands of replicas per simulated day.
- Buckets are insertion-ordered dicts (not sets) so that runs are reproducible across processes
  (set order of strings depends on PYTHONHASHSEED).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayfleet.platform.autoscaler.policy import TrainingObservation
from rayfleet.platform.queues import JobClass, Workload
from rayfleet.platform.sim.workload import TrainingArrival

__all__ = ["SimFleet", "SimJob"]


class SimFleet:
    def __init__(self, num_nodes: int, accelerators_per_node: int, accelerator_type: str) -> None:
        self.per_node = accelerators_per_node
        self.kind = accelerator_type
        self.nodes = [f"n{i:05d}" for i in range(num_nodes)]
        self.free = {n: accelerators_per_node for n in self.nodes}
        self.node_type = {n: accelerator_type for n in self.nodes}
        self._bucket: list[dict[str, None]] = [dict() for _ in range(accelerators_per_node + 1)]
        self._placeable: dict[int, int] = {}  # replica size -> count, cleared on every change
        for n in self.nodes:
            self._bucket[accelerators_per_node][n] = None

    @property
    def num_accelerators(self) -> int:
        return len(self.nodes) * self.per_node

    def total_free(self) -> int:
        return sum(f * len(b) for f, b in enumerate(self._bucket))

    def _move(self, node: str, new: int) -> None:
        old = self.free[node]
        assert 0 <= new <= self.per_node, (node, old, new)
        del self._bucket[old][node]
        self._bucket[new][node] = None
        self.free[node] = new
        self._placeable.clear()

    def take(self, node: str, count: int) -> None:
        self._move(node, self.free[node] - count)

    def give(self, node: str, count: int) -> None:
        self._move(node, self.free[node] + count)

    def placeable(self, size: int) -> int:
        """Replicas of ``size`` accelerators (each on one node) that fit now."""
        count = self._placeable.get(size)
        if count is None:
            count = self._placeable[size] = sum((f // size) * len(self._bucket[f]) for f in range(size, self.per_node + 1))
        return count

    def place(self, size: int) -> str | None:
        """Best fit: the fullest node that still holds ``size``; reserves it."""
        for f in range(size, self.per_node + 1):
            if self._bucket[f]:
                node = next(reversed(self._bucket[f]))
                self.take(node, size)
                return node
        return None


@dataclass(eq=False)
class SimJob:
    """A training job during the simulation (mutable; the policy sees a frozen observation)."""

    arrival: TrainingArrival
    min_size: int
    kind: str = "H100"
    replica_nodes: list[str] = field(default_factory=list)
    work_done: float = 0.0
    start_s: float | None = None
    paused_until: float = 0.0
    last_snapshot_s: float = 0.0
    admitted_size: int = 0
    queued_since: float = 0.0
    queue_wait_s: float = 0.0
    preemptions: int = 0
    resizes: int = 0
    size: int = 0  # accelerators held; kept in step with replica_nodes by changed()
    _obs: TrainingObservation | None = None
    _workload: Workload | None = None

    @property
    def job_id(self) -> str:
        return self.arrival.job_id

    def changed(self) -> None:
        """Call after any change to ``replica_nodes`` (or what the policy sees)."""
        self.size = len(self.replica_nodes) * self.arrival.replica_size
        self._obs = None
        self._workload = None

    def workload(self, *, pending: bool = False) -> Workload:
        a = self.arrival
        if pending:
            return Workload(a.job_id, a.queue, self.kind, 0, self.min_size, a.size, a.replica_size, a.job_class,
                            a.priority, self.queued_since)
        if self._workload is None:
            self._workload = Workload(a.job_id, a.queue, self.kind, self.size, self.min_size, a.size, a.replica_size,
                                      a.job_class, a.priority, self.start_s or 0.0)
        return self._workload

    def observation(self, *, as_class: JobClass | None = None) -> TrainingObservation:
        if self._obs is None:
            a = self.arrival
            self._obs = TrainingObservation(
                job_id=a.job_id, queue=a.queue, accelerator_type=self.kind, job_class=as_class or a.job_class,
                size=self.size, min_size=self.min_size, max_size=a.size, replica_size=a.replica_size,
                replica_nodes=tuple((n,) for n in self.replica_nodes), priority=a.priority,
                admitted_size=self.admitted_size, last_snapshot_at_s=self.last_snapshot_s)
        return self._obs
