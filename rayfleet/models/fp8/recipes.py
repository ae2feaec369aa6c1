"""FP8 training recipes: which granularity, which gradient format, which scaling rule.

Design decisions:
- A recipe is data, not code: block shapes for activations/gradients and for weights, the
  gradient FP8 format, and whether scales come from the current tensor or an amax history.
  The same grouped-GEMM autograd function (``functional``) runs every recipe.
- The four production recipes follow their sources: ``tensorwise`` (torchao "tensorwise",
  current scaling, E5M2 gradients), ``delayed`` (Transformer Engine's DelayedScaling: scales
  from the max over an amax history, E5M2 gradients), ``rowwise`` (torchao "rowwise", E4M3
  everywhere) and ``blockwise`` (DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight
  blocks, E4M3 everywhere).
- The unscaled cast is a deliberately broken control for tests and the parity benchmark.
  It is not in ``RECIPES``; only ``unscaled_cast_control()`` returns it, so no user config can
  name it by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rayfleet.errors import SpecError
from rayfleet.models.fp8.numerics import (BLOCK_128x128, E4M3, E5M2, ROWWISE, TENSORWISE,
                                          TILE_1x128, Block)

__all__ = ["Fp8Recipe", "RECIPES", "get_recipe", "unscaled_cast_control"]


@dataclass(frozen=True)
class Fp8Recipe:
    """How one FP8 GEMM quantizes its operands (block shapes are along the contraction dim)."""

    name: str
    input_block: Block  # activations and output gradients
    weight_block: Block
    grad_dtype: torch.dtype = E5M2
    scaling: Literal["current", "delayed", "unscaled"] = "current"
    amax_history_len: int = 16

    def __post_init__(self) -> None:
        if self.scaling not in ("current", "delayed", "unscaled"):
            raise SpecError("scaling", self.scaling, "unknown scaling rule",
                            "use 'current' or 'delayed'")
        if self.scaling == "delayed" and (self.input_block, self.weight_block) != (TENSORWISE, TENSORWISE):
            raise SpecError("scaling", self.scaling, "delayed scaling keeps one amax history per "
                            "tensor, so it needs tensorwise blocks", "use current scaling for "
                            "rowwise or blockwise recipes")
        if self.amax_history_len < 1:
            raise SpecError("amax_history_len", self.amax_history_len, "must be >= 1", "use e.g. 16")
        if self.grad_dtype not in (E4M3, E5M2):
            raise SpecError("grad_dtype", self.grad_dtype, "is not an FP8 dtype",
                            "use torch.float8_e4m3fn or torch.float8_e5m2")

    @property
    def tensorwise(self) -> bool:
        return (self.input_block, self.weight_block) == (TENSORWISE, TENSORWISE)


RECIPES: dict[str, Fp8Recipe] = {
    "tensorwise": Fp8Recipe("tensorwise", TENSORWISE, TENSORWISE, grad_dtype=E5M2),
    "delayed": Fp8Recipe("delayed", TENSORWISE, TENSORWISE, grad_dtype=E5M2, scaling="delayed"),
    "rowwise": Fp8Recipe("rowwise", ROWWISE, ROWWISE, grad_dtype=E4M3),
    "blockwise": Fp8Recipe("blockwise", TILE_1x128, BLOCK_128x128, grad_dtype=E4M3),
}


def get_recipe(name: str) -> Fp8Recipe:
    if name not in RECIPES:
        raise SpecError("fp8.recipe", name, "unknown FP8 recipe", f"use one of {sorted(RECIPES)}")
    return RECIPES[name]


def unscaled_cast_control() -> Fp8Recipe:
    """BROKEN ON PURPOSE: casts to E4M3 with scale 1 (small gradients flush to zero).

    For tests and benchmarks that must show a wrong FP8 recipe failing; never for training.
    """
    return Fp8Recipe("unscaled-cast (control)", TENSORWISE, TENSORWISE, grad_dtype=E4M3,
                     scaling="unscaled")
