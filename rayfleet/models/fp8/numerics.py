"""FP8 quantization and GEMMs: every scaling granularity as one block shape.

Design decisions:
- One quantizer for all recipes. A granularity is a block shape ``(rows, cols)`` over the last
  two dims of a tensor whose *last dim is the GEMM contraction dim*; ``None`` means "the whole
  dim". Tensorwise is ``(None, None)``, rowwise ``(1, None)``, DeepSeek-V3 activation tiles
  ``(1, 128)`` and weight blocks ``(128, 128)``. Leading dims are batch dims (one scale grid
  per expert for ``[E, out, in]`` weights). Dims that are not block multiples are padded for
  the amax only.
- Scale computation is fused into the quantize step: ``quantize`` reads the tensor once for
  the amax, turns it into a scale and casts in the same call, and returns the amax so that
  delayed scaling records history without another pass. With a precomputed ``scale``
  (delayed scaling) it still returns the current amax from the same function.
- Scales are *dequantization* scales in fp32: ``x ~= data * scale``, the convention of
  ``torch._scaled_mm``, so they are passed to it unchanged.
- Real FP8 GEMMs use ``torch._scaled_mm`` where the device supports the scale layout
  (tensorwise and rowwise on CPU in torch 2.13 and on Hopper); blockwise, and devices without
  support, use the emulated path: dequantize to fp32 and matmul. Both compute the same
  product of the same FP8 values, which a unit test checks. On CUDA, K and N must be multiples
  of 16 (else the emulated path), and every pointer must sit on 16 bytes: an expert's tensorwise
  scale is a view into the grid of all experts' scales and a token group's row scales are a slice,
  so such views are copied first (on an H200 cuBLASLt refused them with
  CUBLAS_STATUS_NOT_SUPPORTED and every FP8 MoE training step failed; ``scripts/gpu_check.py``).
  A row count off 16 is padded with zero rows (defensive: whether cuBLASLt needs it is recorded by
  the GPU check's ``raw_odd_rows`` probe).
- Where ``_scaled_mm`` runs but is far slower than the emulated path, models are converted to the
  emulated path (``scaled_mm_fast``): some x86 CPUs get only oneDNN's reference FP8 matmul
  (``ref_matmul_t``), measured 800x slower than dequantize + fp32 matmul at 256^3 on a 2-core
  Sapphire Rapids guest, where a CPU with the JIT kernel ran 2048x1024x1024 in 55 ms.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfleet.errors import SpecError

__all__ = [
    "E4M3", "E5M2", "FP8_MAX", "Block", "TENSORWISE", "ROWWISE", "TILE_1x128", "BLOCK_128x128",
    "Fp8Tensor", "quantize", "dequantize", "fp8_mm", "scaled_mm_supported",
    "scaled_mm_fast",
]

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}
# Smallest amax we scale from: keeps all-zero tensors (e.g. a fresh gradient) finite.
_AMAX_FLOOR = 1e-12

Block = tuple[int | None, int | None]
TENSORWISE: Block = (None, None)
ROWWISE: Block = (1, None)
TILE_1x128: Block = (1, 128)
BLOCK_128x128: Block = (128, 128)


def _resolve(block: Block, rows: int, cols: int) -> tuple[int, int]:
    return (rows if block[0] is None else block[0]) or 1, (cols if block[1] is None else block[1]) or 1


@dataclass(frozen=True)
class Fp8Tensor:
    """FP8 ``data`` ``[..., R, C]`` with fp32 dequant ``scale`` ``[..., ceil(R/br), ceil(C/bc)]``."""

    data: torch.Tensor
    scale: torch.Tensor
    block: Block

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> "Fp8Tensor":
        """Transpose the last two dims (valid for any block shape: data and scale grid both flip)."""
        return Fp8Tensor(self.data.transpose(-2, -1), self.scale.transpose(-2, -1),
                         (self.block[1], self.block[0]))

    def __getitem__(self, index: int) -> "Fp8Tensor":
        """One batch entry (e.g. one expert's weight) of a batched tensor."""
        return Fp8Tensor(self.data[index], self.scale[index], self.block)

    def rows(self, start: int, end: int) -> "Fp8Tensor":
        """Rows ``[start, end)``; valid when scales are per row or shared by the whole tensor."""
        assert self.block[0] == 1 or self.scale.shape[-2] == 1, "row slicing would split a block"
        scale = self.scale if self.scale.shape[-2] == 1 else self.scale[..., start:end, :]
        return Fp8Tensor(self.data[..., start:end, :], scale, self.block)


def quantize(x: torch.Tensor, *, dtype: torch.dtype = E4M3, block: Block = TENSORWISE,
             scale: torch.Tensor | None = None) -> tuple[Fp8Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., R, C]`` to FP8 with one scale per ``block``; also return its amax.

    ``scale`` (dequant, broadcastable to the scale grid): use it instead of the current amax
    (delayed scaling, or 1 for the unscaled control). Values beyond the FP8 range saturate.
    """
    if dtype not in FP8_MAX:
        raise SpecError("dtype", dtype, "is not an FP8 dtype", "use torch.float8_e4m3fn or float8_e5m2")
    fmax = FP8_MAX[dtype]
    rows, cols = x.shape[-2], x.shape[-1]
    br, bc = _resolve(block, rows, cols)
    lead = x.shape[:-2]
    # abs().amax() rather than vector_norm(inf): the latter measured ~6x slower on CPU bf16.
    if br == rows and bc == cols:
        amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
        grid_view = None
    elif br == 1 and bc == cols:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        grid_view = None
    else:
        pad_r, pad_c = -rows % br, -cols % bc
        xp = F.pad(x, (0, pad_c, 0, pad_r)) if pad_r or pad_c else x
        grid_view = xp.reshape(*lead, (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)
        amax = grid_view.abs().amax(dim=(-3, -1)).float()
    used = amax.clamp(min=_AMAX_FLOOR) / fmax if scale is None else scale.float().expand_as(amax)
    if grid_view is None:
        scaled = x / used  # promotes bf16 to fp32 without a separate copy
    else:
        scaled = (grid_view.float() / used.unsqueeze(-1).unsqueeze(-3)).reshape(*xp.shape)
        scaled = scaled[..., :rows, :cols]
    data = scaled.clamp_(-fmax, fmax).to(dtype)
    return Fp8Tensor(data, used, block), amax


def dequantize(t: Fp8Tensor) -> torch.Tensor:
    """fp32 values of ``t``: ``data * scale`` with the scale grid expanded to its blocks."""
    rows, cols = t.data.shape[-2], t.data.shape[-1]
    br, bc = _resolve(t.block, rows, cols)
    scale = t.scale
    if scale.shape[-2] not in (1, rows) or scale.shape[-1] not in (1, cols):
        scale = scale.repeat_interleave(br, dim=-2)[..., :rows, :]
        scale = scale.repeat_interleave(bc, dim=-1)[..., :cols]
    return t.data.float() * scale


@functools.cache
def scaled_mm_supported(device_type: str, rowwise: bool) -> bool:
    """Whether ``torch._scaled_mm`` runs here with tensorwise (or rowwise) scales (probed once)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(16, 32, device=device_type).to(E4M3)
        b = torch.ones(16, 32, device=device_type).to(E4M3)
        sa = torch.ones(16, 1, device=device_type) if rowwise else torch.ones((), device=device_type)
        sb = torch.ones(1, 16, device=device_type) if rowwise else torch.ones((), device=device_type)
        torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


SLOW_KERNEL_RATIO = 20.0
"""``_scaled_mm`` slower than this many emulated GEMMs (128^3, tensorwise) is a reference kernel."""


@functools.cache
def scaled_mm_fast(device_type: str) -> bool:
    """Whether models here should use ``torch._scaled_mm``: it runs with tensorwise scales and,
    on CPU, it is not a reference kernel (timed once against the emulated GEMM at 128^3: the JIT
    kernel is within a few times of it, oneDNN's ``ref_matmul_t`` hundreds of times slower).
    Callers that must compare the two paths pass ``use_scaled_mm=True`` to ``fp8_mm`` directly."""
    if not scaled_mm_supported(device_type, False):
        return False
    if device_type != "cpu":
        return True
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(128, 128, generator=gen).to(E4M3)
    b = torch.randn(128, 128, generator=gen).to(E4M3)
    one = torch.ones(())

    def seconds(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    emulated = min(seconds(lambda: a.float() @ b.float().t()) for _ in range(3))
    real = float("inf")
    for _ in range(3):  # a reference kernel is slow from the first call: stop there
        real = min(real, seconds(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.float32)))
        if real > 5 * SLOW_KERNEL_RATIO * max(emulated, 1e-5):
            break
    fast = real <= SLOW_KERNEL_RATIO * max(emulated, 1e-5)
    if not fast:
        logger.info("torch._scaled_mm on this CPU is a reference kernel (%.1f ms vs %.2f ms emulated at "
                    "128^3): FP8 models use the emulated GEMM (the same FP8 values, fp32 accumulation)",
                    real * 1e3, emulated * 1e3)
    return fast


def _scaled_mm_layout(a: Fp8Tensor, b: Fp8Tensor) -> str | None:
    """'tensor' or 'row' when ``_scaled_mm`` can consume these scale grids directly."""
    m, k = a.data.shape
    n = b.data.shape[0]
    if a.scale.numel() == 1 and b.scale.numel() == 1:
        layout = "tensor"
    elif a.scale.shape == (m, 1) and b.scale.shape == (n, 1):
        layout = "row"
    else:
        return None
    if a.data.is_cuda and (k % 16 or n % 16):  # cuBLASLt alignment; CPU has no such rule
        return None
    return layout


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh copy of it when its data does not start on a 16-byte boundary."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fp8_mm(a: Fp8Tensor, b: Fp8Tensor, *, out_dtype: torch.dtype = torch.float32,
           use_scaled_mm: bool = True) -> torch.Tensor:
    """``a @ b.T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (both quantized along K).

    Uses ``torch._scaled_mm`` when allowed, supported here and the scale layouts fit;
    otherwise the emulated path (exact FP8 values, fp32 accumulation).
    """
    layout = _scaled_mm_layout(a, b) if use_scaled_mm else None
    if layout is not None and scaled_mm_supported(a.data.device.type, layout == "row"):
        data_a = a.data.contiguous()
        scale_a = a.scale.reshape(()) if layout == "tensor" else a.scale.contiguous()
        scale_b = b.scale.reshape(()) if layout == "tensor" else b.scale.reshape(1, -1)
        if a.data.is_cuda:  # cuBLASLt refuses scale (and operand) pointers off 16 bytes: an expert's
            # scale is a view into the grid of all experts' (``qw[g]``), a token group's row scales a slice
            scale_a, scale_b = _aligned16(scale_a), _aligned16(scale_b)
            data_a = _aligned16(data_a)
        rows = data_a.shape[0]
        pad = -rows % 16 if a.data.is_cuda else 0
        if pad:  # cuBLASLt refuses FP8 GEMMs whose row count is not a multiple of 16 (a group's tokens)
            data_a = torch.cat([data_a.view(torch.uint8), data_a.new_zeros(pad, data_a.shape[1], dtype=torch.uint8)]
                               ).view(data_a.dtype)
            if layout == "row":
                scale_a = torch.cat([scale_a, scale_a.new_ones(pad, 1)])
        # cuBLASLt rowwise scaling only writes bf16; CPU writes any float dtype.
        mm_dtype = torch.bfloat16 if (a.data.is_cuda and layout == "row") else out_dtype
        data_b = b.data.contiguous()
        out = torch._scaled_mm(data_a, (_aligned16(data_b) if data_b.is_cuda else data_b).t(), scale_a=scale_a,
                               scale_b=scale_b, out_dtype=mm_dtype)
        return out[:rows].to(out_dtype)
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)
