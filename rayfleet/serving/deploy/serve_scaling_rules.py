"""The Serve shell's pure rules: what it reports to the shared autoscaler and when a lent replica may start.

No Ray, clock or I/O (times are passed in), so they are unit-tested alone and the Serve shell
(``serving.serve_scaling_shell``) stays a thin actor that gathers, calls and acts:
- ``serve_observation``: a pool's ``ServeObservation`` from its load, KV usage and lent replicas;
- ``desired_replicas``: Serve's own autoscaling rule (``ceil(in flight / target)`` in bounds);
- ``RoomWatch``: when the accelerator the policy freed may take the lent replica;
- ``free_accelerators_of_type``: what ``RoomWatch`` is fed (only the pool's accelerator type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from rayfleet.platform import labels as L
from rayfleet.platform.autoscaler.types import ServeObservation

__all__ = ["ServeShellConfig", "LentReplica", "p95", "RoomWatch", "lender_settled", "desired_replicas",
           "serve_observation", "SETTLED_HOLD_S", "free_accelerators_of_type"]


@dataclass(frozen=True)
class ServeShellConfig:
    ttft_slo_s: float = 1.0  # the deployment's TTFT SLO (p95)
    target_ongoing_requests: float = 4.0  # requests in flight per replica before another is wanted
    max_replicas: int = 8  # of the scaled role, base replicas included
    role: str | None = None  # pool that grows: None = colocated, or decode when disaggregated
    interval_s: float = 1.0
    window_s: float = 10.0  # TTFT p95 window
    drain_timeout_s: float = 120.0
    # From raising the bounds to the replica RUNNING: a vLLM engine start is minutes on a busy
    # CPU (seen: 7 min at load average 37); past it the lend is given back (``_add``).
    replica_start_timeout_s: float = 300.0


@dataclass
class LentReplica:
    """One replica the autoscaler added (times are wall-clock seconds)."""

    name: str
    app_name: str
    node: str
    decided_at: float
    placed_at: float | None = None  # its accelerator was free and Serve was asked to start it
    running_at: float | None = None
    removal_decided_at: float | None = None
    removed_at: float | None = None
    error: str = ""

    @property
    def handover_s(self) -> float | None:
        return None if self.running_at is None else self.running_at - self.decided_at


def p95(values: Sequence[float]) -> float:
    """Nearest-rank 95th percentile; 0 for no values.

    >>> p95([0.1] * 19 + [5.0])
    0.1
    >>> p95([0.1] * 18 + [5.0] * 2)
    5.0
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


SETTLED_HOLD_S = 1.0  # how long the lender must look settled (``RoomWatch``)


class RoomWatch:
    """When a lent replica may be placed (pure; fed one observation at a time).

    Ready once ``node`` has ``count`` free accelerators and the lender has settled
    (``lender_settled``) for ``hold_s`` without a break, or after ``settle_s`` with room on the
    node (a lender that never re-forms). The hold is there because nodes report their free
    resources one by one: while the lender's old layout is released, one node may already show
    its accelerators free and another not yet, which looks settled for a moment (seen: the
    replica then raced the job's new placement group and started 63 s late).
    ``reforming=False`` (the decision names no job re-forming: free room, or lenders preempted
    whole, which never re-form on their own): ready as soon as the node has room. Waiting for a
    paused lender to "settle" waited out ``settle_s`` (seen live: 90 s of a 99 s handover).
    """

    def __init__(self, node: str, count: int, *, settle_s: float, hold_s: float = SETTLED_HOLD_S,
                 reforming: bool = True) -> None:
        self.node, self.count, self.settle_s, self.hold_s = node, count, settle_s, hold_s
        self.reforming = reforming
        self.room_since: float | None = None
        self.settled_since: float | None = None

    def ready(self, now: float, free_by_node: dict[str, float], pending_lent: int) -> bool:
        if free_by_node.get(self.node, 0) < self.count:
            self.room_since = self.settled_since = None
            return False
        if not self.reforming:
            return True
        self.room_since = self.room_since if self.room_since is not None else now
        if lender_settled(free_by_node, pending_lent):
            self.settled_since = self.settled_since if self.settled_since is not None else now
        else:
            self.settled_since = None
        return ((self.settled_since is not None and now - self.settled_since >= self.hold_s)
                or now - self.room_since >= self.settle_s)


def lender_settled(free_by_node: dict[str, float], pending_lent: int) -> bool:
    """True when no accelerator is free beyond those lent and not yet taken (pure): the lender
    holds its new layout, so a replica placed now can only land on a lent one."""
    return sum(free_by_node.values()) <= pending_lent


def free_accelerators_of_type(nodes: Sequence[Mapping], available_by_node_id: Mapping[str, Mapping[str, float]], *,
                              resource: str, accelerator_type: str) -> dict[str, float]:
    """rayfleet node name -> free ``resource`` (``GPU``, ``XPU``...) of each live node whose
    accelerator-type label is ``accelerator_type`` (pure; ``nodes`` as ``ray.nodes()`` lists them).

    Only these nodes can take the pool's lent replica, so only they say whether the lender has
    settled (``lender_settled``). Counting every node's free GPUs made a fleet with idle
    accelerators of another type never look settled: the replica then waited out ``settle_s``
    (seen in the vLLM tier: an idle A100 node held the H100 decode pool's lend back 90 s).
    """
    out: dict[str, float] = {}
    for node in nodes:
        labels = node.get("Labels") or {}
        if node.get("Alive") and labels.get(L.ACCELERATOR_TYPE) == accelerator_type:
            out[labels.get(L.NODE, "")] = available_by_node_id.get(node["NodeID"], {}).get(resource, 0)
    return out


def desired_replicas(in_flight: int, *, target_ongoing_requests: float, min_replicas: int, max_replicas: int) -> int:
    """Serve's autoscaling rule: ``ceil(in_flight / target)`` clamped to ``[min, max]``.

    >>> desired_replicas(9, target_ongoing_requests=4, min_replicas=1, max_replicas=8)
    3
    >>> desired_replicas(0, target_ongoing_requests=4, min_replicas=1, max_replicas=8)
    1
    """
    want = math.ceil(in_flight / max(target_ongoing_requests, 1e-9))
    return max(min_replicas, min(max_replicas, want))


def serve_observation(*, deployment: str, accelerator_type: str, accelerators_per_replica: int,
                      load: dict, kv_usage_by_replica: dict[str, float], base_nodes: Sequence[str],
                      lent: Sequence[LentReplica], config: ServeShellConfig, pool_key: str = "") -> ServeObservation:
    """What the shell reports (pure): ``load`` is the ingress's ``load(window_s)`` (or a vLLM
    pool's, with its TTFT p95 already taken from vLLM's histogram: ``ttft_p95_s``, and how old
    its figures may be: ``age_s``); lent
    replicas count as running once the router polled them, as pending before. Lent replicas
    come last in ``replica_nodes`` so that the policy's scale-down names their nodes.
    ``pool_key``: the pool's admission record name, when it may have been admitted through a queue."""
    base = len(base_nodes)
    active = [r for r in lent if r.removal_decided_at is None and not r.error]
    running = [r for r in active if r.running_at is not None]
    pending = [r for r in active if r.running_at is None]
    return ServeObservation(
        deployment=deployment, accelerator_type=accelerator_type, accelerators_per_replica=accelerators_per_replica,
        running_replicas=base + len(running), pending_replicas=len(pending),
        desired_replicas=desired_replicas(int(load.get("in_flight", 0)), target_ongoing_requests=config.target_ongoing_requests,
                                          min_replicas=base, max_replicas=config.max_replicas),
        replica_nodes=tuple(base_nodes) + tuple(r.node for r in running + pending),
        min_replicas=base, max_replicas=config.max_replicas,
        # Room is kept until the replica runs, not only until its bounds rise: Serve reserves the
        # accelerator some time after that, and a vLLM replica takes minutes to start; seen live:
        # the policy grew the lender back onto the "free" accelerator meanwhile.
        unplaced_nodes=tuple(r.node for r in pending),
        queue_depth=float(load.get("waiting_first_token", 0)),
        ttft_p95_s=float(load["ttft_p95_s"]) if "ttft_p95_s" in load else p95(load.get("ttft_s", ())),
        ttft_slo_s=config.ttft_slo_s, kv_usage=max(kv_usage_by_replica.values(), default=0.0), pool_key=pool_key,
        load_age_s=float(load.get("age_s", 0.0)))
