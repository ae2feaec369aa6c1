"""One rank's MoE dispatch in a wide-EP replica: logical experts -> physical slots -> all-to-all.

Design decisions:
- The exchange is training's: ``rayfleet.models.expert_parallel.ExpertParallelDispatcher``
  moves the rows, unchanged. That dispatcher gives rank j the contiguous "experts"
  ``[j*S, (j+1)*S)``; here those are *physical slots* (``P = ranks * S``) and the slot -> logical
  expert map is the current ``ExpertPlacement``. Serving only adds the step in front of it:
  each routed copy (token, logical expert) is mapped to one physical replica, then the EP
  dispatcher runs with ``num_experts = P``.
- Replica choice is global and deterministic: every rank all-gathers the batch's per-expert
  counts ``[ranks, E]`` (one tiny collective per MoE layer; the ranks are in lockstep for the
  exchange anyway), splits each expert's copies over its replicas so that *devices* come out
  level (``experts.replica_split.balanced_split``; ``routing="even"`` is the plain even split),
  and takes its own share of every replica's quota in rank order. No coordinator, and every
  rank agrees on every slot's load.
- Weight moves between placements (``move_expert_weights``) are a real row all-to-all between
  ranks through the same exchange function (``all_to_all_rows``): a slot whose new expert is
  already on its rank is copied locally, otherwise the lowest rank holding that expert sends it.
- Counters (per layer): logical copies routed by this rank, copies sent to each physical slot,
  and the exchange's time and off-rank bytes (``LayerExchangeStats``). The rank reports them
  every step; the front sums them over ranks.
- ``misroute`` passes the EP dispatcher's broken-on-purpose mode through, for tests that must
  fail when tokens reach the wrong experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from rayfleet.models.expert_parallel import ExpertParallelDispatcher, all_to_all_rows
from rayfleet.models.moe import GroupedExperts
from rayfleet.serving.experts.replica_split import assign_copies, balanced_split, rank_quotas

__all__ = ["LayerExchangeStats", "WideEPDispatcher", "move_expert_weights"]


@dataclass
class LayerExchangeStats:
    """One MoE layer's exchange counters on one rank since the last ``take`` (mutable)."""

    transfer_s: float = 0.0  # dispatch + combine transfer time (completion - issue)
    calls: int = 0
    off_rank_rows: int = 0  # routed copies this rank sent to another rank (each comes back once)
    off_rank_bytes: int = 0  # their bytes on the wire, dispatch and combine

    def record(self, *, issued: float, completed: float, waited: float) -> None:
        self.transfer_s += max(0.0, completed - issued)
        self.calls += 1

    def take(self) -> "LayerExchangeStats":
        taken = LayerExchangeStats(self.transfer_s, self.calls, self.off_rank_rows, self.off_rank_bytes)
        self.transfer_s, self.calls, self.off_rank_rows, self.off_rank_bytes = 0.0, 0, 0, 0
        return taken


class WideEPDispatcher:
    """``TokenDispatcher`` (``run_experts``) of one MoE layer on one rank of a wide-EP gang.

    Mutated by every forward (counters) and by ``set_placement``. The layer's ``experts`` must
    hold this rank's ``S = P / ranks`` slots of the placement given here.
    """

    def __init__(self, *, group: dist.ProcessGroup, rank: int, num_ranks: int, physical_to_logical: torch.Tensor,
                 logical_to_physical: torch.Tensor, logical_replica_count: torch.Tensor,
                 routing: Literal["balanced", "even"] = "balanced", misroute: bool = False) -> None:
        self.group, self.rank, self.num_ranks, self.routing = group, rank, num_ranks, routing
        self.stats = LayerExchangeStats()
        self.exchange = ExpertParallelDispatcher(group=group, ep_size=num_ranks, stats=self.stats, misroute=misroute)
        self.set_placement(physical_to_logical, logical_to_physical, logical_replica_count)

    def set_placement(self, physical_to_logical: torch.Tensor, logical_to_physical: torch.Tensor,
                      logical_replica_count: torch.Tensor) -> None:
        self.physical_to_logical = physical_to_logical.to(torch.int64).cpu()
        self.logical_to_physical = logical_to_physical.to(torch.int64).cpu()
        self.logical_replica_count = logical_replica_count.to(torch.int64).cpu()
        self.num_physical = self.physical_to_logical.numel()
        self.slots_per_rank = self.num_physical // self.num_ranks
        self.window_logical = torch.zeros(self.logical_replica_count.numel(), dtype=torch.int64)
        self.window_physical = torch.zeros(self.num_physical, dtype=torch.int64)

    def _gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(counts) for _ in range(self.num_ranks)]
        dist.all_gather(parts, counts, group=self.group)
        return torch.stack(parts)

    @torch.no_grad()
    def run_experts(self, experts: GroupedExperts, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                    *, num_experts: int, capacity: int | None) -> tuple[torch.Tensor, int]:
        assert capacity is None, "wide-EP serving is dropless (capacity_factor=None)"
        # The collective runs on the activations' device (NCCL needs CUDA tensors); the split is
        # computed on the host from the gathered counts.
        counts_by_rank = self._gather_counts(torch.bincount(topk_idx.reshape(-1), minlength=num_experts)).cpu()
        counts = counts_by_rank[self.rank]
        quota = balanced_split(counts_by_rank.sum(0), self.logical_to_physical, self.logical_replica_count,
                               slots_per_device=self.slots_per_rank, passes=3 if self.routing == "balanced" else 0)
        mine = rank_quotas(counts_by_rank, quota, self.logical_to_physical, self.logical_replica_count)[self.rank]
        physical = assign_copies(topk_idx, mine, self.logical_to_physical)
        sent = torch.bincount(physical.reshape(-1).cpu(), minlength=self.num_physical)
        self.window_logical += counts
        self.window_physical += sent
        off_rank = int(sent.sum()) - int(sent[self.rank * self.slots_per_rank:(self.rank + 1) * self.slots_per_rank].sum())
        self.stats.off_rank_rows += off_rank
        self.stats.off_rank_bytes += 2 * off_rank * x.shape[-1] * x.element_size()
        out, _ = self.exchange.run_experts(experts, x, physical.to(x.device), topk_weight,
                                           num_experts=self.num_physical, capacity=None)
        return out, int(topk_idx.numel())

    def take_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ``[E]`` copies routed by this rank and copies it sent per slot ``[P]`` (reset)."""
        window = (self.window_logical, self.window_physical)
        self.window_logical = torch.zeros_like(self.window_logical)
        self.window_physical = torch.zeros_like(self.window_physical)
        return window


def _source_slots(old_p2l: torch.Tensor, new_p2l: torch.Tensor, *, rank_of_slot: torch.Tensor) -> torch.Tensor:
    """For each new slot, the old slot its weights come from: one on the same rank if any holds
    the expert, else the lowest old slot holding it. ``[P]`` int64."""
    source = torch.empty_like(new_p2l)
    for q, expert in enumerate(new_p2l.tolist()):
        holders = (old_p2l == expert).nonzero().flatten()
        local = holders[rank_of_slot[holders] == rank_of_slot[q]]
        source[q] = local[0] if local.numel() else holders[0]
    return source


@torch.no_grad()
def move_expert_weights(experts: GroupedExperts, *, old_p2l: torch.Tensor, new_p2l: torch.Tensor, rank: int,
                        num_ranks: int, group: dist.ProcessGroup) -> int:
    """Refill this rank's slots for ``new_p2l`` (one layer, ``[P]``) from the ranks that hold the
    experts under ``old_p2l``; every rank of the gang calls it together. Returns the slots this
    rank received from other ranks (the rest were copied locally)."""
    slots = old_p2l.numel() // num_ranks
    rank_of_slot = torch.arange(old_p2l.numel()) // slots
    source = _source_slots(old_p2l.cpu(), new_p2l.cpu(), rank_of_slot=rank_of_slot)
    weights = (experts.w1, experts.w2, experts.w3)
    flat = torch.cat([w.detach().reshape(slots, -1) for w in weights], dim=1)  # [S, row] this rank's old slots
    # Rows this rank sends: for each destination rank, its new slots fed from here, in slot order.
    remote = rank_of_slot[source] != rank_of_slot  # new slots whose source is on another rank
    send, send_splits, recv_splits = [], [], []
    for dest in range(num_ranks):
        fed = [q for q in range(dest * slots, (dest + 1) * slots) if remote[q] and rank_of_slot[source[q]] == rank]
        send += [int(source[q]) - rank * slots for q in fed]
        send_splits.append(len(fed))
        recv_splits.append(sum(1 for q in range(rank * slots, (rank + 1) * slots)
                               if remote[q] and rank_of_slot[source[q]] == dest))
    received = all_to_all_rows(flat[torch.tensor(send, dtype=torch.int64, device=flat.device)], out_splits=recv_splits,
                               in_splits=send_splits, group=group)
    # Received rows are source-rank-major, slot order within a source.
    mine = range(rank * slots, (rank + 1) * slots)
    from_rank = {src: iter(received[sum(recv_splits[:src]):sum(recv_splits[:src + 1])]) for src in range(num_ranks)}
    new_flat = torch.stack([next(from_rank[int(rank_of_slot[source[q]])]) if remote[q]
                            else flat[int(source[q]) - rank * slots] for q in mine])
    offset = 0
    for name, w in zip(("w1", "w2", "w3"), weights):
        size = w[0].numel()
        setattr(experts, name, torch.nn.Parameter(new_flat[:, offset:offset + size].reshape(w.shape).clone(),
                                                  requires_grad=False))
        offset += size
    return int(remote[rank * slots:(rank + 1) * slots].sum())
