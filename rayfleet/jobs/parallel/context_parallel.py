"""Context parallelism (CP): attention over a sequence split across the ``cp`` ranks of a group.

Design decisions:
- Load-balanced chunking (Megatron-Core, torchtitan, Llama 3): the sequence is cut into
  ``2 * cp`` equal chunks and CP rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``. Under a
  causal mask chunk ``g`` attends to ``g + 1`` chunks, so every rank attends to ``2 * cp + 1``
  chunks: equal work, where a contiguous split would leave the last rank ``2 * cp - 1`` times
  the first one's. Tokens, targets and rotary positions are cut the same way
  (:func:`split_for_context_parallel`); each token keeps its *global* position.
- K/V exchange: all-gather of each layer's K and V over the CP group (Llama 3's CP) in an
  autograd function of ours (:class:`_GatherOverGroup`) whose backward sums dK/dV back to their
  owners: a reduce-scatter on NCCL, an ``all_to_all_single`` plus sum on gloo (which has no
  reduce-scatter). Not ``torch.distributed.nn.functional.all_gather``: deprecated, and its gloo
  backward scatters from *group* ranks as if they were global ranks, which fails on every CP
  group but the first (CP2 x TP2 hit it). The alternative is the point-to-point ring of
  ``context_parallel_ring`` (Megatron's ``p2p`` CP, ``comm.cp_exchange: ring``). Memory
  trade-off: here each rank holds the whole sequence's K/V of one layer during that layer's
  attention (and, for backward, as saved activations): ``B * S * Hkv * D`` per tensor instead
  of the ring's ``2 * B * S/cp * Hkv * D`` in flight; with grouped-query heads K/V are a small
  part of a layer's activations, and the gather is one collective instead of ``cp`` dependent
  hops. The ring runs the same per-chunk-pair math step by step.
- Online-softmax merge: each query chunk attends to the chunks before it (no mask) and to its
  own chunk (causal mask) as separate blocks, each giving ``(out, lse)``; the blocks merge by
  log-sum-exp (:func:`merge_partials`), as flash/ring attention do. Chunks after the query
  chunk are skipped, never masked. The block math runs in fp32 with explicit scores so autograd
  is exact on every backend (``scaled_dot_product_attention`` does not return the lse). Its
  cost: the scores ``[B, H, 2c, <= S]`` of each layer are materialized and kept for backward,
  O(S^2 / cp) per rank, which at long context on GPUs outweighs the K/V gather; a fused kernel
  that returns the lse (flash attention's forward/backward) is the replacement there.
- Installed from outside the model (:func:`apply_context_parallel`): the attention modules'
  ``attend`` is swapped, and a forward pre-hook replaces the ``positions`` argument of a
  full-sequence forward with the rank's global positions, so the model, the pipeline stages and
  the loop keep calling attention as before.
- ``control`` keeps two BROKEN ON PURPOSE variants reachable for the parity tests:
  ``"rank_order_kv"`` lays the gathered K/V out in rank order (no load-balanced reorder) and
  ``"unmasked_diagonal"`` drops the causal mask inside a chunk (tokens see their future).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from rayfleet.errors import SpecError
from rayfleet.models.layers import Attention
from rayfleet.models.mla import LatentAttention

__all__ = ["CPControl", "CPBatch", "chunk_ids", "cp_positions", "split_for_context_parallel", "model_inputs",
           "block_attention",
           "merge_partials", "attend_chunks", "ContextParallelAttention", "apply_context_parallel"]

CPControl = Literal["none", "rank_order_kv", "unmasked_diagonal"]


class CPBatch(NamedTuple):
    """One CP rank's share of a micro-batch: inputs/targets ``[B, 2c]``, positions ``[B, 2c]``."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two global chunks (of ``2 * cp``) that CP rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def _check_divisible(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise SpecError("data.seq_len", seq_len, f"context parallelism cp={cp} cuts sequences into 2*cp={2 * cp} "
                        "equal chunks (load balancing)", f"use a seq_len divisible by {2 * cp}, or a smaller cp")


def cp_positions(seq_len: int, *, cp_rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions ``[2 * seq_len / (2 * cp)]`` of the tokens CP rank ``cp_rank`` holds."""
    _check_divisible(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(g * chunk, (g + 1) * chunk, device=device) for g in chunk_ids(cp_rank, cp)])


def split_for_context_parallel(tokens: torch.Tensor, *, cp_rank: int, cp: int) -> CPBatch:
    """Cut a micro-batch of samples ``[B, S + 1]`` into this rank's inputs, targets and positions.

    Inputs are ``tokens[:, :-1]`` and targets ``tokens[:, 1:]`` as without CP, then both keep
    the rank's two chunks; every CP rank of a DP replica receives the same samples.
    """
    seq_len = tokens.shape[1] - 1
    positions = cp_positions(seq_len, cp_rank=cp_rank, cp=cp, device=tokens.device)
    pick = positions.expand(tokens.shape[0], -1)
    return CPBatch(tokens[:, :-1][:, positions], tokens[:, 1:][:, positions], pick)


def model_inputs(tokens: torch.Tensor, *, cp_rank: int = 0, cp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) a rank trains on from samples ``[B, S + 1]``: the whole shifted
    sequences, or with ``cp > 1`` this rank's chunks of them (positions come from the model's
    CP pre-hook, see :func:`apply_context_parallel`)."""
    if cp == 1:
        return tokens[:, :-1], tokens[:, 1:]
    share = split_for_context_parallel(tokens, cp_rank=cp_rank, cp=cp)
    return share.inputs, share.targets


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in fp32 (or wider): q ``[B, H, Sq, D]``, k ``[B, H, Sk, D]``, v ``[B, H, Sk, Dv]``.

    Returns ``(out [B, H, Sq, Dv], lse [B, H, Sq])``. ``causal`` masks key ``j > i`` for query
    ``i`` (a diagonal block: ``Sq == Sk`` at the same positions).
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(dtype)), lse


def merge_partials(partials: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge ``(out_i, lse_i)`` of the same queries over disjoint key blocks (online softmax).

    ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp_i(lse_i)``: the softmax over
    the union of the blocks, without ever holding all their scores at once.
    """
    if len(partials) == 1:
        return partials[0][0]
    lses = torch.stack([lse for _, lse in partials])
    total = torch.logsumexp(lses, dim=0)
    return sum(torch.exp(lse - total).unsqueeze(-1) * out for out, lse in partials)


def attend_chunks(q: torch.Tensor, k_chunks: Sequence[torch.Tensor], v_chunks: Sequence[torch.Tensor], *,
                  cp_rank: int, cp: int, control: CPControl = "none") -> torch.Tensor:
    """This rank's attention output ``[B, H, 2c, Dv]`` from its queries and the global K/V chunks.

    q: ``[B, H, 2c, D]``, the rank's chunks :func:`chunk_ids` in order. ``k_chunks`` /
    ``v_chunks``: the ``2 * cp`` global chunks in sequence order, ``[B, Hkv, c, D]`` each
    (``Hkv`` divides ``H``). Pure: no communication (the gather is the caller's).
    """
    chunk = q.shape[-2] // 2
    rep = q.shape[1] // k_chunks[0].shape[1]
    outs = []
    for local, g in enumerate(chunk_ids(cp_rank, cp)):
        q_g = q[:, :, local * chunk:(local + 1) * chunk]
        partials = []
        if g > 0:  # every earlier chunk, unmasked: one block
            k_prev, v_prev = torch.cat(list(k_chunks[:g]), dim=2), torch.cat(list(v_chunks[:g]), dim=2)
            partials.append(block_attention(q_g, _repeat(k_prev, rep), _repeat(v_prev, rep), causal=False))
        partials.append(block_attention(q_g, _repeat(k_chunks[g], rep), _repeat(v_chunks[g], rep),
                                        causal=control != "unmasked_diagonal"))
        outs.append(merge_partials(partials))
    return torch.cat(outs, dim=2).to(q.dtype)


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _global_chunks(gathered: Sequence[torch.Tensor], *, cp: int, control: CPControl) -> list[torch.Tensor]:
    """Rank ``j``'s tensor holds chunks ``j`` and ``2cp-1-j``: put all ``2 * cp`` in sequence order."""
    halves = [t.chunk(2, dim=2) for t in gathered]
    if control == "rank_order_kv":  # BROKEN ON PURPOSE: as if rank j held chunks 2j, 2j+1
        return [h for pair in halves for h in pair]
    chunks: list[Any] = [None] * (2 * cp)
    for j, (first, second) in enumerate(halves):
        chunks[j], chunks[2 * cp - 1 - j] = first, second
    return chunks


class _GatherOverGroup(torch.autograd.Function):
    """``x`` of every rank of ``group``, stacked ``[group_size, *x.shape]``; backward sums each
    rank's gradient slice back to its owner."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        received = torch.empty_like(grad)  # received[j]: rank j's gradient of this rank's x
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(0), None


class ContextParallelAttention:
    """The ``attend`` of an attention module under CP: gather K/V over ``group``, attend, merge."""

    def __init__(self, *, group: dist.ProcessGroup, cp_rank: int, cp: int, control: CPControl = "none") -> None:
        self.group, self.cp_rank, self.cp, self.control = group, cp_rank, cp, control

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the block math is fp32 by design
            return self._attend(q, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all = _GatherOverGroup.apply(k, self.group).unbind(0)
        v_all = _GatherOverGroup.apply(v, self.group).unbind(0)
        return attend_chunks(q, _global_chunks(k_all, cp=self.cp, control=self.control),
                             _global_chunks(v_all, cp=self.cp, control=self.control),
                             cp_rank=self.cp_rank, cp=self.cp, control=self.control)


def apply_context_parallel(model: nn.Module, *, attend: Any, cp_rank: int, cp: int) -> int:
    """Make every attention module of ``model`` attend across the CP group; returns how many.

    ``attend``: the CP core, K/V all-gathered (:class:`ContextParallelAttention`) or passed
    around a ring (:class:`~rayfleet.jobs.parallel.context_parallel_ring.RingAttention`).

    The model must then be fed :func:`split_for_context_parallel` shares. A full-sequence forward
    (no KV cache) gets its rotary ``positions`` replaced by the rank's global ones; a paged
    (serving) forward is left alone.
    """
    def global_positions(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("kv") is not None:
            return None
        x = args[0]
        seq_len = x.shape[1] * cp
        positions = cp_positions(seq_len, cp_rank=cp_rank, cp=cp, device=x.device).expand(x.shape[0], -1)
        return (x, positions, *args[2:]), kwargs

    done = 0
    for module in model.modules():
        if isinstance(module, (Attention, LatentAttention)):
            module.attend = attend
            module.register_forward_pre_hook(global_positions, with_kwargs=True)
            done += 1
    return done
