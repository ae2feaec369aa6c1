"""Ring attention: context parallelism whose K/V travel around the CP ranks point-to-point.

Design decisions:
- Same layout and contract as :class:`~rayfleet.jobs.parallel.context_parallel.ContextParallelAttention`
  (load-balanced chunks, global positions, per-chunk-pair causal rules, log-sum-exp merge), but
  K/V are never gathered: at ring step ``s`` rank ``r`` holds the K/V of rank ``r - s`` while
  sending them on to ``r + 1`` (the next step's transfer runs under this step's compute), so a
  rank holds its own K/V plus one block in flight, ``O(S / cp)``.
- A custom :class:`torch.autograd.Function` saves only q, k, v, the output and the lse; backward
  recomputes each block's scores from the lse (flash attention's backward) and sends each K/V
  block's dK/dV accumulator along the ring with it: after ``cp`` hops it is back at its owner,
  complete. So neither direction keeps a score matrix beyond one block pair: the memory the
  all-gather variant spends on saved scores and gathered K/V is not spent here. The price:
  ``cp`` dependent exchanges per direction instead of one collective, and the backward's
  recompute of every block's scores.
- Point-to-point through ``batch_isend_irecv`` with global peer ranks, which gloo and NCCL
  both run; K and V (and dK, dV) go as one flat buffer per hop.
- ``control`` honours the same BROKEN ON PURPOSE variants as the all-gather path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rayfleet.jobs.parallel.context_parallel import CPControl, chunk_ids

__all__ = ["RingAttention"]


def _exchange(tensors: tuple[torch.Tensor, ...], *, group: dist.ProcessGroup, send_to: int,
              recv_from: int) -> tuple[list[Any], torch.Tensor]:
    """Start sending ``tensors`` (as one flat buffer) to ``send_to`` and receiving the same
    shapes from ``recv_from`` (global ranks); returns (works, receive buffer)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    buffer = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, send_to, group), dist.P2POp(dist.irecv, buffer, recv_from, group)]
    return dist.batch_isend_irecv(ops), buffer


def _unflatten(buffer: torch.Tensor, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    out, start = [], 0
    for t in like:
        out.append(buffer[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return tuple(out)


def _pairs(cp_rank: int, src: int, cp: int, control: CPControl) -> list[tuple[int, int, bool]]:
    """(query chunk index, key chunk index, causal) of the blocks rank ``cp_rank`` computes
    against rank ``src``'s K/V; later key chunks are skipped."""
    key_ids = (2 * src, 2 * src + 1) if control == "rank_order_kv" else chunk_ids(src, cp)
    out = []
    for a, gq in enumerate(chunk_ids(cp_rank, cp)):
        for b, gk in enumerate(key_ids):
            if gk < gq:
                out.append((a, b, False))
            elif gk == gq:
                out.append((a, b, control != "unmasked_diagonal"))
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                attn: "RingAttention") -> torch.Tensor:
        dtype = torch.promote_types(q.dtype, torch.float32)
        rep, c = q.shape[1] // k.shape[1], q.shape[-2] // 2
        qs = q.to(dtype).split(c, dim=2)
        outs = [q.new_zeros((*q.shape[:2], c, v.shape[-1]), dtype=dtype) for _ in range(2)]
        lses = [q.new_full((*q.shape[:2], c), float("-inf"), dtype=dtype) for _ in range(2)]
        kv = (k, v)
        for step in range(attn.cp):
            src = (attn.cp_rank - step) % attn.cp
            works, buffer = _exchange(kv, **attn.peers) if step < attn.cp - 1 else ([], None)
            ks = kv[0].to(dtype).repeat_interleave(rep, dim=1).split(c, dim=2)
            vs = kv[1].to(dtype).repeat_interleave(rep, dim=1).split(c, dim=2)
            for a, b, causal in _pairs(attn.cp_rank, src, attn.cp, attn.control):
                s = _scores(qs[a], ks[b], causal)
                lse = torch.logsumexp(s, dim=-1)
                total = torch.logaddexp(lses[a], lse)
                outs[a] = outs[a] * torch.exp(lses[a] - total).unsqueeze(-1) \
                    + torch.matmul(torch.exp(s - total.unsqueeze(-1)), vs[b])
                lses[a] = total
            for work in works:
                work.wait()
            if buffer is not None:
                kv = _unflatten(buffer, kv)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn = attn
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        attn: RingAttention = ctx.attn
        dtype = out.dtype
        rep, c = q.shape[1] // k.shape[1], q.shape[-2] // 2
        dout = dout.to(dtype)
        delta = (dout * out).sum(-1)  # rowsum(dO * O): softmax backward's correction
        qs, dos = q.to(dtype).split(c, dim=2), dout.split(c, dim=2)
        lses, deltas = lse.split(c, dim=2), delta.split(c, dim=2)
        dqs = [torch.zeros_like(x) for x in qs]
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=dtype, device=k.device), torch.zeros(v.shape, dtype=dtype, device=v.device))
        for step in range(attn.cp):
            src = (attn.cp_rank - step) % attn.cp
            works, buffer = _exchange(kv, **attn.peers) if step < attn.cp - 1 else ([], None)
            ks = kv[0].to(dtype).repeat_interleave(rep, dim=1).split(c, dim=2)
            vs = kv[1].to(dtype).repeat_interleave(rep, dim=1).split(c, dim=2)
            dks = [torch.zeros_like(x) for x in ks]
            dvs = [torch.zeros_like(x) for x in vs]
            for a, b, causal in _pairs(attn.cp_rank, src, attn.cp, attn.control):
                p = torch.exp(_scores(qs[a], ks[b], causal) - lses[a].unsqueeze(-1))
                dvs[b] += torch.matmul(p.transpose(-1, -2), dos[a])
                ds = p * (torch.matmul(dos[a], vs[b].transpose(-1, -2)) - deltas[a].unsqueeze(-1))
                scale = qs[a].shape[-1] ** -0.5
                dqs[a] += torch.matmul(ds, ks[b]) * scale
                dks[b] += torch.matmul(ds.transpose(-1, -2), qs[a]) * scale
            grouped = [torch.cat(d, dim=2).unflatten(1, (-1, rep)).sum(2) for d in (dks, dvs)]
            dkv = (dkv[0] + grouped[0], dkv[1] + grouped[1])
            for work in works:
                work.wait()
            if buffer is not None:
                kv = _unflatten(buffer, kv)
            # this block's dK/dV move on with it; after the last step they reach their owner
            dworks, dbuffer = _exchange(dkv, **attn.peers)
            for work in dworks:
                work.wait()
            dkv = _unflatten(dbuffer, dkv)
        return torch.cat(dqs, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingAttention:
    """The ``attend`` of an attention module under ring CP (same contract as ``causal_attention``)."""

    def __init__(self, *, group: dist.ProcessGroup, cp_rank: int, cp: int, control: CPControl = "none") -> None:
        self.group, self.cp_rank, self.cp, self.control = group, cp_rank, cp, control
        self.peers = {"group": group, "send_to": dist.get_global_rank(group, (cp_rank + 1) % cp),
                      "recv_from": dist.get_global_rank(group, (cp_rank - 1) % cp)}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the block math is fp32 by design
            return _Ring.apply(q, k, v, self)
