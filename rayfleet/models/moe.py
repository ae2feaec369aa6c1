"""Mixture-of-experts layer: fp32 router, swappable token dispatcher, grouped experts.

Design decisions:
- Router math runs in fp32 with autocast disabled: top-k selection flips on tiny logit
  differences, and the router is a small GEMM, so precision costs nothing here. Selection uses
  ``scores + expert_bias`` while the combine weights use the unbiased scores (DeepSeek-V3's
  auxiliary-loss-free balancing); the bias is a persistent buffer moved by ``update_bias``
  from observed load, outside autograd.
- The optional Switch-style auxiliary loss is attached to the layer output with an autograd
  function that injects its gradient in backward, so ``forward`` still returns one tensor and
  the model composes with pipelining and FSDP without a side channel for losses.
- Token movement is a ``TokenDispatcher`` object held by the layer (``layer.dispatcher``): the
  local one sorts tokens by expert; an expert-parallel one (training issue) swaps in
  all-to-all between ``dispatch`` and ``combine`` without touching this file.
- Experts are ``[E, out, in]`` weight tensors run as grouped GEMMs: one matmul per expert over
  a contiguous segment of expert-sorted tokens (a loop over experts, never over tokens).
  ``torch._grouped_mm`` runs forward on CPU in torch 2.13 but its backward fails there
  ("Invalid strides/sizes"), so the segment loop is the portable path; the segment sizes need
  one host sync per layer, which expert-parallel all-to-all needs anyway.
- Dropless by default; with a capacity factor, tokens beyond an expert's capacity (in token
  order) are dropped from that expert and the combine simply gets no contribution from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rayfleet.models.layers import FeedForward

__all__ = [
    "RouterOutput", "Router", "Dispatched", "TokenDispatcher", "LocalDispatcher",
    "grouped_linear", "GroupedExperts", "MoELayer",
]


class RouterOutput(NamedTuple):
    topk_idx: torch.Tensor  # [T, k] int64 expert ids
    topk_weight: torch.Tensor  # [T, k] fp32 combine weights
    scores: torch.Tensor  # [T, E] fp32 unbiased scores (for the aux loss)


class Router(nn.Module):
    """Top-k router in fp32 with a load-balancing bias used only for selection."""

    def __init__(self, *, dim: int, num_experts: int, top_k: int, score: str,
                 route_scale: float, bias_update_rate: float, norm_topk: bool = True,
                 num_groups: int = 1, topk_groups: int = 1) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.route_scale, self.bias_update_rate = route_scale, bias_update_rate
        self.norm_topk, self.num_groups, self.topk_groups = norm_topk, num_groups, topk_groups
        # A bare Parameter, not nn.Linear: a generic "swap every Linear" pass cannot grab it.
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits) if self.score == "sigmoid" else logits.softmax(dim=-1)
        choice = scores.detach() + self.expert_bias
        if self.num_groups > 1:
            choice = self._limit_to_groups(choice)
        topk_idx = torch.topk(choice, self.top_k, dim=-1).indices
        weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.norm_topk:
            # The epsilon is DeepSeek-V3's: sigmoid scores of a token can all be ~0.
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return RouterOutput(topk_idx, weight * self.route_scale, scores)

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 node-limited routing: keep the ``topk_groups`` expert groups whose two
        best (biased) scores sum highest; the others' experts get -inf. ``choice`` ``[T, E]``."""
        grouped = choice.view(choice.shape[0], self.num_groups, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3 update: raise the bias of under-loaded experts, lower over-loaded ones.

        ``tokens_per_expert`` ``[E]`` should be the load summed over the data-parallel group
        so that every replica moves its bias identically.
        """
        load = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))


@dataclass(frozen=True)
class Dispatched:
    """Tokens grouped by (local) expert, plus the dispatcher's private state for ``combine``.

    tokens: ``[N, dim]`` rows for expert 0, then expert 1, ...
    tokens_per_expert: ``[E_local]`` int64 segment sizes, summing to N.
    handle: opaque; only the dispatcher that produced it reads it.
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: Any


class TokenDispatcher(Protocol):
    """Moves routed tokens to experts and back. Swap ``MoELayer.dispatcher`` to change it."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, *,
                 num_experts: int, capacity: int | None) -> Dispatched: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...

    # Optional: ``run_experts(experts, x, topk_idx, topk_weight, *, num_experts, capacity) ->
    # (out, dispatched_copies)`` replaces dispatch -> experts -> combine when a dispatcher
    # schedules its own exchanges (e.g. overlapping all-to-all with expert GEMMs).


class _LocalHandle(NamedTuple):
    token_ids: torch.Tensor  # [N] source row of each dispatched row
    weights: torch.Tensor  # [N] fp32 combine weight
    num_tokens: int


class LocalDispatcher:
    """All experts on this rank: a stable sort by expert id, then a weighted scatter-add back."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, *,
                 num_experts: int, capacity: int | None) -> Dispatched:
        top_k = topk_idx.shape[1]
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=num_experts)
        if capacity is not None:
            # Rank of each routed copy within its expert, in token order (stable sort).
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
            order = order[rank < capacity]
            counts = counts.clamp(max=capacity)
        token_ids = order // top_k
        handle = _LocalHandle(token_ids, topk_weight.reshape(-1)[order], x.shape[0])
        return Dispatched(x[token_ids], counts, handle)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: _LocalHandle = dispatched.handle
        # Accumulate in at least fp32: a token's k contributions are summed here.
        acc = torch.promote_types(expert_out.dtype, torch.float32)
        weighted = expert_out.to(acc) * h.weights.unsqueeze(-1).to(acc)
        out = torch.zeros(h.num_tokens, expert_out.shape[-1], dtype=acc, device=expert_out.device)
        return out.index_add_(0, h.token_ids, weighted).to(expert_out.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x`` ``[N, in]`` split into segments of ``sizes``; segment g times ``weight[g].T``.

    weight: ``[G, out, in]``. Returns ``[N, out]``.
    """
    outs = [seg @ weight[g].t() for g, seg in enumerate(torch.split(x, sizes)) if sizes[g]]
    if not outs:
        # Stay in the autograd graph even with no rows: under expert parallelism every rank
        # must run the backward of its all-to-all exchanges, rows or not, or its peers hang.
        return x @ weight[0].t()
    return torch.cat(outs)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights ``w1, w3: [E, hidden, dim]``, ``w2: [E, dim, hidden]``."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        sizes = [int(n) for n in tokens_per_expert.tolist()]
        hidden = F.silu(self.linear(x, self.w1, sizes, "w1")) * self.linear(x, self.w3, sizes, "w3")
        return self.linear(hidden, self.w2, sizes, "w2")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        """The grouped GEMM; FP8 converters override this method (``name`` keys their state)."""
        return grouped_linear(x, weight, sizes)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends gradient 1 into ``aux_loss``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_out.device)


class MoELayer(nn.Module):
    """Routed experts (+ optional shared experts) replacing a dense FFN.

    After each forward, ``last_tokens_per_expert`` ``[E]`` holds the routed load (before any
    capacity dropping), ``last_dropped_tokens`` the number of dropped routed copies, and
    ``last_aux_loss`` the detached auxiliary loss (0 when disabled).
    """

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, top_k: int,
                 num_shared_experts: int, score: str, route_scale: float,
                 bias_update_rate: float, aux_loss_coef: float,
                 capacity_factor: float | None, norm_topk: bool = True, num_groups: int = 1,
                 topk_groups: int = 1, shared_hidden_dim: int = 0,
                 shared_expert_gate: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.capacity_factor = aux_loss_coef, capacity_factor
        self.router = Router(dim=dim, num_experts=num_experts, top_k=top_k, score=score,
                             route_scale=route_scale, bias_update_rate=bias_update_rate,
                             norm_topk=norm_topk, num_groups=num_groups, topk_groups=topk_groups)
        self.experts = GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        self.shared_experts = (FeedForward(dim, shared_hidden_dim or hidden_dim * num_shared_experts)
                               if num_shared_experts else None)
        # Qwen2-MoE scales the shared expert per token by sigmoid(gate . x). A bare Parameter
        # like the router's, so no Linear-swapping pass (FP8, TP) mistakes it for a projection.
        self.shared_expert_gate = (nn.Parameter(torch.empty(1, dim))
                                   if shared_expert_gate and num_shared_experts else None)
        self.dispatcher: TokenDispatcher = LocalDispatcher()
        self.register_buffer("last_tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)
        self.last_dropped_tokens = 0
        self.last_aux_loss = torch.zeros(())

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        counts = torch.bincount(routing.topk_idx.reshape(-1), minlength=self.num_experts)
        self.last_tokens_per_expert = counts.detach()
        capacity = self.capacity(flat.shape[0])
        run_experts = getattr(self.dispatcher, "run_experts", None)
        if run_experts is not None:  # a dispatcher that schedules its own exchanges (EP overlap)
            out, dispatched_copies = run_experts(self.experts, flat, routing.topk_idx, routing.topk_weight,
                                                 num_experts=self.num_experts, capacity=capacity)
        else:
            dispatched = self.dispatcher.dispatch(flat, routing.topk_idx, routing.topk_weight,
                                                  num_experts=self.num_experts, capacity=capacity)
            out = self.dispatcher.combine(self.experts(dispatched.tokens, dispatched.tokens_per_expert),
                                          dispatched)
            dispatched_copies = int(dispatched.tokens_per_expert.sum())
        self.last_dropped_tokens = int(routing.topk_idx.numel() - dispatched_copies)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(flat, self.shared_expert_gate)) * shared
            out = out + shared
        if self.training and self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self.aux_loss(routing, counts)
            self.last_aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux * self.aux_loss_coef)
        return out.reshape(shape)

    def aux_loss(self, routing: RouterOutput, counts: torch.Tensor) -> torch.Tensor:
        """Switch-Transformer balance loss ``E * sum_i f_i * P_i`` (1.0 when perfectly even)."""
        fraction = counts.float() / routing.topk_idx.numel()
        probs = routing.scores / routing.scores.sum(dim=-1, keepdim=True)
        return self.num_experts * (fraction * probs.mean(dim=0)).sum()

    def update_router_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Balance step from ``tokens_per_expert`` (default: the last forward's local load)."""
        self.router.update_bias(self.last_tokens_per_expert if tokens_per_expert is None
                                else tokens_per_expert)
