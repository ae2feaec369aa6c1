"""Per-batch routing among expert replicas that levels *device* load, not replica load.

``eplb.route_to_replicas`` sends each routed copy to the least-loaded replica of its expert,
which splits an expert's tokens evenly over its replicas. That is only balanced when every
device holds equally loaded slots; a placement fitted on older demand rarely does (under hard
skew, EPLB's greedy packing puts two replicas of the hottest expert on one device, which then
gets twice its share). Here the split of each expert's tokens is chosen per batch so that the
*devices* come out level:

1. start from the even split (what ``route_to_replicas`` does);
2. for each multi-replica expert, heaviest first, take its tokens back and pour them into its
   replicas' devices by water-filling (the lowest devices rise together until the expert's
   tokens are used up), given every other expert's load; repeat for a few passes;
3. integer amounts: floor, then the remainder one token each to the lowest-loaded replicas.

Step 2 is coordinate descent on the min-max split (an LP): a re-pour never raises the busiest
device, so the result is never worse than the even split (up to one token of rounding).

For a multi-rank replica the split is computed from the batch counts of *all* ranks (one
all-gather of ``[ranks, E]`` per MoE layer), identically on every rank, and each rank then
takes its share of every replica's quota in rank order (``rank_quotas``): global balance with
no coordinator and no extra round trip. Pure functions: tensors in, tensors out.
"""

from __future__ import annotations

import torch

from rayfleet.serving.experts.eplb import ExpertPlacement

__all__ = ["balanced_split", "rank_quotas", "assign_copies", "balanced_device_load"]


def _even(amount: int, num: int) -> list[int]:
    """``amount`` split over ``num`` replicas, the remainder to the lower replica ranks."""
    return [amount // num + (1 if j < amount % num else 0) for j in range(num)]


def _water_fill(amount: int, devs: list[int], device: list[float]) -> list[int]:
    """Integer amounts per replica on devices ``devs`` that raise the lowest of ``device`` loads
    together (replicas sharing a device share its amount). Plain Python: a handful of replicas
    per expert, where tensor ops would cost more than the arithmetic."""
    unique = sorted(set(devs), key=lambda d: (device[d], d))
    total, water, fill = 0.0, 0.0, 0
    for m, d in enumerate(unique, start=1):  # the largest m whose water level reaches the m-th lowest
        total += device[d]
        level = (amount + total) / m
        if level < device[d]:
            break
        water, fill = level, m
    give = {d: max(0.0, water - device[d]) for d in unique[:fill]}
    sharing = {d: devs.count(d) for d in give}
    whole = [int(give.get(d, 0.0) / sharing.get(d, 1)) for d in devs]
    rest = amount - sum(whole)
    if rest:  # one token each to the replicas whose devices end lowest (lower rank on ties)
        for j in sorted(range(len(devs)), key=lambda j: (device[devs[j]] + whole[j], j))[:rest]:
            whole[j] += 1
    return whole


def balanced_split(counts: torch.Tensor, logical_to_physical: torch.Tensor, logical_replica_count: torch.Tensor,
                   *, slots_per_device: int, passes: int = 3) -> torch.Tensor:
    """Tokens per physical expert ``[P]`` int64 for one layer's batch (see module doc).

    counts: ``[E]`` routed copies per logical expert. logical_to_physical ``[E, R]`` (-1 padded)
    and logical_replica_count ``[E]``: one layer of an ``ExpertPlacement``; physical expert ``p``
    lives on device ``p // slots_per_device``. The result sums to ``counts`` per expert.
    Starts from the even split; each pass re-pours every multi-replica expert (heaviest first)
    given all others' load, which never raises the busiest device (coordinate descent on the
    max), so the result is never worse than the even split.
    """
    amounts = [int(c) for c in counts.tolist()]
    replicas = logical_replica_count.tolist()
    slots = [row[:r] for row, r in zip(logical_to_physical.tolist(), replicas)]
    num_physical = max(max(row) for row in slots) + 1
    quota = [0] * num_physical
    device = [0.0] * -(-num_physical // slots_per_device)
    for e, row in enumerate(slots):
        for p, q in zip(row, _even(amounts[e], len(row))):
            quota[p] = q
            device[p // slots_per_device] += q
    multi = sorted((e for e, r in enumerate(replicas) if r > 1 and amounts[e]), key=lambda e: (-amounts[e], e))
    for _ in range(passes):
        for e in multi:
            devs = [p // slots_per_device for p in slots[e]]
            for p, d in zip(slots[e], devs):
                device[d] -= quota[p]
            for p, d, q in zip(slots[e], devs, _water_fill(amounts[e], devs, device)):
                quota[p] = q
                device[d] += q
    return torch.tensor(quota, dtype=torch.int64)


def rank_quotas(counts_by_rank: torch.Tensor, quota: torch.Tensor, logical_to_physical: torch.Tensor,
                logical_replica_count: torch.Tensor) -> torch.Tensor:
    """``[ranks, E, R]`` copies each rank sends to each replica of each expert.

    counts_by_rank ``[ranks, E]`` sums over ranks to the counts ``quota`` ``[P]`` was split
    from. Expert e's copies are ordered rank by rank; replica j takes the next ``quota`` of
    them, so every rank computes the same table.
    """
    num_experts, max_replicas = logical_to_physical.shape
    per_replica = torch.where(logical_to_physical >= 0, quota[logical_to_physical.clamp(min=0)], 0)  # [E, R]
    replica_end = torch.cumsum(per_replica, 1)  # [E, R]
    replica_start = replica_end - per_replica
    rank_end = torch.cumsum(counts_by_rank.to(torch.int64), 0)  # [ranks, E]
    rank_start = rank_end - counts_by_rank
    low = torch.maximum(rank_start.unsqueeze(-1), replica_start.unsqueeze(0))
    high = torch.minimum(rank_end.unsqueeze(-1), replica_end.unsqueeze(0))
    return (high - low).clamp(min=0)


def assign_copies(topk_idx: torch.Tensor, my_quota: torch.Tensor, logical_to_physical: torch.Tensor) -> torch.Tensor:
    """Physical expert ``[T, k]`` of each routed copy: expert e's copies, in token order, fill
    replica 0's quota ``my_quota[e, 0]`` first, then replica 1's, ... (``my_quota`` ``[E, R]``
    must sum per expert to this batch's copies of e)."""
    flat = topk_idx.reshape(-1).to(torch.int64).cpu()
    if flat.numel() == 0:
        return topk_idx.to(torch.int64).clone()
    num_experts = logical_to_physical.shape[0]
    per_expert = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    turn = torch.arange(flat.numel()) - (torch.cumsum(per_expert, 0) - per_expert)[expert_sorted]
    bounds = torch.cumsum(my_quota, 1)  # [E, R]
    replica = torch.searchsorted(bounds[expert_sorted], turn.unsqueeze(1), right=True).squeeze(1)
    chosen = torch.empty_like(flat)
    chosen[order] = logical_to_physical[expert_sorted, replica]
    assert bool((chosen >= 0).all()), "quota does not cover the batch's copies"
    return chosen.view(topk_idx.shape).to(topk_idx.device)


def balanced_device_load(load: torch.Tensor, placement: ExpertPlacement, *, num_devices: int) -> torch.Tensor:
    """Load per device ``[L, D]`` float64 when each layer's ``load`` ``[L, E]`` is split by
    ``balanced_split`` (``eplb.device_load`` is the same for the even split)."""
    p2l, l2p, count = placement
    slots = p2l.shape[1] // num_devices
    rows = []
    for layer in range(load.shape[0]):
        quota = balanced_split(load[layer].round().to(torch.int64), l2p[layer], count[layer], slots_per_device=slots)
        rows.append(quota.double().view(num_devices, slots).sum(1))
    return torch.stack(rows)
