"""FP8 numerics, recipes and model converters (see ``convert.convert_to_fp8``).

The names below load on first use (PEP 562): a process that only reads recipes (a job's driver
validating its spec, Ray Train's controller) imports ``recipes`` and ``numerics``, not the
converter's DTensor-aware modules (``torch.distributed.tensor``: ~1 s of CPU per process start).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "convert": ("FP8_LINEAR_NAMES", "HIGH_PRECISION_PARTS", "Fp8ConversionReport", "convert_to_fp8"),
    "functional": ("DelayedScalingState", "fp8_grouped_mm"),
    "modules": ("Fp8GroupedExperts", "Fp8Linear"),
    "numerics": ("BLOCK_128x128", "E4M3", "E5M2", "FP8_MAX", "ROWWISE", "TENSORWISE", "TILE_1x128", "Fp8Tensor",
                 "dequantize", "fp8_mm", "quantize", "scaled_mm_fast", "scaled_mm_supported"),
    "packing": ("pack_fp8_rows", "packed_row_bytes", "unpack_fp8_rows"),
    "recipes": ("RECIPES", "Fp8Recipe", "get_recipe", "unscaled_cast_control"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = [name for names in _HOME.values() for name in names]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
