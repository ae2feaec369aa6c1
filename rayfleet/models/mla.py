"""Multi-head latent attention (DeepSeek-V2/V3), full-sequence and paged.

Design decisions:
- Parameter names follow DeepSeek's reference code (``wq`` or ``wq_a``/``q_norm``/``wq_b``,
  ``wkv_a``/``kv_norm``/``wkv_b``, ``wo``); the Hugging Face mapping lives in ``models.hf``.
  The FP8 converter's allowlist matches ``wq`` and ``wo`` here as in GQA; the low-rank
  projections stay in high precision (they are small and feed norms).
- The paged cache keeps the latent, not per-head K/V: ``c_kv`` (after ``kv_norm``) in the
  ``k`` pool and the rotated shared key in the ``v`` pool (see ``kv_cache``). Every step
  re-expands the context through ``wkv_b`` ("naive" MLA). The absorbed form (folding ``wkv_b``
  into the query and output) saves FLOPs at long context on GPUs; on a CPU fleet with tiny
  contexts the naive form is simpler and is the numerics Hugging Face runs, so the oracle
  tests compare like with like.
- Rotary applies only to the ``rope_head_dim`` slice; its layout (interleaved or halves) is
  the config's ``rope_interleaved``. Both layouts give the same scores as long as q and k use
  the same one, which is why DeepSeek's interleaved checkpoints need no weight permutation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayfleet.models.kv_cache import PagedBatch, paged_causal_mask, paged_write_gather
from rayfleet.models.layers import RMSNorm, apply_rotary, causal_attention, rotary_cos_sin

__all__ = ["LatentAttention"]


class LatentAttention(nn.Module):
    """Causal MLA over ``num_heads`` heads of q/k width ``nope + rope`` and value width ``v``.

    ``attend(q, k, v)``: the full-sequence core on the expanded heads, swappable as in ``Attention``.
    """

    attend = staticmethod(causal_attention)

    def __init__(self, *, dim: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 nope_head_dim: int, rope_head_dim: int, v_head_dim: int, rope_theta: float,
                 rope_interleaved: bool, norm_eps: float) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_head_dim, self.rope_head_dim, self.v_head_dim = nope_head_dim, rope_head_dim, v_head_dim
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        qk_dim = nope_head_dim + rope_head_dim
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, num_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, num_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, num_heads * (nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(num_heads * v_head_dim, dim, bias=False)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                paged: PagedBatch | None = None) -> torch.Tensor:
        """x ``[B, S, dim]``; positions ``[B, S]``; kv: this layer's (latent, rope-key) pools."""
        bsz, seqlen, _ = x.shape
        q = self._query(x).view(bsz, seqlen, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_head_dim, self.rope_head_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)  # [B, S, kv_lora_rank]
        cos, sin = rotary_cos_sin(positions.clamp(min=0), self.rope_head_dim, self.rope_theta)
        q_rot = apply_rotary(q_rot, cos, sin, interleaved=self.rope_interleaved)
        k_rot = apply_rotary(k_rot.unsqueeze(1), cos, sin, interleaved=self.rope_interleaved)
        mask = None
        if kv is not None:
            assert paged is not None, "paged forward needs both kv pools and PagedBatch"
            latent = paged_write_gather(latent.unsqueeze(2), kv[0], paged).squeeze(2)
            k_rot = paged_write_gather(k_rot.transpose(1, 2), kv[1], paged).transpose(1, 2)
            mask = paged_causal_mask(paged, latent.shape[1])
        ctx = latent.shape[1]
        expanded = self.wkv_b(latent).view(bsz, ctx, self.num_heads, -1).transpose(1, 2)
        k_nope, v = expanded.split([self.nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        if mask is None:
            out = self.attend(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
