"""Layout: which accelerator (node, index) every rank of a plan gets.

Design decisions:
- Ranks are numbered ``tp, cp, dp, pp`` innermost first (see :mod:`.plan`) and consume an
  ordered *slot pool*; the pool is built so that consecutive ranks stay close:
  1. TP groups take an *aligned block* of ``tp`` free slots on one node (indices
     ``[b*tp, (b+1)*tp)``), or ``tp / k`` whole free nodes of one scale-up domain when a TP group
     is larger than a node (super-nodes). Aligned blocks keep TP on NVLink and make every node
     expose the same positions.
  2. Nodes are used in *pattern groups*: a set of blocks (the pattern) that every node of the
     group has free. Position ``j`` of every node in a group is the same accelerator index, so
     DP and PP peers (which sit at the same position of different nodes) share a rail. On an
     unfragmented fleet the pattern is "all blocks", i.e. whole nodes.
  3. Within a pattern group nodes are taken block by block (the block with most usable nodes
     first), then rack and name, so a stage's DP group stays inside a block when it fits.
  Patterns are chosen greedily: the largest pattern whose group can host what is still needed,
  else the pattern with the most capacity, repeated. Exhaustive bin-packing is not worth it:
  the greedy result is rail-aligned on any fleet whose free blocks repeat across nodes.
  4. Nodes of one pattern are dealt to pipeline stages in equal contiguous runs, so the k-th
     node of every stage offers the same rails and PP peers stay rail-aligned.
  EP groups are consecutive ranks of a stage, so patterns holding whole EP groups (when one fits
  a server) are preferred over everything else: the all-to-all is the heaviest MoE traffic.
- Mixed fleets: a rank runs on its DP replica's accelerator type (``plan.replica_accelerators``);
  each type has its own pool, consumed in rank order.
- Held slots (accelerators already allocated) and cordoned nodes are never used.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Literal

from rayfleet.errors import SpecError
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.topology import AcceleratorSlot, FleetTopology, NodeTopology

__all__ = ["Layout", "build_layout", "rank_groups", "GroupKind"]

GroupKind = Literal["tp", "cp", "dp", "pp", "ep", "edp"]


@dataclass(frozen=True)
class Layout:
    """A plan placed on a fleet.

    Attributes:
        plan: the plan.
        rank_to_slot: ``rank_to_slot[r]`` is rank ``r``'s (node, accelerator index).
        rank_to_accelerator: accelerator type of each rank.
    """

    plan: ParallelPlan
    rank_to_slot: tuple[AcceleratorSlot, ...]
    rank_to_accelerator: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.rank_to_slot)

    def slot(self, rank: int) -> AcceleratorSlot:
        return self.rank_to_slot[rank]

    def nodes(self) -> list[str]:
        """Nodes used, in first-use order."""
        return list(dict.fromkeys(s.node for s in self.rank_to_slot))

    def groups(self, kind: GroupKind) -> list[list[int]]:
        return rank_groups(self.plan, kind)


def rank_groups(plan: ParallelPlan, kind: GroupKind) -> list[list[int]]:
    """The rank groups of one parallel dimension, each in coordinate order.

    ``tp``/``cp``/``dp``/``pp`` vary one attention-grid coordinate; ``ep``/``edp`` vary one
    expert-grid coordinate within a stage.
    """
    out: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        key = {
            "tp": (c.cp, c.dp, c.pp), "cp": (c.tp, c.dp, c.pp), "dp": (c.tp, c.cp, c.pp),
            "pp": (c.tp, c.cp, c.dp), "ep": (c.etp, c.edp, c.pp), "edp": (c.etp, c.ep, c.pp),
        }[kind]
        out[key].append(rank)
    return list(out.values())


def _node_order_key(node: NodeTopology) -> tuple:
    return (node.block, node.rack, node.nvlink_domain, node.name)


def _block_chunks(nodes: list[NodeTopology], needed: int, tp: int, held: set[AcceleratorSlot],
                  stage_size: int, ep_group: int = 1) -> list[list[AcceleratorSlot]]:
    """Node chunks (the slots taken on one node, in TP-aligned blocks of ``tp``) for ``needed``
    ranks, in pattern-group order.

    Patterns that hold whole EP groups (``ep_group`` = ep * etp consecutive ranks, when larger
    than a TP group) come first, so the all-to-all stays on NVLink wherever the fleet allows;

    then a pattern whose ranks per node divide ``stage_size`` (ranks of one pipeline stage) is
    preferred among equals, so that no stage starts in the middle of a node.
    """
    masks: dict[str, int] = {}
    for node in nodes:
        mask = 0
        for b in range(node.num_accelerators // tp):
            if all(AcceleratorSlot(node.name, i) not in held for i in range(b * tp, (b + 1) * tp)):
                mask |= 1 << b
        if mask:
            masks[node.name] = mask
    by_name = {n.name: n for n in nodes}
    remaining = needed // tp
    chunks: list[list[AcceleratorSlot]] = []  # one per node use, in pattern-group order
    max_blocks = max((n.num_accelerators // tp for n in nodes), default=0)
    while remaining > 0 and masks:
        distinct: dict[int, int] = defaultdict(int)
        for m in masks.values():
            distinct[m] += 1
        if max_blocks <= 8:  # every non-empty subset of blocks is a candidate pattern
            candidates = set(range(1, 1 << max_blocks))
        else:
            candidates = set(distinct) | {m & -m for m in distinct}
        best = None
        for pattern in candidates:
            width = bin(pattern).count("1")
            supporters = sum(c for m, c in distinct.items() if m & pattern == pattern)
            if not supporters:
                continue
            capacity = width * supporters
            # covers what is left -> widest pattern (fewest nodes); else the most capacity
            covers = capacity >= remaining
            # a server whose rank count is a multiple of the EP group keeps EP on NVLink
            ep_whole = ep_group <= tp or (width * tp) % ep_group == 0
            score = (ep_whole, covers, stage_size % (width * tp) == 0, width if covers else capacity, -pattern)
            if best is None or score > best[0]:
                best = (score, pattern, width)
        _, pattern, width = best
        group = [by_name[name] for name, m in masks.items() if m & pattern == pattern]
        per_block: dict[str, int] = defaultdict(int)
        for node in group:
            per_block[node.block] += 1
        group.sort(key=lambda n: (-per_block[n.block],) + _node_order_key(n))
        blocks = [b for b in range(max_blocks) if pattern >> b & 1]
        for node in group:
            if remaining <= 0:
                break
            take = blocks[:remaining]
            chunks.append([AcceleratorSlot(node.name, i) for b in take for i in range(b * tp, (b + 1) * tp)])
            remaining -= len(take)
            masks[node.name] &= ~sum(1 << b for b in take)
            if not masks[node.name]:
                del masks[node.name]
    if remaining > 0:
        free = needed - remaining * tp
        raise SpecError("layout", f"{needed} ranks", f"only {free} free accelerators sit in aligned, fully free "
                        f"blocks of tp={tp}", "free or add accelerators, uncordon nodes, or choose a smaller tp/world")
    return chunks


def _order_cost(pool: list[AcceleratorSlot], plan: ParallelPlan, rack_of: dict[str, str]) -> int:
    """Rail changes and rack crossings of DP and PP neighbours if rank ``r`` takes ``pool[r]``."""
    stage = plan.tp * plan.cp * plan.dp
    cost = 0
    for r in range(len(pool) - stage):  # PP neighbours
        a, b = pool[r], pool[r + stage]
        if a.node != b.node:
            cost += (a.index != b.index) + (rack_of[a.node] != rack_of[b.node])
    step = plan.tp * plan.cp
    for first in range(0, len(pool), stage):  # DP groups of each stage
        for offset in range(step):
            lanes: dict[str, list[int]] = defaultdict(list)
            prev = None
            for k in range(plan.dp):
                slot = pool[first + offset + k * step]
                lanes[slot.node].append(slot.index)
                if prev is not None and prev.node != slot.node:
                    cost += rack_of[prev.node] != rack_of[slot.node]
                prev = slot
            rails = list(lanes.values())
            for x, y in zip(rails, rails[1:]):
                cost += sum(i != j for i, j in zip(x, y))
    return cost


def _deal_to_stages(chunks: list[list[AcceleratorSlot]], num_stages: int) -> list[AcceleratorSlot]:
    """Order node chunks stage by stage so PP peers share rails.

    Chunks with the same slot pattern are dealt to stages in equal, contiguous runs, so the k-th
    node of every stage has the same free rails; what does not divide evenly fills the stages
    last (and may change rail there).
    """
    total = sum(len(c) for c in chunks)
    stage_size = total // num_stages
    by_pattern: dict[tuple[int, ...], list[list[AcceleratorSlot]]] = defaultdict(list)
    for chunk in chunks:
        by_pattern[tuple(s.index for s in chunk)].append(chunk)
    stages: list[list[AcceleratorSlot]] = [[] for _ in range(num_stages)]
    leftovers: list[AcceleratorSlot] = []
    for group in by_pattern.values():
        per_stage = len(group) // num_stages
        for s in range(num_stages):
            for chunk in group[s * per_stage:(s + 1) * per_stage]:
                stages[s] += chunk
        for chunk in group[num_stages * per_stage:]:
            leftovers += chunk
    for stage in stages:
        take = stage_size - len(stage)
        stage += leftovers[:take]
        leftovers = leftovers[take:]
    return [slot for stage in stages for slot in stage]


def _domain_pool(nodes: list[NodeTopology], needed: int, tp: int, held: set[AcceleratorSlot]) -> list[AcceleratorSlot]:
    """Ordered slots for TP groups larger than a node: ``tp / k`` whole nodes of one domain."""
    domains: dict[str, list[NodeTopology]] = defaultdict(list)
    for node in sorted(nodes, key=_node_order_key):
        if node.num_accelerators and all(s not in held for s in node.slots):
            domains[node.nvlink_domain].append(node)
    per_node = min((n.num_accelerators for n in nodes), default=1)
    nodes_per_group = tp // per_node
    pool: list[AcceleratorSlot] = []
    for members in domains.values():
        for g in range(len(members) // nodes_per_group):
            if len(pool) >= needed:
                break
            for node in members[g * nodes_per_group:(g + 1) * nodes_per_group]:
                pool += list(node.slots)
    if len(pool) < needed:
        raise SpecError("layout", f"{needed} ranks", f"a TP group of {tp} needs {nodes_per_group} fully free nodes of "
                        f"one scale-up domain, and only {len(pool) // tp} such groups exist",
                        "use a TP degree that fits one node, or free whole super-nodes")
    return pool[:needed]


def build_layout(plan: ParallelPlan, topology: FleetTopology, *, held: Iterable[AcceleratorSlot] = (),
                 cordoned: Iterable[str] = (), accelerator_type: str | None = None) -> Layout:
    """Place every rank of ``plan`` on a free accelerator of ``topology``.

    Args:
        plan: a validated plan (its world size is the number of ranks placed).
        topology: the fleet.
        held: slots already allocated to other work.
        cordoned: node names that must not be used.
        accelerator_type: for a homogeneous plan on a mixed fleet, which type to use
            (default: the type with the most free accelerators).

    Raises:
        SpecError: when the free accelerators cannot host the plan's TP groups.
    """
    held_set, cordoned_set = set(held), set(cordoned)
    usable = [n for n in topology.nodes if n.name not in cordoned_set and n.num_accelerators]
    if plan.replica_accelerators is not None:
        rank_types = [plan.replica_accelerators[plan.coords(r).dp] for r in range(plan.world_size)]
    else:
        if accelerator_type is None:
            free: dict[str, int] = defaultdict(int)
            for node in usable:
                free[node.accelerator_type] += sum(1 for s in node.slots if s not in held_set)
            if not free:
                raise SpecError("layout", topology.num_accelerators, "no usable accelerators",
                                "uncordon nodes or release held accelerators")
            accelerator_type = max(sorted(free), key=free.__getitem__)
        rank_types = [accelerator_type] * plan.world_size
    needed: dict[str, int] = defaultdict(int)
    for t in rank_types:
        needed[t] += 1
    pools: dict[str, list[AcceleratorSlot]] = {}
    for type_name, count in needed.items():
        nodes = [n for n in usable if n.accelerator_type == type_name]
        if not nodes:
            raise SpecError("layout", type_name, "the plan needs this accelerator type but no usable node has it",
                            "plan for the accelerator types the fleet has")
        per_node = min(n.num_accelerators for n in nodes)
        if plan.tp <= per_node:
            # ranks of this type per stage: all of a stage, or its replicas of this type
            ep_group = plan.ep * plan.etp if plan.ep * plan.etp <= per_node else 1
            chunks = _block_chunks(nodes, count, plan.tp, held_set, count // plan.pp, ep_group)
            dealt = _deal_to_stages(chunks, plan.pp)
            if plan.replica_accelerators is None and plan.pp > 1:
                # Dealing aligns PP rails but may scatter a stage's DP group over racks: keep
                # whichever order costs fewer rail changes and rack crossings.
                in_order = [slot for chunk in chunks for slot in chunk]
                rack_of = {n.name: n.rack for n in nodes}
                dealt = min((dealt, in_order), key=lambda pool: _order_cost(pool, plan, rack_of))
            pools[type_name] = dealt
        else:
            pools[type_name] = _domain_pool(nodes, count, plan.tp, held_set)
    cursor: dict[str, int] = defaultdict(int)
    slots = []
    for t in rank_types:
        slots.append(pools[t][cursor[t]])
        cursor[t] += 1
    return Layout(plan=plan, rank_to_slot=tuple(slots), rank_to_accelerator=tuple(rank_types))
