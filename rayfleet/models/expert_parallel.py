"""Expert parallelism's token exchange: experts split over an EP group, tokens moved with all-to-all.

One implementation for training and serving (``jobs.parallel.expert_parallel`` applies it to a
training model; ``serving.engine.ep_dispatch`` runs a wide-EP serving replica's MoE layers
through it). It lives in ``models`` because it is pure ``torch.distributed`` code over the
layer's ``TokenDispatcher`` hook, with no Ray and nothing of jobs or serving, and both of those
may import ``models`` (they never import each other).

Design decisions:
- The MoE layer is untouched: the caller keeps each rank's contiguous slice of the stacked
  expert weights (rank j owns experts ``[j*E/ep, (j+1)*E/ep)``; in serving, "expert" is a
  physical slot) and swaps the layer's ``dispatcher`` for an ``ExpertParallelDispatcher``.
- Dispatch: sort routed copies by global expert (so by destination rank), exchange the
  ``[ep, E_local]`` count matrix (one small all-to-all), then one ``all_to_all_single`` with
  uneven splits moves the rows; the receiver regroups them expert-major for the grouped GEMM.
  Combine is the exact reverse, then the same weighted scatter-add as the local dispatcher, so
  results equal the single-process layer up to summation order.
- FP8 on the wire (``comm.fp8_dispatch`` with an FP8 precision recipe): every expert exchange
  moves packed E4M3 rows with 1x128 tile scales (``models.fp8.packing``; ~52% of BF16's bytes):
  the forward dispatch, the forward combine, and both backward exchanges (the gradients of
  combine and dispatch). The receiver dequantizes to the activation dtype; autograd treats the
  quantization as identity (straight-through), so a gradient is the exact gradient of what was
  received, quantized once more on its way back. DeepSeek-V3 keeps combine in BF16 for
  accuracy; here all four move in FP8, and the parity tests bound the loss gap this costs.
- Overlap (``a2a_overlap``): the layer's tokens are cut into two chunks; both dispatches are
  issued asynchronously, chunk 0's experts run while chunk 1's rows are in flight, and chunk
  0's combine is in flight while chunk 1's experts run. Autograd sees each exchange through
  ``_Exchanged``, whose forward returns the already-received buffer and whose backward is the
  reverse exchange (backward exchanges are blocking). The stats object (``ExchangeStats``;
  training's ``A2AStats``) records when each transfer was issued, when it actually completed
  (a callback on the work's future) and when the caller waited for it; training reports the
  hidden fraction from those.
- ``misroute`` is BROKEN ON PURPOSE: rows meant for EP rank j go to rank j+1 (same local
  expert index). The parity tests run it to prove they would catch wrong dispatch.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from rayfleet.models.fp8.numerics import dequantize
from rayfleet.models.fp8.packing import pack_fp8_rows, unpack_fp8_rows
from rayfleet.models.moe import Dispatched

__all__ = ["ExchangeStats", "ExpertParallelDispatcher", "all_to_all_rows", "exchange_rows"]

_FP8_BLOCK = 128


class ExchangeStats(Protocol):
    """Receives the instants of every exchange (training's ``jobs.parallel.context.A2AStats``)."""

    def record(self, *, issued: float, completed: float, waited: float) -> None: ...


class _Pending(NamedTuple):
    work: Any
    out: torch.Tensor
    issued_at: float
    completed_at: Any  # a torch Future whose value is the completion instant (perf_counter)


def _issue(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
           group: dist.ProcessGroup) -> _Pending:
    issued = time.perf_counter()
    work = dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group, async_op=True)
    # Stamped by the thread that completes the work (gloo's), not when someone waits for it.
    completed = work.get_future().then(lambda _fut: time.perf_counter())
    return _Pending(work, out, issued, completed)


def _wait(pending: _Pending, stats: ExchangeStats | None, *, overlapped: bool = False) -> torch.Tensor:
    """Block until ``pending`` is done; a blocking (not ``overlapped``) exchange is all exposed."""
    waited = time.perf_counter() if overlapped else pending.issued_at
    pending.work.wait()
    if stats is not None:
        stats.record(issued=pending.issued_at, completed=pending.completed_at.wait(), waited=waited)
    return pending.out


def _to_wire(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    return pack_fp8_rows(x.detach().float(), block=_FP8_BLOCK) if fp8 else x.detach()


def _from_wire(received: torch.Tensor, *, fp8: bool, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if not fp8:
        return received
    return dequantize(unpack_fp8_rows(received, dim=dim, block=_FP8_BLOCK)).to(dtype)


def all_to_all_rows(x: torch.Tensor, *, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup, stats: ExchangeStats | None = None, fp8: bool = False) -> torch.Tensor:
    """Blocking row all-to-all (no autograd): ``x`` rows split by ``in_splits`` go to each rank
    (as packed FP8 rows when ``fp8``; the result is dequantized to ``x``'s dtype)."""
    payload = _to_wire(x, fp8)
    out = payload.new_empty((sum(out_splits), *payload.shape[1:]))
    received = _wait(_issue(out, payload, out_splits, in_splits, group), stats)
    return _from_wire(received, fp8=fp8, dim=x.shape[1], dtype=x.dtype)


class _Exchanged(torch.autograd.Function):
    """Identity from ``sent`` to the rows already received for it; backward sends grads back
    (in FP8 when the forward exchange was)."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup, stats: ExchangeStats | None, fp8: bool) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.stats, ctx.fp8 = (out_splits, in_splits), group, stats, fp8
        ctx.sent_dtype = sent.dtype
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = all_to_all_rows(grad.contiguous(), out_splits=in_splits, in_splits=out_splits,
                               group=ctx.group, stats=ctx.stats, fp8=ctx.fp8)
        return back.to(ctx.sent_dtype), None, None, None, None, None, None


class _Exchange:
    """One asynchronous row exchange whose result joins autograd when it is collected."""

    def __init__(self, x: torch.Tensor, *, out_splits: list[int], in_splits: list[int],
                 group: dist.ProcessGroup, stats: ExchangeStats | None, fp8: bool, overlapped: bool) -> None:
        self.x, self.out_splits, self.in_splits, self.overlapped = x, out_splits, in_splits, overlapped
        self.group, self.stats, self.fp8 = group, stats, fp8
        payload = _to_wire(x, fp8)
        out = payload.new_empty((sum(out_splits), payload.shape[1]))
        self.pending = _issue(out, payload, out_splits, in_splits, group)

    def collect(self) -> torch.Tensor:
        received = _wait(self.pending, self.stats, overlapped=self.overlapped)
        received = _from_wire(received, fp8=self.fp8, dim=self.x.shape[1], dtype=self.x.dtype)
        return _Exchanged.apply(self.x, received, self.out_splits, self.in_splits, self.group, self.stats,
                                self.fp8)


def exchange_rows(x: torch.Tensor, *, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
                  stats: ExchangeStats | None = None) -> torch.Tensor:
    """Blocking row all-to-all inside autograd: rows of ``x`` split by ``in_splits`` go to each rank
    of ``group``; the result (``sum(out_splits)`` rows) sends its gradient back the reverse way."""
    return _Exchange(x, out_splits=out_splits, in_splits=in_splits, group=group, stats=stats, fp8=False,
                     overlapped=False).collect()


class _EPHandle(NamedTuple):
    token_ids: torch.Tensor  # [N_send] source row of each sent row (in send order)
    weights: torch.Tensor  # [N_send] fp32 combine weights
    num_tokens: int
    send_splits: list[int]  # rows to each EP rank
    recv_splits: list[int]  # rows from each EP rank
    expert_major: torch.Tensor  # [N_recv] received row index of each expert-major row


class ExpertParallelDispatcher:
    """``TokenDispatcher`` over an EP group; the layer's experts hold ``E / ep`` local experts."""

    def __init__(self, *, group: dist.ProcessGroup, ep_size: int, stats: ExchangeStats | None = None,
                 fp8: bool = False, overlap: bool = False, misroute: bool = False) -> None:
        self.group, self.ep_size, self.stats = group, ep_size, stats
        self.fp8, self.overlap, self.misroute = fp8, overlap, misroute

    # -- plan the exchange ------------------------------------------------------------------------
    def _route(self, topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int,
               capacity: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order of routed copies, by global expert; counts ``[ep, E_local]``; weights)."""
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=num_experts)
        if capacity is not None:  # per-source capacity, in token order (as the local dispatcher)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
            order = order[rank < capacity]
            counts = counts.clamp(max=capacity)
        send_counts = counts.view(self.ep_size, num_experts // self.ep_size)
        return order, send_counts, topk_weight.reshape(-1)[order]

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """``[ep, E_local]``: row s = how many rows source rank s sends to each of my experts."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=self.group)
        return recv

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, *,
                 num_experts: int, capacity: int | None) -> Dispatched:
        plan = self.plan_dispatch(topk_idx, topk_weight, num_experts=num_experts, capacity=capacity)
        return self.finish_dispatch(self.start_dispatch(x, plan))

    def plan_dispatch(self, topk_idx: torch.Tensor, topk_weight: torch.Tensor, *, num_experts: int,
                      capacity: int | None) -> tuple[_EPHandle, torch.Tensor]:
        order, send_counts, weights = self._route(topk_idx, topk_weight, num_experts, capacity)
        top_k = topk_idx.shape[1]
        token_ids = order // top_k
        if self.misroute:
            # Rows for rank j are labeled (and sent) as rows for rank j+1: wrong experts.
            send_counts = torch.roll(send_counts, shifts=1, dims=0)
            blocks = torch.split(token_ids, send_counts.roll(-1, 0).sum(1).tolist())
            token_ids = torch.cat([blocks[-1], *blocks[:-1]])
            wblocks = torch.split(weights, send_counts.roll(-1, 0).sum(1).tolist())
            weights = torch.cat([wblocks[-1], *wblocks[:-1]])
        recv_counts = self._exchange_counts(send_counts)
        # Received rows are source-major, expert-minor; the grouped GEMM wants expert-major.
        num_local = recv_counts.shape[1]
        starts = (torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)).view_as(recv_counts)
        expert_major = torch.cat([torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e]))
                                  for e in range(num_local) for s in range(self.ep_size)]
                                 or [torch.zeros(0, dtype=torch.int64)]).to(topk_idx.device)
        handle = _EPHandle(token_ids, weights, topk_idx.shape[0], send_counts.sum(1).tolist(),
                           recv_counts.sum(1).tolist(), expert_major)
        return handle, recv_counts.sum(0)

    def start_dispatch(self, x: torch.Tensor, plan: tuple[_EPHandle, torch.Tensor], *,
                       overlapped: bool = False) -> tuple[_Exchange, Any]:
        handle, _ = plan
        exchange = _Exchange(x[handle.token_ids], out_splits=handle.recv_splits, in_splits=handle.send_splits,
                             group=self.group, stats=self.stats, fp8=self.fp8, overlapped=overlapped)
        return exchange, plan

    def finish_dispatch(self, started: tuple[_Exchange, Any]) -> Dispatched:
        exchange, (handle, tokens_per_expert) = started
        received = exchange.collect()
        return Dispatched(received[handle.expert_major], tokens_per_expert, handle)

    def start_combine(self, expert_out: torch.Tensor, dispatched: Dispatched, *,
                      overlapped: bool = False) -> tuple[_Exchange, _EPHandle]:
        h: _EPHandle = dispatched.handle
        source_major = _unpermute(expert_out, h.expert_major)
        exchange = _Exchange(source_major, out_splits=h.send_splits, in_splits=h.recv_splits,
                             group=self.group, stats=self.stats, fp8=self.fp8, overlapped=overlapped)
        return exchange, h

    def finish_combine(self, started: tuple[_Exchange, _EPHandle]) -> torch.Tensor:
        exchange, h = started
        back = exchange.collect()
        acc = torch.promote_types(back.dtype, torch.float32)
        weighted = back.to(acc) * h.weights.unsqueeze(-1).to(acc)
        out = torch.zeros(h.num_tokens, back.shape[-1], dtype=acc, device=back.device)
        return out.index_add(0, h.token_ids, weighted).to(back.dtype)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self.finish_combine(self.start_combine(expert_out, dispatched))

    def run_experts(self, experts: nn.Module, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                    *, num_experts: int, capacity: int | None) -> tuple[torch.Tensor, int]:
        """Routed-expert output ``[T, dim]`` and the number of routed copies dispatched.

        With ``overlap`` the tokens go in two chunks whose exchanges overlap the other chunk's
        expert GEMMs; otherwise dispatch, experts and combine run one after the other.
        """
        if not self.overlap or x.shape[0] < 2:
            dispatched = self.dispatch(x, topk_idx, topk_weight, num_experts=num_experts, capacity=capacity)
            out = self.combine(experts(dispatched.tokens, dispatched.tokens_per_expert), dispatched)
            return out, int(dispatched.tokens_per_expert.sum())
        half = (x.shape[0] + 1) // 2
        chunks = [slice(0, half), slice(half, x.shape[0])]
        plans = [self.plan_dispatch(topk_idx[c], topk_weight[c], num_experts=num_experts, capacity=capacity)
                 for c in chunks]
        started = [self.start_dispatch(x[c], plan, overlapped=True) for c, plan in zip(chunks, plans)]
        combines = []
        for start in started:  # chunk 1's rows arrive while chunk 0's experts run
            dispatched = self.finish_dispatch(start)
            expert_out = experts(dispatched.tokens, dispatched.tokens_per_expert)
            combines.append(self.start_combine(expert_out, dispatched, overlapped=True))  # in flight during chunk 1
        out = torch.cat([self.finish_combine(c) for c in combines])
        return out, sum(int(p[1].sum()) for p in plans)


def _unpermute(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rows_src[index]``: returns ``out`` with ``out[index] = rows`` (differentiable)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return rows[inverse]
