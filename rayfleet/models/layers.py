"""Dense building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU FFN.

Design decisions:
- Norm statistics and rotary angles are computed in fp32 whatever the activation dtype
  (autocast or bf16 weights): both lose accuracy fast in bf16, and neither is a GEMM, so
  FP8 converters never touch them.
- Rotary angles are computed from explicit ``positions`` on every call instead of a cached
  table: no buffer to initialise after a meta-device build, and the paged serving path, whose
  tokens sit at arbitrary positions, uses the same code as training.
- Attention projections are plain ``nn.Linear`` modules named ``wq/wk/wv/wo``; FP8 converters
  swap exactly these (see ``fp8.convert``). The softmax runs in
  ``scaled_dot_product_attention`` in the activation dtype, never in FP8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayfleet.models.kv_cache import PagedBatch, paged_attention

__all__ = ["RMSNorm", "rotary_cos_sin", "apply_rotary", "Attention", "FeedForward"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[*positions.shape, head_dim // 2]`` in fp32 for integer ``positions``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, S, D]`` by per-token angles ``[B, S, D/2]`` (interleaved pairs)."""
    x32 = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x32[..., 0], x32[..., 1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention; full-sequence (training) or paged (serving)."""

    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.wq = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                paged: PagedBatch | None = None) -> torch.Tensor:
        """x ``[B, S, dim]``; positions ``[B, S]``; kv: this layer's (k_pool, v_pool) or None."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(positions.clamp(min=0), self.head_dim, self.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is None:
            if self.num_heads != self.num_kv_heads:
                rep = self.num_heads // self.num_kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            assert paged is not None, "paged forward needs both kv pools and PagedBatch"
            out = paged_attention(q, k, v, k_pool=kv[0], v_pool=kv[1], batch=paged)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU FFN: ``w2(silu(w1 x) * w3 x)``; used for dense layers and shared experts."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
