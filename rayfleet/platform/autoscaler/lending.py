"""Lending: which training to shrink so that a Serve replica fits on a node (pure).

Part of :class:`~rayfleet.platform.autoscaler.policy.AutoscalerPolicy` (the rules are in that
module's doc: cheapest-first, topology-aware, whole DP replicas, guaranteed jobs untouched).
``FleetScratch`` is the mutable copy of the fleet one ``decide`` call works on; ``lend`` picks
nodes for Serve replicas by shrinking the training on them; ``shrink_decisions`` turns what it
took into ``ShrinkTraining`` decisions. No Ray, clock or I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Iterable, Mapping

from rayfleet.platform.autoscaler.types import FleetObservation, ServeObservation, ShrinkTraining, TrainingObservation
from rayfleet.platform.queues import JobClass

__all__ = ["FleetScratch", "accelerator_type_matches", "free_beside_serve", "job_cost", "lend", "node_plan",
           "shrink_decisions"]


def free_beside_serve(free_by_node: Mapping[str, int], serve: Iterable[ServeObservation]) -> dict[str, int]:
    """Free accelerators per node less the room kept for Serve replicas decided and not yet
    running (``unplaced_nodes``): a lender's accelerators look free until the replica holds them,
    so neither growth (the policy) nor queue admission (the controller) may take them."""
    free = dict(free_by_node)
    for s in serve:
        for node in s.unplaced_nodes:
            free[node] = max(0, free.get(node, 0) - s.accelerators_per_replica)
    return free


_CLASS_RANK = {JobClass.ELASTIC: 0, JobClass.OPPORTUNISTIC: 1}  # 2: elastic preempted whole


class FleetScratch:
    """Mutable scratch copy of the fleet for one ``decide`` call (never escapes it)."""

    def __init__(self, obs: FleetObservation) -> None:
        self.free = free_beside_serve(obs.free_by_node, obs.serve)
        self.node_type = obs.node_type
        self.reasons: dict[str, str] = {}
        self.jobs = {t.job_id: t for t in obs.training}
        self.size = {t.job_id: t.size for t in obs.training}
        self.removed: dict[str, list[int]] = defaultdict(list)
        self.freed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.whole_elastic = True  # the lend under way may preempt an elastic job whole (last resort)
        # Room left under each queue limit (QueueGrowthLimits), shared by Serve scale-ups and
        # training growth decided in this call
        self.queue_room = dict(obs.queue_limits.limit_to_room)
        self._by_node: dict[str, list[tuple[str, int]]] | None = None

    @property
    def by_node(self) -> dict[str, list[tuple[str, int]]]:
        """node -> lendable (job, replica index); built only when lending is needed."""
        if self._by_node is None:
            self._by_node = defaultdict(list)
            for t in self.jobs.values():
                if t.job_class is JobClass.GUARANTEED:
                    continue
                for index, nodes in enumerate(t.replica_nodes):
                    for node in nodes:
                        self._by_node[node].append((t.job_id, index))
        return self._by_node


def accelerator_type_matches(work: FleetScratch, node: str, serve: ServeObservation) -> bool:
    """Whether ``node`` has ``serve``'s accelerator type (a node of unknown type is taken to)."""
    return work.node_type.get(node, serve.accelerator_type) == serve.accelerator_type


def job_cost(t: TrainingObservation, now: float, whole: bool, *, restart_cost_s: float) -> tuple:
    """``(priority, class rank, lost accelerator-seconds)`` of taking ``t`` (whole, or one DP replica)."""
    age = max(0.0, now - t.last_snapshot_at_s)
    if whole and t.job_class is JobClass.ELASTIC:  # last resort: snapshot, stop, requeue
        return (t.priority, 2, t.size * restart_cost_s)
    if whole:  # preempted: the work since the last snapshot is lost, then a restart
        lost = t.size * (age + restart_cost_s)
    else:  # flash snapshot first: only the survivors' restart is lost (plus exposure to a stale snapshot)
        lost = (t.size - t.replica_size) * restart_cost_s + 0.01 * age * t.size
    return (t.priority, _CLASS_RANK[t.job_class], lost)


def node_plan(work: FleetScratch, node: str, deficit: int, now: float, *,
              restart_cost_s: float) -> tuple[tuple, list[tuple[str, int]]] | None:
    """Cheapest units on ``node`` freeing >= ``deficit`` there, with the plan's cost.

    A unit is one DP replica of an elastic job (kept >= its minimum) or a whole
    opportunistic job (index -1). Cost = (worst priority/class taken, total lost work).
    """
    units, seen = [], set()
    for job_id, index in work.by_node.get(node, ()):
        if index in work.removed[job_id]:
            continue
        t = work.jobs[job_id]
        whole = t.job_class is JobClass.OPPORTUNISTIC or (
            work.whole_elastic and work.size[job_id] - t.replica_size < t.min_size)
        if whole:
            if job_id in seen:
                continue
            seen.add(job_id)
            here = sum(t.replica_size // len(n) for i, n in enumerate(t.replica_nodes)
                       if node in n and i not in work.removed[job_id])
            units.append((job_cost(t, now, True, restart_cost_s=restart_cost_s), job_id, -1, here))
        else:
            units.append((job_cost(t, now, False, restart_cost_s=restart_cost_s), job_id, index, t.replica_size // len(t.replica_nodes[index])))
    units.sort()
    got, taken, sizes, worst, total = 0, [], {}, (-math.inf,), 0.0
    for cost, job_id, index, here in units:
        if got >= deficit:
            break
        t = work.jobs[job_id]
        if index >= 0:
            left = sizes.get(job_id, work.size[job_id])
            if left - t.replica_size < t.min_size:
                continue
            sizes[job_id] = left - t.replica_size
        taken.append((job_id, index))
        got += here
        worst = max(worst, cost[:2])
        total += cost[2]
    if got < deficit:
        return None
    return (worst + (total,), taken)


def lend(work: FleetScratch, serve: ServeObservation, count: int, now: float, trigger: str, *,
         last_resize: dict, lent: dict, restart_cost_s: float) -> list[str]:
    """Nodes for up to ``count`` Serve replicas freed by shrinking training there, cheapest node
    first (``work``, ``last_resize`` and ``lent`` mutated)."""
    per = serve.accelerators_per_replica
    placed: list[str] = []
    heap = []
    for node, holders in work.by_node.items():
        if holders and accelerator_type_matches(work, node, serve) and per > work.free.get(node, 0):
            plan = node_plan(work, node, per - work.free.get(node, 0), now, restart_cost_s=restart_cost_s)
            if plan:
                heap.append((plan[0], node))
    heapq.heapify(heap)
    while len(placed) < count and heap:
        # Lazy re-evaluation: a plan may have gone stale when an earlier pick shrank the same job.
        cost, node = heapq.heappop(heap)
        deficit = per - work.free.get(node, 0)
        plan = node_plan(work, node, deficit, now, restart_cost_s=restart_cost_s) if deficit > 0 else ((), [])
        if plan is None:
            continue
        if plan[0] != cost and heap and plan[0] > heap[0][0]:
            heapq.heappush(heap, (plan[0], node))
            continue
        taken = plan[1]
        touched: set[str] = set()
        for job_id, index in taken:
            t = work.jobs[job_id]
            indices = range(len(t.replica_nodes)) if index < 0 else [index]
            for i in indices:
                if i in work.removed[job_id]:
                    continue
                work.removed[job_id].append(i)
                for n in t.replica_nodes[i]:
                    share = t.replica_size // len(t.replica_nodes[i])
                    work.free[n] = work.free.get(n, 0) + share
                    work.freed[job_id][n] += share
                    if n != node and work.free[n] >= per and accelerator_type_matches(work, n, serve):
                        heapq.heappush(heap, ((), n))  # a whole preemption freed room elsewhere
                work.size[job_id] -= t.replica_size
            last_resize[job_id] = now
            lent[job_id] = lent.get(job_id, 0) + (t.size if index < 0 else t.replica_size)
            touched.update(n for r in t.replica_nodes for n in r)
            work.reasons[job_id] = f"lend to {serve.deployment} ({trigger}) on {node}"
        assert work.free[node] >= per
        work.free[node] -= per
        placed.append(node)
        # The shrunk jobs' other nodes now offer different plans (e.g. a job at its minimum
        # can only go whole): re-price them, and this node for a further replica.
        for n in touched | {node}:
            deficit = per - work.free.get(n, 0)
            again = node_plan(work, n, deficit, now, restart_cost_s=restart_cost_s) if deficit > 0 else ((), [])
            if again is not None and accelerator_type_matches(work, n, serve):
                heapq.heappush(heap, (again[0], n))
    return placed


def shrink_decisions(work: FleetScratch) -> list[ShrinkTraining]:
    """One ``ShrinkTraining`` per job ``lend`` took replicas from."""
    out = []
    reasons = work.reasons
    for job_id, indices in work.removed.items():
        if not indices:
            continue
        t = work.jobs[job_id]
        freed = dict(work.freed[job_id])
        new_size = max(0, work.size[job_id])
        verb = (f"preempted whole ({t.job_class.value}"
                + (", last resort: at its minimum, snapshot first)" if t.job_class is JobClass.ELASTIC else ")")
                if new_size == 0 else
                f"shrunk {t.size}->{new_size} by {len(indices)} DP replica(s) after a flash snapshot")
        out.append(ShrinkTraining(job_id, new_size, tuple(sorted(indices)), freed,
                                  f"{verb}: {reasons.get(job_id, 'lend to Serve')}",
                                  snapshot_first=t.job_class is JobClass.ELASTIC))
    return out
