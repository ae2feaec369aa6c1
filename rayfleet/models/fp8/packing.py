"""FP8 wire format for the rows that expert-parallel all-to-all moves.

Design decisions:
- Row-self-describing packing: each row of a ``[T, D]`` tensor becomes ``D`` FP8 bytes followed
  by its ``ceil(D / block)`` fp32 tile scales as bytes, in one ``uint8`` tensor
  ``[T, D + 4 * ceil(D / block)]``. Any row split of the packed tensor is a valid packed tensor,
  so ``all_to_all_single`` with per-rank row splits (the EP dispatch, combine and their backward
  exchanges) moves data and scales in one collective, with no separate scale exchange to keep in
  step. (Weights are not all-gathered in FP8: FSDP2 gathers them in their parameter dtype.)
- 1x128 tiles (DeepSeek-V3's activation granularity) are the default: the receiver can feed
  the unpacked ``Fp8Tensor`` straight into a blockwise FP8 GEMM, or dequantize it. With
  ``block=D`` this degenerates to rowwise scaling.
- Cost: for bf16 sources the wire carries ``(1 + 4/block) / 2`` of the bytes (~52% at 128).
"""

from __future__ import annotations

import torch

from rayfleet.errors import SpecError
from rayfleet.models.fp8.numerics import E4M3, Fp8Tensor, quantize

__all__ = ["packed_row_bytes", "pack_fp8_rows", "unpack_fp8_rows"]


def packed_row_bytes(dim: int, *, block: int = 128) -> int:
    """Bytes per packed row of width ``dim``."""
    return dim + 4 * (-(-dim // block))


def pack_fp8_rows(x: torch.Tensor, *, block: int = 128, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """Quantize ``x`` ``[T, D]`` with 1 x ``block`` tiles and pack to ``uint8 [T, packed_row_bytes]``."""
    if x.dim() != 2:
        raise SpecError("x", tuple(x.shape), "packing expects a 2-D [rows, dim] tensor",
                        "flatten leading dims first, e.g. x.reshape(-1, x.shape[-1])")
    if x.shape[0] == 0:
        # An expert-parallel peer may receive no rows; the empty scale tensor has stride 0 and
        # cannot be viewed as bytes, so build the (empty) packed tensor directly.
        return torch.empty(0, packed_row_bytes(x.shape[1], block=block), dtype=torch.uint8, device=x.device)
    q, _ = quantize(x, dtype=dtype, block=(1, block))
    data = q.data.contiguous().view(torch.uint8)
    scales = q.scale.contiguous().view(torch.uint8)
    return torch.cat((data, scales), dim=1)


def unpack_fp8_rows(packed: torch.Tensor, *, dim: int, block: int = 128,
                    dtype: torch.dtype = E4M3) -> Fp8Tensor:
    """Inverse of ``pack_fp8_rows``: an ``Fp8Tensor`` ``[T, dim]`` (``dequantize`` for values)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != packed_row_bytes(dim, block=block):
        raise SpecError("packed", (packed.dtype, tuple(packed.shape)),
                        f"is not a packed FP8 tensor of dim={dim}, block={block}",
                        "pass the dim and block used by pack_fp8_rows")
    data = packed[:, :dim].contiguous().view(dtype)
    scale = packed[:, dim:].contiguous().view(torch.float32)
    return Fp8Tensor(data, scale, (1, block))
