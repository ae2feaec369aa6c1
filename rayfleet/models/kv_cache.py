"""The paged KV cache interface between the model and a serving engine.

Design decisions:
- The engine owns memory and bookkeeping (which blocks belong to which request, vLLM-style);
  the model only reads and writes the tensors it is handed. ``PagedKVCache`` holds one K and
  one V tensor for all layers, ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``,
  so that a block id means the same slot in every layer and a block moves between tiers or
  replicas as one slice ``k[:, block_id]``.
- ``PagedBatch`` describes one forward step over a padded batch ``[B, S]`` of new tokens:
  their absolute ``positions``, where each is written (``slot_mapping``: ``block * block_size +
  offset``, -1 for padding) and which blocks each sequence reads (``block_tables``). Prefill,
  chunked prefill and decode are the same call with different ``S``; a mixed batch pads.
- Multi-head latent attention (DeepSeek) caches what it projects, not per-head K/V: the ``k``
  pool holds the normalised latent ``c_kv`` ``[.., 1, kv_lora_rank]`` and the ``v`` pool the
  rotated shared key ``[.., 1, rope_head_dim]``; the two pools then differ in their last dim.
  Block ids, tiers and transfers treat them as any other pair of pools.
- Padded ``[B, S]`` rather than vLLM's flattened varlen layout: it maps straight onto
  ``scaled_dot_product_attention`` with a mask and costs only padding FLOPs, which a CPU fleet
  can afford; a varlen kernel can replace ``paged_attention`` later without touching callers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig

__all__ = ["PagedKVCache", "PagedBatch", "paged_attention", "paged_write_gather", "paged_causal_mask"]


@dataclass(frozen=True)
class PagedKVCache:
    """K and V pools, each ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

    Mutated in place by every paged forward (the new tokens' K/V are written at their slots).
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None) -> "PagedKVCache":
        """Zeroed pools; ``v_head_dim`` (default ``head_dim``) sizes the ``v`` pool's last dim."""
        if num_blocks <= 0 or block_size <= 0:
            raise SpecError("num_blocks/block_size", (num_blocks, block_size), "must be positive",
                            "size the KV pool with at least one block of one slot")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        v_shape = shape[:-1] + (head_dim if v_head_dim is None else v_head_dim,)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(v_shape, dtype=dtype, device=device))

    @classmethod
    def for_config(cls, config: MoEConfig, *, num_blocks: int, block_size: int,
                   dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> "PagedKVCache":
        """Pools shaped for ``config`` (layers, KV heads, head dim; latent widths for MLA)."""
        if config.uses_mla:
            return cls.allocate(num_layers=config.num_layers, num_blocks=num_blocks,
                                block_size=block_size, num_kv_heads=1, head_dim=config.kv_lora_rank,
                                v_head_dim=config.rope_head_dim, dtype=dtype, device=device)
        return cls.allocate(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                            num_kv_heads=config.num_kv_heads, head_dim=config.resolved_head_dim,
                            dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class PagedBatch:
    """Addressing for one step of new tokens ``[B, S]`` (padding positions are -1).

    positions: ``[B, S]`` int64 absolute position of each new token, -1 for padding.
    slot_mapping: ``[B, S]`` int64 flat cache slot for each new token, -1 for padding.
    block_tables: ``[B, max_blocks]`` int64 block ids of each sequence in order; unused
        entries may hold any valid block id (they are masked by position).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor

    def __post_init__(self) -> None:
        if self.positions.shape != self.slot_mapping.shape or self.positions.dim() != 2:
            raise SpecError("slot_mapping", tuple(self.slot_mapping.shape),
                            f"must match positions {tuple(self.positions.shape)} as [B, S]",
                            "give one slot per new token, -1 for padding")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != self.positions.shape[0]:
            raise SpecError("block_tables", tuple(self.block_tables.shape),
                            "must be [B, max_blocks] with the batch size of positions",
                            "pass one row of block ids per sequence")

    @classmethod
    def from_blocks(cls, *, positions: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int) -> "PagedBatch":
        """Derive slots from positions and block tables (the common case: no sharing tricks)."""
        valid = positions >= 0
        pos = positions.clamp(min=0)
        blocks = torch.gather(block_tables, 1, pos // block_size)
        slots = torch.where(valid, blocks * block_size + pos % block_size, torch.full_like(pos, -1))
        return cls(positions=positions, slot_mapping=slots, block_tables=block_tables)


def paged_write_gather(new: torch.Tensor, pool: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """Write the new entries into one layer's pool, then read each sequence's blocks.

    new: ``[B, S, H, D]`` (padding rows are skipped); pool: ``[N, bs, H, D]`` (mutated).
    Returns ``[B, max_blocks * bs, H, D]`` in ``new``'s dtype: the context in position order.
    """
    bsz = new.shape[0]
    num_heads, width = pool.shape[2], pool.shape[3]
    flat = pool.view(-1, num_heads, width)
    slots = batch.slot_mapping.reshape(-1)
    keep = slots >= 0
    # Write before reading so that a chunk attends to itself through the same path as the past.
    flat[slots[keep]] = new.reshape(-1, num_heads, width)[keep].to(flat.dtype)
    tables = batch.block_tables.clamp(min=0)
    return pool[tables].reshape(bsz, -1, num_heads, width).to(new.dtype)


def paged_causal_mask(batch: PagedBatch, ctx: int) -> torch.Tensor:
    """``[B, 1, S, ctx]`` bool: the query at position p sees context positions ``<= p``.

    Padding queries get position 0 so that their softmax row is not empty (their output is
    garbage the caller ignores; an all-masked row would produce NaNs).
    """
    bsz, seqlen = batch.positions.shape
    key_pos = torch.arange(ctx, device=batch.positions.device)
    query_pos = batch.positions.clamp(min=0)
    return key_pos.view(1, 1, 1, ctx) <= query_pos.view(bsz, 1, seqlen, 1)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, *,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """Write the new K/V into one layer's pools, then attend over each sequence's blocks.

    q: ``[B, H, S, D]``; k_new, v_new: ``[B, Hkv, S, D]``; k_pool, v_pool: ``[N, bs, Hkv, D]``
    (mutated). Returns ``[B, H, S, D]``. Query at position p sees cached positions ``<= p``.
    """
    num_heads, num_kv = q.shape[1], k_new.shape[1]
    keys = paged_write_gather(k_new.transpose(1, 2), k_pool, batch).transpose(1, 2).to(q.dtype)
    values = paged_write_gather(v_new.transpose(1, 2), v_pool, batch).transpose(1, 2).to(q.dtype)
    mask = paged_causal_mask(batch, keys.shape[2])
    if num_heads != num_kv:
        keys = keys.repeat_interleave(num_heads // num_kv, dim=1)
        values = values.repeat_interleave(num_heads // num_kv, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
