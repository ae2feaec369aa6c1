"""The fleet inventory and node-health policy (pure: no Ray, clock or I/O).

The controller gathers observations (Ray's node table, available resources, placement groups,
agent heartbeats) and calls these functions; ``rayfleet status``, the SDK and the tests read
the frozen results.

Accelerator usage is *derived* from Ray's own accounting rather than tracked by hand: a node's
held accelerators are ``total - available`` of its accelerator resource, and they are attributed
to training, inference or a cordon by the name of the placement group whose bundles hold them
(``rayfleet:train:*`` / Ray Train's groups, ``rayfleet:serve:*`` / Serve replicas,
``rayfleet:cordon:*``). Nothing can drift out of sync with what Ray actually scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from rayfleet.platform.topology import NodeTopology

__all__ = [
    "NodeRecord", "AcceleratorUsage", "NodeStatus", "FleetStatus", "HealthPolicy", "usage_from_observation",
    "classify_placement_group", "CORDON_PG_PREFIX", "TRAIN_PG_PREFIX", "SERVE_PG_PREFIX",
]

CORDON_PG_PREFIX = "rayfleet:cordon:"
TRAIN_PG_PREFIX = "rayfleet:train:"
SERVE_PG_PREFIX = "rayfleet:serve:"


@dataclass(frozen=True)
class NodeRecord:
    """What the controller persists about one node (JSON-serializable fields only)."""

    name: str
    labels: dict
    ray_node_id: str | None = None
    alive: bool = True
    last_heartbeat: float | None = None
    cordoned: bool = False
    cordon_reason: str = ""
    self_check_ok: bool | None = None
    self_check_at: float | None = None
    suspect_reason: str = ""
    agent_info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping) -> "NodeRecord":
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    def with_(self, **changes) -> "NodeRecord":
        return replace(self, **changes)


@dataclass(frozen=True)
class AcceleratorUsage:
    """Accelerator counts on one node by holder."""

    total: int
    free: int
    training: int
    inference: int
    cordoned: int
    other: int


@dataclass(frozen=True)
class NodeStatus:
    """One row of ``rayfleet status``."""

    topology: NodeTopology
    usage: AcceleratorUsage
    health: str  # healthy | suspect | unreachable | dead
    health_reason: str
    cordoned: bool
    cordon_reason: str
    last_heartbeat_age_s: float | None


def classify_placement_group(name: str) -> str:
    """Holder class of a placement group by its name: training, inference, cordoned or other."""
    if name.startswith(CORDON_PG_PREFIX):
        return "cordoned"
    if name.startswith(TRAIN_PG_PREFIX):
        return "training"
    if name.startswith(SERVE_PG_PREFIX) or name.startswith("SERVE_REPLICA"):
        return "inference"
    return "other"


def usage_from_observation(
    *,
    total: float,
    available: float,
    group_holdings: Iterable[tuple[str, float]],
) -> AcceleratorUsage:
    """Split a node's held accelerators among holders.

    Args:
        total: the node's accelerator resource total (e.g. ``GPU`` = 8).
        available: how much of it Ray reports free now.
        group_holdings: ``(placement group name, accelerators its bundles reserve on this node)``.
            A group's reservation counts as held even when no task uses it yet, which is why
            ``held = total - available`` already includes it.
    """
    held = max(0, round(total - available))
    by_class = {"training": 0, "inference": 0, "cordoned": 0}
    for name, amount in group_holdings:
        kind = classify_placement_group(name)
        if kind in by_class:
            by_class[kind] += round(amount)
    attributed = sum(by_class.values())
    # Attribution can exceed `held` for a moment while a group is being removed; clamp.
    if attributed > held:
        scale = held / attributed if attributed else 0.0
        by_class = {k: int(v * scale) for k, v in by_class.items()}
        attributed = sum(by_class.values())
    return AcceleratorUsage(
        total=round(total), free=max(0, round(total) - held), other=held - attributed, **by_class,
    )


@dataclass(frozen=True)
class HealthPolicy:
    """Decides a node's health from its record.

    Attributes:
        heartbeat_timeout_s: a node whose agent has not reported for this long is unreachable.
    """

    heartbeat_timeout_s: float = 15.0

    def decide(self, record: NodeRecord, *, now: float) -> tuple[str, str]:
        """Return ``(health, reason)`` for ``record`` at time ``now`` (seconds, same clock as heartbeats)."""
        if not record.alive:
            return "dead", "Ray reports the node dead"
        if record.self_check_ok is False:
            return "suspect", record.suspect_reason or "GEMM self-check mismatch (possible silent data corruption)"
        if record.last_heartbeat is None:
            return "unreachable", "no heartbeat from its node agent yet"
        age = now - record.last_heartbeat
        if age > self.heartbeat_timeout_s:
            return "unreachable", f"last heartbeat {age:.0f}s ago (> {self.heartbeat_timeout_s:.0f}s)"
        return "healthy", ""


@dataclass(frozen=True)
class FleetStatus:
    """What ``rayfleet status`` and ``fleet.status()`` show: one row per node plus recent events."""

    nodes: tuple[NodeStatus, ...]
    events: tuple  # tuple[state_store.Event, ...], newest last
    decisions: tuple = ()  # the shared autoscaler's recent events (decisions, handovers), newest last
    admissions: tuple = ()  # queued and admitted training jobs (AdmissionRecord JSON), queued first in line order

    def totals(self) -> AcceleratorUsage:
        fields_ = ("total", "free", "training", "inference", "cordoned", "other")
        return AcceleratorUsage(**{f: sum(getattr(n.usage, f) for n in self.nodes) for f in fields_})

    def node(self, name: str) -> NodeStatus:
        for row in self.nodes:
            if row.topology.name == name:
                return row
        raise KeyError(name)
