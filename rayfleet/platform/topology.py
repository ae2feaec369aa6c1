"""The fleet's topology model: fleet → block → rack → node → accelerator slot.

Design decisions:
- Pure and frozen: no Ray import. The same model is built three ways — synthetically
  (:func:`build_topology`, for ``rayfleet up``, planners and simulators), from node labels
  (:meth:`NodeTopology.from_labels`) and from a running cluster's ``ray.nodes()`` output
  (:meth:`FleetTopology.from_ray_nodes`) — and round-trips through labels exactly.
- The accelerator index on a node *is* its rail: accelerator ``i`` of every node hangs off the
  same leaf switch, so DP/PP peers placed on the same index talk without crossing rails.
- Scale-up domains (NVLink, XPU super-node) group ``scaleup_domain_size / accelerators_per_node``
  consecutive nodes of one type inside a rack; for 8-GPU servers the domain is the node itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

from rayfleet.errors import LabelError, SpecError
from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import AcceleratorSpec, get_accelerator

__all__ = ["AcceleratorSlot", "NodeTopology", "FleetTopology", "build_topology", "parse_accelerator_mix"]


class AcceleratorSlot(NamedTuple):
    """One accelerator: the node it sits on and its index there (= its rail)."""

    node: str
    index: int


@dataclass(frozen=True)
class NodeTopology:
    """Where one server sits and what it carries."""

    name: str
    accelerator_type: str
    num_accelerators: int
    rack: str
    block: str
    nvlink_domain: str
    role: str = "worker"
    ray_node_id: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        get_accelerator(self.accelerator_type)  # raises a clear error for unknown types
        if self.num_accelerators < 0:
            raise SpecError(f"node {self.name}.num_accelerators", self.num_accelerators,
                            "a node cannot carry a negative number of accelerators", "use 0 or more")
        if self.role not in ("head", "worker"):
            raise SpecError(f"node {self.name}.role", self.role, "unknown role", "use 'head' or 'worker'")

    @property
    def accelerator(self) -> AcceleratorSpec:
        return get_accelerator(self.accelerator_type)

    @property
    def slots(self) -> tuple[AcceleratorSlot, ...]:
        return tuple(AcceleratorSlot(self.name, i) for i in range(self.num_accelerators))

    def to_labels(self) -> dict[str, str]:
        """The Ray node labels that describe this node (see :mod:`rayfleet.platform.labels`)."""
        out = {
            L.NODE: self.name,
            L.ACCELERATOR_TYPE: self.accelerator_type,
            L.NUM_ACCELERATORS: str(self.num_accelerators),
            L.RACK: self.rack,
            L.BLOCK: self.block,
            L.NVLINK_DOMAIN: self.nvlink_domain,
            L.ROLE: self.role,
            L.RAY_ACCELERATOR_TYPE: self.accelerator_type,
        }
        for key, value in out.items():
            L.validate_label(key, value, where=f"node {self.name}")
        return out

    def to_resources(self) -> dict[str, float]:
        """Custom Ray resources the node declares besides CPU/GPU counts.

        GPUs go through ``num_gpus``; other accelerator kinds are declared by name here. Every
        node also declares one ``rayfleet_slot_<i>`` per accelerator.
        """
        res: dict[str, float] = {L.slot_resource(i): 1.0 for i in range(self.num_accelerators)}
        if self.accelerator.ray_resource != "GPU" and self.num_accelerators:
            res[self.accelerator.ray_resource] = float(self.num_accelerators)
        return res

    @classmethod
    def from_labels(cls, node_labels: Mapping[str, str], *, ray_node_id: str | None = None) -> "NodeTopology":
        """Rebuild a node from its labels; raise :class:`LabelError` naming a missing/bad key."""
        missing = [k for k in L.REQUIRED_KEYS if k not in node_labels]
        if missing:
            raise LabelError(
                f"node {node_labels.get(L.NODE, ray_node_id)!r} lacks label(s) {missing}. Fix: start "
                "it with `rayfleet up`, the cluster.yaml in this repository, or add them to "
                "`ray start --labels` (see README, 'Node labels')"
            )
        for key in L.REQUIRED_KEYS:
            L.validate_label(key, node_labels[key], where=f"node {node_labels[L.NODE]!r}")
        try:
            count = int(node_labels[L.NUM_ACCELERATORS])
        except ValueError:
            raise LabelError(
                f"label {L.NUM_ACCELERATORS}={node_labels[L.NUM_ACCELERATORS]!r} is not an integer. "
                "Fix: set it to the number of accelerators on the node, e.g. '8'"
            ) from None
        return cls(
            name=node_labels[L.NODE], accelerator_type=node_labels[L.ACCELERATOR_TYPE],
            num_accelerators=count, rack=node_labels[L.RACK], block=node_labels[L.BLOCK],
            nvlink_domain=node_labels[L.NVLINK_DOMAIN], role=node_labels[L.ROLE], ray_node_id=ray_node_id,
        )


@dataclass(frozen=True)
class FleetTopology:
    """All nodes of a fleet. Order is stable (by name) so layouts are reproducible."""

    nodes: tuple[NodeTopology, ...]

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise LabelError(f"node names {dupes} appear more than once. Fix: give every node a unique "
                             f"'{L.NODE}' label")
        object.__setattr__(self, "nodes", tuple(sorted(self.nodes, key=lambda n: n.name)))

    # -- look-ups -------------------------------------------------------------------------
    def node(self, name: str) -> NodeTopology:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def num_accelerators(self) -> int:
        return sum(n.num_accelerators for n in self.nodes)

    def slots(self) -> list[AcceleratorSlot]:
        return [s for n in self.nodes for s in n.slots]

    def accelerator_types(self) -> dict[str, int]:
        """Accelerator type → count in the fleet."""
        out: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            out[n.accelerator_type] += n.num_accelerators
        return dict(out)

    def _group(self, attr: str) -> dict[str, tuple[NodeTopology, ...]]:
        out: dict[str, list[NodeTopology]] = defaultdict(list)
        for n in self.nodes:
            out[getattr(n, attr)].append(n)
        return {k: tuple(v) for k, v in sorted(out.items())}

    def racks(self) -> dict[str, tuple[NodeTopology, ...]]:
        return self._group("rack")

    def blocks(self) -> dict[str, tuple[NodeTopology, ...]]:
        return self._group("block")

    def nvlink_domains(self) -> dict[str, tuple[NodeTopology, ...]]:
        return self._group("nvlink_domain")

    def rails(self) -> dict[int, tuple[AcceleratorSlot, ...]]:
        """Rail index → the slots on that rail, one per node that has it."""
        out: dict[int, list[AcceleratorSlot]] = defaultdict(list)
        for s in self.slots():
            out[s.index].append(s)
        return {k: tuple(v) for k, v in sorted(out.items())}

    def same_domain(self, a: AcceleratorSlot, b: AcceleratorSlot) -> bool:
        """True when two slots share a scale-up (NVLink / super-node) domain."""
        return self.node(a.node).nvlink_domain == self.node(b.node).nvlink_domain

    def subset(self, names: Iterable[str]) -> "FleetTopology":
        keep = set(names)
        return FleetTopology(tuple(n for n in self.nodes if n.name in keep))

    # -- Ray ------------------------------------------------------------------------------
    @classmethod
    def from_ray_nodes(cls, ray_nodes: Iterable[Mapping], *, alive_only: bool = True) -> "FleetTopology":
        """Rebuild from ``ray.nodes()`` output. Nodes without rayfleet labels are skipped."""
        nodes = []
        for entry in ray_nodes:
            if alive_only and not entry.get("Alive", True):
                continue
            node_labels = entry.get("Labels") or {}
            if L.NODE not in node_labels:
                continue
            nodes.append(NodeTopology.from_labels(node_labels, ray_node_id=entry.get("NodeID")))
        return cls(tuple(nodes))


def parse_accelerator_mix(text: str, *, num_nodes: int | None = None) -> list[tuple[str, int]]:
    """Parse ``"H100"`` or ``"H100:2,P800:4"`` into ``[(type, num_nodes), ...]``.

    A single type without a count takes all ``num_nodes`` nodes.
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise SpecError("accelerator", text, "no accelerator type given", "pass e.g. 'H100' or 'H100:2,P800:2'")
    mix: list[tuple[str, int]] = []
    for part in parts:
        name, sep, count = part.partition(":")
        spec = get_accelerator(name)
        if sep:
            try:
                n = int(count)
            except ValueError:
                raise SpecError("accelerator", part, "the node count after ':' is not an integer",
                                "write TYPE:COUNT, e.g. 'H100:2'") from None
        elif len(parts) == 1 and num_nodes is not None:
            n = num_nodes
        else:
            raise SpecError("accelerator", text, f"{part!r} has no node count in a mixed fleet",
                            "write every part as TYPE:COUNT, e.g. 'H100:2,P800:2'")
        if n < 1:
            raise SpecError("accelerator", part, "a node count must be at least 1", "use TYPE:COUNT with COUNT >= 1")
        mix.append((spec.name, n))
    return mix


def build_topology(
    *,
    num_nodes: int,
    accelerator: str = "H100",
    accelerators_per_node: int | None = None,
    num_racks: int = 1,
    racks_per_block: int = 4,
    first_is_head: bool = True,
) -> FleetTopology:
    """A synthetic fleet: ``num_nodes`` servers laid contiguously over racks.

    Nodes fill racks in order (rack ``r00`` gets the first ``ceil(n / racks)`` nodes), racks fill
    blocks in order, and scale-up domains group consecutive same-type nodes in a rack, because
    that is how super-nodes are cabled. ``accelerator`` may be a mix (``"H100:2,P800:4"``), in
    which case the counts must add up to ``num_nodes``.
    """
    if num_nodes < 1:
        raise SpecError("nodes", num_nodes, "a fleet needs at least one node", "pass --nodes 1 or more")
    if num_racks < 1:
        raise SpecError("racks", num_racks, "a fleet needs at least one rack", "pass --racks 1 or more")
    if racks_per_block < 1:
        raise SpecError("racks_per_block", racks_per_block, "must be at least 1", "use 1 or more")
    if accelerators_per_node is not None and accelerators_per_node < 0:
        raise SpecError("accelerators_per_node", accelerators_per_node, "cannot be negative",
                        "pass --accelerators-per-node 0 or more")
    mix = parse_accelerator_mix(accelerator, num_nodes=num_nodes)
    total = sum(n for _, n in mix)
    if total != num_nodes:
        raise SpecError("accelerator", accelerator, f"the node counts add up to {total}, not --nodes {num_nodes}",
                        f"make the counts add up to {num_nodes}, or omit --nodes")
    per_rack = -(-num_nodes // num_racks)
    nodes: list[NodeTopology] = []
    idx = 0
    for type_name, count in mix:
        spec = get_accelerator(type_name)
        per_node = spec.accelerators_per_node if accelerators_per_node is None else accelerators_per_node
        nodes_per_domain = max(1, spec.scaleup_domain_size // max(per_node, 1))
        domain_start, in_domain = idx, 0
        for _ in range(count):
            rack_i = idx // per_rack
            # A scale-up domain never spans racks: it restarts when full or at a rack boundary.
            if in_domain == nodes_per_domain or rack_i != domain_start // per_rack:
                domain_start, in_domain = idx, 0
            in_domain += 1
            name = f"n{idx:04d}"
            nodes.append(NodeTopology(
                name=name, accelerator_type=spec.name, num_accelerators=per_node,
                rack=f"r{rack_i:02d}", block=f"b{rack_i // racks_per_block}",
                nvlink_domain=f"nvl-n{domain_start:04d}",
                role="head" if (first_is_head and idx == 0) else "worker",
            ))
            idx += 1
    return FleetTopology(tuple(nodes))
