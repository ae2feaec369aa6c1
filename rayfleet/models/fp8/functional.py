"""The FP8 grouped GEMM with its backward: one autograd function for every recipe.

Design decisions:
- Dense linears are the one-group case of the grouped GEMM (``weight[None]``), so attention
  projections and experts share one implementation and one set of tests.
- Forward: activations ``[M, K]`` are quantized once for all groups (per-token or per-tile
  scales do not care about segment boundaries), weights ``[G, N, K]`` once per group, then
  one FP8 GEMM per group segment. E4M3 forward.
- Backward: the output gradient is quantized in the recipe's gradient format. Where the
  transposed quantized operand is still a valid quantization along the new contraction dim
  (tensorwise scales, 128x128 weight blocks) it is reused (no second pass); otherwise
  (rowwise, 1x128 tiles) the operand is re-quantized along the new contraction dim from the
  saved high-precision tensor, as DeepSeek-V3 and torchao rowwise do.
- Autocast is off inside: the function decides its own precision and returns ``out_dtype``
  (the caller's autocast dtype), so the emulated path's fp32 matmul is not silently
  downcast to bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from rayfleet.models.fp8.numerics import E4M3, FP8_MAX, fp8_mm, quantize
from rayfleet.models.fp8.recipes import Fp8Recipe

__all__ = ["AmaxHistory", "DelayedScalingState", "fp8_grouped_mm"]


class AmaxHistory(nn.Module):
    """Rolling amax history ``[*prefix, H]`` for delayed scaling (non-persistent buffers).

    Non-persistent on purpose: checkpoints stay identical with and without FP8, so a model can
    switch recipe on resume; the history refills within ``H`` steps.
    """

    def __init__(self, prefix: tuple[int, ...], length: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.register_buffer("history", torch.zeros(*prefix, length, device=device), persistent=False)

    def scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Dequant scale from the history max, or None before the first record (use current)."""
        amax = self.history.amax(dim=-1)
        if not bool((amax > 0).all()):
            return None
        return (amax / FP8_MAX[dtype]).unsqueeze(-1).unsqueeze(-1)

    @torch.no_grad()
    def reset_state(self) -> None:
        """Forget the history (called by ``init_weights`` after a meta-device build)."""
        self.history.zero_()

    @torch.no_grad()
    def record(self, amax: torch.Tensor) -> None:
        self.history.copy_(torch.roll(self.history, 1, dims=-1))
        self.history[..., 0] = amax.reshape(self.history.shape[:-1])


class DelayedScalingState(nn.Module):
    """The three histories one FP8 GEMM needs: input, weight (per group), output gradient."""

    def __init__(self, num_groups: int, length: int) -> None:
        super().__init__()
        self.x = AmaxHistory((), length)
        self.w = AmaxHistory((num_groups,), length)
        self.g = AmaxHistory((), length)


def _scale_for(recipe: Fp8Recipe, history: AmaxHistory | None, dtype: torch.dtype,
               like: torch.Tensor) -> torch.Tensor | None:
    if recipe.scaling == "unscaled":
        return torch.ones((), device=like.device)
    if recipe.scaling == "delayed" and history is not None:
        return history.scale(dtype)
    return None


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class _Fp8GroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sizes: list[int], recipe: Fp8Recipe,
                state: DelayedScalingState | None, out_dtype: torch.dtype,
                use_scaled_mm: bool) -> torch.Tensor:
        qx, amax_x = quantize(x, dtype=E4M3, block=recipe.input_block,
                              scale=_scale_for(recipe, state.x if state is not None else None, E4M3, x))
        qw, amax_w = quantize(weight, dtype=E4M3, block=recipe.weight_block,
                              scale=_scale_for(recipe, state.w if state is not None else None, E4M3, x))
        if state is not None:
            state.x.record(amax_x)
            state.w.record(amax_w)
        bounds = _offsets(sizes)
        outs = [fp8_mm(qx.rows(s, e), qw[g], out_dtype=out_dtype, use_scaled_mm=use_scaled_mm)
                for g, (s, e) in enumerate(bounds) if e > s]
        ctx.save_for_backward(x, weight)
        # Only tensorwise backward reuses the quantized input; other recipes re-quantize it.
        ctx.qw, ctx.qx = qw, (qx if recipe.tensorwise else None)
        ctx.bounds, ctx.recipe, ctx.state, ctx.use_scaled_mm = bounds, recipe, state, use_scaled_mm
        if not outs:
            return x.new_zeros(x.shape[0], weight.shape[1], dtype=out_dtype)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, state, use = ctx.recipe, ctx.state, ctx.use_scaled_mm
        gdt = recipe.grad_dtype
        with torch.autocast(grad_out.device.type, enabled=False):
            qg, amax_g = quantize(grad_out, dtype=gdt, block=recipe.input_block,
                                  scale=_scale_for(recipe, state.g if state is not None else None, gdt, grad_out))
            if state is not None:
                state.g.record(amax_g)
            reuse_weight = recipe.weight_block[0] == recipe.weight_block[1]  # tensorwise or square
            qw_t = ctx.qw.t() if reuse_weight else quantize(
                weight.transpose(-2, -1), dtype=E4M3, block=recipe.weight_block,
                scale=_scale_for(recipe, None, E4M3, x))[0]
            grad_x = torch.zeros_like(x)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for g, (s, e) in enumerate(ctx.bounds):
                if e == s:
                    continue
                grad_x[s:e] = fp8_mm(qg.rows(s, e), qw_t[g], out_dtype=x.dtype, use_scaled_mm=use)
                if recipe.tensorwise:  # one scale per tensor: the transposes are still valid
                    qg_t, qx_t = qg.rows(s, e).t(), ctx.qx.rows(s, e).t()
                else:  # per-row/tile scales ran along K or N; re-quantize along the tokens
                    unit = _scale_for(recipe, None, gdt, x)
                    qg_t = quantize(grad_out[s:e].t(), dtype=gdt, block=recipe.input_block, scale=unit)[0]
                    qx_t = quantize(x[s:e].t(), dtype=E4M3, block=recipe.input_block, scale=unit)[0]
                grad_w[g] = fp8_mm(qg_t, qx_t, out_dtype=torch.float32, use_scaled_mm=use)
        # ctx.qw / ctx.qx stay until autograd frees this node: a schedule that splits backward
        # (DualPipeV's input- then weight-gradient passes, retain_graph) runs it twice.
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, sizes: list[int], *, recipe: Fp8Recipe,
                   state: DelayedScalingState | None = None, out_dtype: torch.dtype | None = None,
                   use_scaled_mm: bool = True) -> torch.Tensor:
    """FP8 ``x`` ``[M, K]`` segments (``sizes``) times ``weight[g].T`` (``weight`` ``[G, N, K]``).

    Returns ``[M, N]`` in ``out_dtype`` (default: the autocast dtype if autocast is on, else
    ``x.dtype``). ``state`` is required for delayed scaling and mutated by forward/backward.
    """
    assert sum(sizes) == x.shape[0] and len(sizes) == weight.shape[0], "segments must tile x"
    if out_dtype is None:
        out_dtype = (torch.get_autocast_dtype(x.device.type)
                     if torch.is_autocast_enabled(x.device.type) else x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _Fp8GroupedMm.apply(x, weight, list(sizes), recipe, state, out_dtype, use_scaled_mm)
