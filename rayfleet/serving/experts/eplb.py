"""Expert-parallel load balancing (EPLB): where redundant expert replicas go, and which replica
each routed token uses.

Vocabulary. A *logical* expert is one of the model's ``E`` experts of an MoE layer. A
*physical* expert is one copy of a logical expert's weights in one slot of one device; a layer
has ``P >= E`` of them, ``P / D`` slots on each of ``D`` devices (physical expert ``p`` lives
on device ``p // (P / D)``). Loads are token counts (routed copies) per window, or any
non-negative quantity proportional to expert compute.

Design decisions:
- One pure module, tensors in and tensors out, no Ray, clock or I/O: engines count tokens per
  expert (``MoELayer.last_tokens_per_expert``); whatever keeps the load history and applies
  placements to running replicas (a thin actor, not here) calls these functions, and so do the
  unit tests and ``benchmarks/eplb.py``.
- The placement algorithm is DeepSeek's published EPLB (github.com/deepseek-ai/EPLB), written
  here from its description, and its README example is reproduced exactly by a unit test:
  (1) pack expert groups onto nodes evenly, (2) replicate the experts of each node onto that
  node's slots, always copying the expert with the heaviest load per replica, (3) pack the
  node's physical experts onto its devices evenly. Group-aligned placement keeps
  group-limited routing inside a node; when groups cannot be split evenly over nodes the same
  steps run with one group and one node (the "global" policy). Greedy packing is not optimal
  but runs in milliseconds for DeepSeek-V3 sizes; an exact solver would not.
- Ties break towards the lower index everywhere (stable sorts, first argmin/argmax), so a
  placement is a deterministic function of its inputs.
- Replicas are sized from a high percentile of recent load windows (``expert_demand``), not the
  mean: serving latency is set by the busiest device in the worst step, and an expert that is
  hot in one window out of five has a low mean but needs its replicas when the burst comes.
- The router (``route_to_replicas``) sends each routed copy to the least-loaded replica of its
  expert. Done one token at a time this is a k-way merge of each replica's chain of load
  levels (base, base + 1, ...), so it is computed exactly as one sort per expert, with no
  Python loop over tokens.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from rayfleet.errors import SpecError

__all__ = [
    "ExpertPlacement", "ReplicaRoute", "expert_demand", "rebalance_experts",
    "contiguous_placement", "device_load", "balance_ratio", "route_to_replicas",
]


class ExpertPlacement(NamedTuple):
    """Where every physical expert of every MoE layer lives.

    physical_to_logical: ``[L, P]`` int64, the logical expert held by physical slot ``p``.
    logical_to_physical: ``[L, E, R]`` int64, the physical ids of each logical expert's
        replicas in replica-rank order, padded with -1; ``R`` is the largest replica count.
    logical_replica_count: ``[L, E]`` int64, replicas per logical expert (>= 1, sums to P).
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_replica_count: torch.Tensor


class ReplicaRoute(NamedTuple):
    """physical_idx: ``[T, k]`` int64 physical expert of each routed copy.
    physical_load: ``[P]`` int64 load per physical expert after these tokens."""

    physical_idx: torch.Tensor
    physical_load: torch.Tensor


def expert_demand(load_history: torch.Tensor, *, percentile: float = 90.0) -> torch.Tensor:
    """Per-expert demand: the ``percentile``-th percentile of each expert's load over windows.

    load_history: ``[W, L, E]`` load per window (equal-length windows, e.g. tokens per expert
        counted over the last N engine steps each). Returns ``[L, E]`` float32, same units.
    ``percentile=50`` is the median; 100 is the peak window. Interpolates linearly.
    """
    if load_history.dim() != 3 or load_history.shape[0] == 0:
        raise SpecError("load_history", tuple(load_history.shape),
                        "must be [windows, layers, experts] with at least one window",
                        "stack per-window [layers, experts] loads along a new first dimension")
    if not 0.0 <= percentile <= 100.0:
        raise SpecError("percentile", percentile, "must lie in [0, 100]", "pass e.g. 90 for p90")
    history = load_history.detach().to("cpu", torch.float32)
    if bool((history < 0).any()):
        raise SpecError("load_history", "negative entries", "loads are token counts",
                        "pass non-negative loads")
    return torch.quantile(history, percentile / 100.0, dim=0)


def _pack_evenly(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy balanced packing of ``n`` items into ``num_packs`` packs of ``n / num_packs`` each.

    weight: ``[X, n]`` float64, X independent rows. Returns ``(pack, slot)``, both ``[X, n]``
    int64: the pack of each item and its position in that pack (order of arrival). Heaviest
    item first, each to the lightest pack that still has room (longest-processing-time).
    """
    rows, n = weight.shape
    capacity = n // num_packs
    if capacity == 1:  # every order is equally balanced; keep items where they are
        return (torch.arange(n).expand(rows, n).clone(), torch.zeros(rows, n, dtype=torch.int64))
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    pack = torch.empty(rows, n, dtype=torch.int64)
    slot = torch.empty(rows, n, dtype=torch.int64)
    pack_load = torch.zeros(rows, num_packs, dtype=torch.float64)
    pack_fill = torch.zeros(rows, num_packs, dtype=torch.int64)
    row = torch.arange(rows)
    for j in range(n):  # items in turn; all rows at once
        item = order[:, j]
        open_load = torch.where(pack_fill < capacity, pack_load, torch.inf)
        chosen = open_load.argmin(dim=1)  # first lightest on ties
        pack[row, item] = chosen
        slot[row, item] = pack_fill[row, chosen]
        pack_load[row, chosen] += weight[row, item]
        pack_fill[row, chosen] += 1
    return pack, slot


def _replicate(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``n`` experts ``num_physical >= n`` replicas, each extra one to the expert with the
    heaviest load per replica (this greedy minimises the largest per-replica load).

    weight: ``[X, n]``. Returns ``(physical_to_item [X, num_physical], replica_rank
    [X, num_physical], count [X, n])``. Physical ids ``0..n-1`` are each item's first replica;
    the extra replicas follow in the order they were added.
    """
    rows, n = weight.shape
    row = torch.arange(rows)
    physical_to_item = torch.arange(num_physical).repeat(rows, 1)
    replica_rank = torch.zeros(rows, num_physical, dtype=torch.int64)
    count = torch.ones(rows, n, dtype=torch.int64)
    for p in range(n, num_physical):
        item = (weight / count).argmax(dim=1)  # first heaviest on ties
        physical_to_item[:, p] = item
        replica_rank[:, p] = count[row, item]
        count[row, item] += 1
    return physical_to_item, replica_rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations ``[X, n]``."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv


def _checked_demand(demand: torch.Tensor) -> torch.Tensor:
    """``demand`` as a float64 CPU ``[L, E]`` tensor, or ``SpecError``."""
    if demand.dim() != 2:
        raise SpecError("demand", tuple(demand.shape), "must be [layers, logical experts]",
                        "pass one row of expert loads per MoE layer")
    weight = demand.detach().to("cpu", torch.float64)
    if bool((weight < 0).any()) or not bool(torch.isfinite(weight).all()):
        raise SpecError("demand", "negative or non-finite entries", "loads are token counts",
                        "pass finite, non-negative loads")
    return weight


def _check_fleet(*, num_logical: int, num_physical_experts: int, num_groups: int, num_nodes: int,
                 num_devices: int, policy: str) -> None:
    for name, value in (("num_physical_experts", num_physical_experts), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_devices", num_devices)):
        if not isinstance(value, int) or value < 1:
            raise SpecError(name, value, "must be a positive integer", f"pass {name} >= 1")
    if num_physical_experts < num_logical:
        raise SpecError("num_physical_experts", num_physical_experts,
                        f"fewer slots than the {num_logical} logical experts; each needs a replica",
                        f"use at least {num_logical} physical experts")
    if num_physical_experts % num_devices:
        raise SpecError("num_physical_experts", num_physical_experts,
                        f"not divisible by num_devices={num_devices} (every device has equal slots)",
                        f"use a multiple of {num_devices}, e.g. "
                        f"{-(-num_physical_experts // num_devices) * num_devices}")
    if num_logical % num_groups:
        raise SpecError("num_groups", num_groups, f"does not divide the {num_logical} experts",
                        "use the model's expert-group count (1 when it has no groups)")
    if num_devices % num_nodes:
        raise SpecError("num_devices", num_devices, f"not divisible by num_nodes={num_nodes}",
                        "give every node the same number of expert-parallel devices")
    if policy not in ("auto", "hierarchical", "global"):
        raise SpecError("policy", policy, "unknown policy", "use 'auto', 'hierarchical' or 'global'")
    if policy == "hierarchical" and num_groups % num_nodes:
        raise SpecError("num_groups", num_groups,
                        f"not divisible by num_nodes={num_nodes}, so groups cannot be split "
                        "evenly over nodes", "use policy='global' (or 'auto')")


def rebalance_experts(demand: torch.Tensor, *, num_physical_experts: int, num_groups: int,
                      num_nodes: int, num_devices: int,
                      policy: Literal["auto", "hierarchical", "global"] = "auto") -> ExpertPlacement:
    """Replicate and place experts so that every device gets about the same load.

    demand: ``[L, E]`` load per logical expert (e.g. ``expert_demand`` of recent windows).
    num_physical_experts: ``P``, slots per layer over all devices; a multiple of num_devices.
    num_groups: expert groups of the model (experts ``[g*E/G, (g+1)*E/G)`` form group g).
    num_nodes / num_devices: the expert-parallel fleet; devices split evenly over nodes.
    policy: "hierarchical" keeps each group and all its replicas on one node; "global" places
        replicas anywhere; "auto" computes both (when num_nodes divides num_groups) and takes,
        per layer, the hierarchical one unless its max/mean device load on ``demand`` (even
        split, ``device_load``) is worse than the global one's: keeping groups on nodes saves
        cross-node traffic, but under hard skew a node holding the hot groups is a bound no
        device placement can beat, and then auto must not pay it.

    Steps (the worked example in tests/unit/serving/test_eplb.py follows them for layer 0):
      1. group loads -> pack groups onto nodes, ``G / N`` per node; renumber logical experts
         node-major (node 0's groups first, in packing order);
      2. within each node, replicate its ``E / N`` experts onto its ``P / N`` slots;
      3. within each node, pack its physical experts (load = demand / replicas) onto its
         ``D / N`` devices, ``P / D`` per device; slot order on a device is packing order;
      4. undo the renumbering and build the maps.
    Worked example (the deepseek-ai/EPLB README, layer 0: 12 experts in 4 groups, 16 slots on
    2 nodes x 4 GPUs): (1) group loads [262, 330, 116, 325] -> node 0 takes groups 1 and 2
    (446), node 1 groups 3 and 0 (587); (2) node 0 copies experts 5 (165) and 4 (104), node 1
    copies 10 (183) and 1 (132); (3) GPU loads [121.5, 86.5, 125, 113 | 147.5, 131.5, 156, 152];
    (4) physical_to_logical [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1].
    Raises ``SpecError`` on shapes or counts that cannot be placed.
    """
    weight = _checked_demand(demand)
    num_layers, num_logical = weight.shape
    _check_fleet(num_logical=num_logical, num_physical_experts=num_physical_experts,
                 num_groups=num_groups, num_nodes=num_nodes, num_devices=num_devices, policy=policy)
    if policy == "global" or num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    if policy == "auto" and num_nodes > 1:
        return _better_per_layer(
            weight, _place(weight, num_physical_experts, num_groups, num_nodes, num_devices),
            _place(weight, num_physical_experts, 1, 1, num_devices), num_devices=num_devices)
    return _place(weight, num_physical_experts, num_groups, num_nodes, num_devices)


def _better_per_layer(weight: torch.Tensor, first: ExpertPlacement, second: ExpertPlacement, *,
                      num_devices: int) -> ExpertPlacement:
    """Per layer, ``first`` unless ``second`` has a lower max/mean device load on ``weight``."""
    take_second = (balance_ratio(device_load(weight, second, num_devices=num_devices))
                   < balance_ratio(device_load(weight, first, num_devices=num_devices)))
    replicas = max(first.logical_to_physical.shape[2], second.logical_to_physical.shape[2])
    pad = lambda l2p: torch.nn.functional.pad(l2p, (0, replicas - l2p.shape[2]), value=-1)  # noqa: E731
    pick = lambda a, b: torch.where(take_second.view(-1, *([1] * (a.dim() - 1))), b, a)  # noqa: E731
    return ExpertPlacement(pick(first.physical_to_logical, second.physical_to_logical),
                           pick(pad(first.logical_to_physical), pad(second.logical_to_physical)),
                           pick(first.logical_replica_count, second.logical_replica_count))


def _place(weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int,
           num_devices: int) -> ExpertPlacement:
    """Steps 1-4 of ``rebalance_experts`` (one group per node: the global policy)."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical_experts // num_nodes
    slots_per_device = num_physical_experts // num_devices

    # Step 1: groups -> nodes. A group's node-major index is node * groups_per_node + slot.
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_slot = _pack_evenly(group_load, num_nodes)
    group_start = (group_node * groups_per_node + group_slot) * group_size  # [L, G]
    logical_to_major = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(1)  # [L, E]
    major_to_logical = _inverse(logical_to_major)

    # Step 2: replicate within each node; rows are (layer, node) pairs.
    node_weight = weight.gather(1, major_to_logical).view(num_layers * num_nodes, logical_per_node)
    physical_to_local, local_rank, local_count = _replicate(node_weight, physical_per_node)

    # Step 3: physical experts -> devices within each node; position = device * slots + slot.
    physical_weight = (node_weight / local_count).gather(1, physical_to_local)
    device, slot = _pack_evenly(physical_weight, num_devices // num_nodes)
    position_to_physical = _inverse(device * slots_per_device + slot)

    # Step 4: read each position's logical expert and replica rank; undo the node-major order.
    node_offset = (torch.arange(num_nodes) * logical_per_node).repeat(num_layers).unsqueeze(-1)
    position_to_major = physical_to_local.gather(1, position_to_physical) + node_offset
    physical_to_logical = major_to_logical.gather(1, position_to_major.view(num_layers, -1))
    replica_rank = local_rank.gather(1, position_to_physical).view(num_layers, -1)
    count = local_count.view(num_layers, num_logical).gather(1, logical_to_major)

    max_replicas = int(count.max())
    logical_to_physical = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    logical_to_physical.scatter_(1, physical_to_logical * max_replicas + replica_rank,
                                 torch.arange(num_physical_experts).expand(num_layers, -1).contiguous())
    return ExpertPlacement(physical_to_logical,
                           logical_to_physical.view(num_layers, num_logical, max_replicas), count)


def contiguous_placement(num_layers: int, num_experts: int) -> ExpertPlacement:
    """The naive placement: no replicas, expert e in physical slot e (device ``e // (E / D)``)."""
    physical_to_logical = torch.arange(num_experts).repeat(num_layers, 1)
    return ExpertPlacement(physical_to_logical, physical_to_logical.unsqueeze(-1).clone(),
                           torch.ones(num_layers, num_experts, dtype=torch.int64))


def device_load(load: torch.Tensor, placement: ExpertPlacement, *, num_devices: int) -> torch.Tensor:
    """Load per device ``[L, D]`` float64 when each expert's load ``[L, E]`` is split evenly
    over its replicas (what ``route_to_replicas`` does to within one token per replica)."""
    physical_to_logical, _, count = placement
    num_layers, num_physical = physical_to_logical.shape
    if num_physical % num_devices:
        raise SpecError("num_devices", num_devices, f"does not divide the {num_physical} slots",
                        "pass the device count the placement was made for")
    per_replica = load.to(torch.float64) / count
    return per_replica.gather(1, physical_to_logical).view(num_layers, num_devices, -1).sum(-1)


def balance_ratio(load_per_device: torch.Tensor) -> torch.Tensor:
    """Max over mean device load, ``[L, D] -> [L]`` (1.0 is perfect balance)."""
    mean = load_per_device.mean(dim=-1)
    return load_per_device.max(dim=-1).values / mean.clamp(min=torch.finfo(mean.dtype).tiny)


def route_to_replicas(topk_idx: torch.Tensor, logical_to_physical: torch.Tensor,
                      logical_replica_count: torch.Tensor, *,
                      physical_load: torch.Tensor | None = None) -> ReplicaRoute:
    """Send each routed copy to the least-loaded replica of its logical expert (one layer).

    topk_idx: ``[T, k]`` logical expert ids from the router.
    logical_to_physical: ``[E, R]`` and logical_replica_count: ``[E]``, one layer of an
        ``ExpertPlacement``.
    physical_load: ``[P]`` int64 tokens already queued per physical expert (default zeros).

    Copies are taken in token order; each goes to the replica with the lowest load so far,
    the lower replica rank on ties. Equivalent to that sequential loop (a unit test checks),
    computed as one sort of candidate load levels per expert: ``O(E * R * n_max)`` memory
    for ``n_max`` copies of the busiest expert. Nothing is mutated.
    """
    flat = topk_idx.reshape(-1).to(torch.int64)
    num_experts, max_replicas = logical_to_physical.shape
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise SpecError("topk_idx", (int(flat.min()), int(flat.max())),
                        f"expert ids outside [0, {num_experts})",
                        "route with the model whose placement this is")
    if physical_load is None:
        physical_load = torch.zeros(int(logical_to_physical.max()) + 1, dtype=torch.int64)
    elif physical_load.is_floating_point():
        raise SpecError("physical_load", physical_load.dtype, "must count tokens (integers): "
                        "load levels are compared exactly", "pass an int64 tensor")
    physical_load = physical_load.to(torch.int64)
    if flat.numel() == 0:
        return ReplicaRoute(topk_idx.to(torch.int64).clone(), physical_load.clone())

    per_expert = torch.bincount(flat, minlength=num_experts)  # [E]
    depth = int(per_expert.max())
    replica = torch.arange(max_replicas)
    base = physical_load[logical_to_physical.clamp(min=0)]  # [E, R]
    level = base.unsqueeze(-1) + torch.arange(depth)  # [E, R, depth]: load before the m-th extra token
    key = level * max_replicas + replica.view(1, -1, 1)  # level first, then replica rank
    usable = replica.view(1, -1, 1) < logical_replica_count.view(-1, 1, 1)
    key = torch.where(usable, key, torch.iinfo(torch.int64).max).flatten(1)  # [E, R * depth]
    replica_of_turn = torch.sort(key, dim=1, stable=True).indices // depth  # [E, R * depth]

    # The i-th copy (in token order) of expert e takes expert e's i-th turn.
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    first = torch.cumsum(per_expert, 0) - per_expert
    turn = torch.arange(flat.numel()) - first[expert_sorted]
    chosen = torch.empty_like(flat)
    chosen[order] = logical_to_physical[expert_sorted, replica_of_turn[expert_sorted, turn]]
    load = physical_load + torch.bincount(chosen, minlength=physical_load.numel())
    return ReplicaRoute(chosen.view(topk_idx.shape), load)
