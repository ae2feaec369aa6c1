"""Expert tensor parallelism (ETP): every expert's SwiGLU FFN split over an ETP group.

Megatron-Core's ``expert_tensor_parallel_size`` with its all-to-all token dispatcher (MoE
parallel folding), in our words. It lives in ``models`` beside the EP exchange it composes with:
pure ``torch.distributed`` over the layer's ``TokenDispatcher`` hook, no Ray.

Design decisions:
- Weights: ETP rank ``t`` of a group of ``etp`` holds hidden units ``[t*H/etp, (t+1)*H/etp)`` of
  each of its experts: those rows of ``w1`` and ``w3`` ``[E, H, dim]`` (column-parallel) and
  those columns of ``w2`` ``[E, dim, H]`` (row-parallel). SwiGLU is elementwise over the hidden
  units, so rank ``t``'s ``w2`` product is an exact partial sum of the expert's output and the
  sum over the group is the output. The caller slices the weights
  (``jobs.parallel.expert_parallel.apply_expert_tensor_parallel``).
- Tokens: the ETP peers are distinct ranks of a stage (DP, CP or token-split TP peers), so they
  hold *different* tokens. After the inner dispatcher (local sort, or the EP all-to-all to the
  EP rank owning the experts), each peer's rows are all-gathered over ETP, regrouped expert-major
  and run through the sharded GEMMs; the partial outputs are reduce-scattered back, each peer
  getting the sums for its own rows, which then combine as before. Per layer: one all-gather in
  forward and one reduce-scatter (their autograd reverses in backward), Megatron's layout.
- Both collectives are row all-to-alls (``exchange_rows``, uneven splits, which gloo has):
  the all-gather sends this rank's whole block to every peer, the reduce-scatter sends each
  peer its rows' partials and sums what comes back. Written as ``repeat`` / ``sum`` around a
  differentiable all-to-all, autograd derives the exact backward: the gather's backward sums
  the peers' input gradients (a reduce-scatter), the scatter's backward broadcasts the output
  gradient (an all-gather). Rejected: an all-reduce over ETP of replicated tokens (the classic
  dense TP MLP): ETP peers do not hold the same tokens unless ETP coincides with an unsplit TP.
- The ETP exchanges are blocking and are not recorded in the EP dispatcher's ``ExchangeStats``:
  the a2a hidden fraction stays the EP dispatch's.
- ``control="no_reduce"`` is BROKEN ON PURPOSE: each peer keeps only its own partial sum (the
  reduce-scatter's sum left out). The parity tests run it to prove they catch a missing reduce.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rayfleet.models.expert_parallel import exchange_rows

__all__ = ["ETPControl", "ExpertTensorParallelDispatcher", "run_sharded_experts", "expert_major_order"]

ETPControl = Literal["none", "no_reduce"]


def expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """Row index that regroups peer-major rows expert-major.

    counts: ``[P, E]`` int64, rows that peer ``p`` holds for local expert ``e``; the rows arrive
    peer-major, expert-minor (peer 0's expert-0 rows, its expert-1 rows, ..., then peer 1's).
    Returns ``[N]`` (N = counts.sum()): ``rows[order]`` is expert 0's rows from every peer in peer
    order, then expert 1's, ... Example: counts ``[[1, 2], [3, 0]]`` (rows a | b b | c c c) ->
    order ``[0, 3, 4, 5, 1, 2]`` (a c c c | b b).
    """
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)
    seg_len, seg_start = counts.t().reshape(-1), starts.t().reshape(-1)
    seg_first = torch.cumsum(seg_len, 0) - seg_len
    total = int(seg_len.sum())
    offset = torch.arange(total, device=counts.device) - torch.repeat_interleave(seg_first, seg_len)
    return torch.repeat_interleave(seg_start, seg_len) + offset


def run_sharded_experts(experts: nn.Module, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, *,
                        group: dist.ProcessGroup, etp_size: int, etp_rank: int,
                        control: ETPControl = "none") -> torch.Tensor:
    """This rank's expert-major rows ``tokens`` ``[N, dim]`` (``tokens_per_expert`` ``[E_local]``)
    through experts whose hidden units are split over ``group``; returns ``[N, dim]``, the
    whole experts' output. Collective over ``group`` (every peer calls it, rows or not)."""
    mine = tokens_per_expert.to(torch.int64).reshape(1, -1)
    peers = [torch.empty_like(mine) for _ in range(etp_size)]
    dist.all_gather(peers, mine.contiguous(), group=group)
    counts = torch.cat(peers)  # [P, E_local]
    rows = counts.sum(1).tolist()
    num_mine = tokens.shape[0]
    # 1. all-gather: my whole block to every peer (repeat's backward sums the peers' gradients)
    gathered = exchange_rows(tokens.repeat(etp_size, 1), out_splits=rows, in_splits=[num_mine] * etp_size,
                             group=group)
    order = expert_major_order(counts)
    # 2. this rank's hidden units of every expert, over the whole group's rows
    partial_out = experts(gathered[order], counts.sum(0))
    # 3. reduce-scatter: each peer's rows back to it, summed over the peers' hidden units
    peer_major = partial_out.new_zeros(partial_out.shape).index_copy(0, order, partial_out)
    returned = exchange_rows(peer_major, out_splits=[num_mine] * etp_size, in_splits=rows,
                             group=group)
    per_peer = returned.view(etp_size, num_mine, -1)
    if control == "no_reduce":  # BROKEN ON PURPOSE: only this rank's hidden units contribute
        return per_peer[etp_rank]
    return per_peer.sum(0)


class ExpertTensorParallelDispatcher:
    """``TokenDispatcher`` wrapper: ``inner`` moves tokens to the rank owning their experts
    (``LocalDispatcher`` or ``ExpertParallelDispatcher``); the experts then run split over ETP.

    Only ``run_experts`` is offered (``MoELayer`` prefers it): a bare dispatch -> experts ->
    combine would run the sharded experts without the ETP collectives.
    """

    def __init__(self, inner: Any, *, group: dist.ProcessGroup, etp_size: int, etp_rank: int,
                 control: ETPControl = "none") -> None:
        self.inner, self.group, self.etp_size, self.etp_rank, self.control = inner, group, etp_size, etp_rank, control

    def run_experts(self, experts: nn.Module, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                    *, num_experts: int, capacity: int | None) -> tuple[torch.Tensor, int]:
        """Routed-expert output ``[T, dim]`` and the routed copies this rank dispatched."""
        sharded = partial(run_sharded_experts, experts, group=self.group, etp_size=self.etp_size,
                          etp_rank=self.etp_rank, control=self.control)
        inner_run = getattr(self.inner, "run_experts", None)
        if inner_run is not None:  # the EP dispatcher (its overlap chunks included)
            return inner_run(sharded, x, topk_idx, topk_weight, num_experts=num_experts, capacity=capacity)
        dispatched = self.inner.dispatch(x, topk_idx, topk_weight, num_experts=num_experts, capacity=capacity)
        out = self.inner.combine(sharded(dispatched.tokens, dispatched.tokens_per_expert), dispatched)
        return out, int(dispatched.tokens_per_expert.sum())
