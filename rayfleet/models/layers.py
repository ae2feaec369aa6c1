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

__all__ = ["RMSNorm", "rotary_cos_sin", "apply_rotary", "causal_attention", "Attention", "FeedForward"]


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 interleaved: bool = True) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, S, D]`` by per-token angles ``[B, S, D/2]``.

    interleaved: pairs ``(x0, x1), (x2, x3) ...`` (rayfleet, DeepSeek); otherwise pairs
    ``(x_i, x_{i + D/2})`` (Hugging Face Llama/Qwen/Mixtral's ``rotate_half``).
    """
    x32 = x.float()
    if interleaved:
        x32 = x32.unflatten(-1, (-1, 2))
        x_a, x_b = x32[..., 0], x32[..., 1]
    else:
        x_a, x_b = x32.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    a, b = x_a * cos - x_b * sin, x_a * sin + x_b * cos
    rotated = torch.stack((a, b), dim=-1).flatten(-2) if interleaved else torch.cat((a, b), dim=-1)
    return rotated.to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over whole sequences: q ``[B, H, S, D]``, k/v ``[B, Hkv, S, D or Dv]``
    (``Hkv`` divides ``H``: grouped-query heads are repeated here)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query attention; full-sequence (training) or paged (serving).

    ``attend(q, k, v)`` is the full-sequence core (rotated q/k, un-repeated k/v heads):
    :func:`causal_attention` unless a parallelizer swaps in another with the same contract
    (context parallelism: ``jobs/parallel/context_parallel.py``).
    """

    attend = staticmethod(causal_attention)

    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, rope_interleaved: bool = True, qkv_bias: bool = False,
                 qk_norm: bool = False, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.wq = nn.Linear(dim, num_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=False)
        # Per-head norms over head_dim (Qwen3): they commute with a TP split of the heads, but their
        # gradients are then partial per TP peer (summed in jobs/parallel: tensor_parallel.py).
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                paged: PagedBatch | None = None) -> torch.Tensor:
        """x ``[B, S, dim]``; positions ``[B, S]``; kv: this layer's (k_pool, v_pool) or None."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.num_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = rotary_cos_sin(positions.clamp(min=0), self.head_dim, self.rope_theta)
        q = apply_rotary(q, cos, sin, interleaved=self.rope_interleaved)
        k = apply_rotary(k, cos, sin, interleaved=self.rope_interleaved)
        if kv is None:
            out = self.attend(q, k, v)
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
