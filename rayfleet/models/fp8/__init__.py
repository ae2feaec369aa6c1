"""FP8 numerics, recipes and model converters (see ``convert.convert_to_fp8``).

The names below load on first use (PEP 562): a process that only reads recipes (a job's driver
validating its spec, Ray Train's controller) imports ``recipe_names`` and no torch at all; one
that casts imports ``recipes`` and ``numerics``, not the converter's DTensor-aware modules
(``torch.distributed.tensor``: ~1 s of CPU per process start).
"""

from __future__ import annotations

from rayfleet.models._lazy import lazy_exports

_HOME = {
    "convert": ("FP8_LINEAR_NAMES", "HIGH_PRECISION_PARTS", "Fp8ConversionReport", "convert_to_fp8"),
    "functional": ("DelayedScalingState", "fp8_grouped_mm"),
    "modules": ("Fp8GroupedExperts", "Fp8Linear"),
    "numerics": ("BLOCK_128x128", "E4M3", "E5M2", "FP8_MAX", "ROWWISE", "TENSORWISE", "TILE_1x128", "Fp8Tensor",
                 "dequantize", "fp8_mm", "quantize", "scaled_mm_fast", "scaled_mm_supported"),
    "packing": ("pack_fp8_rows", "packed_row_bytes", "unpack_fp8_rows"),
    "recipe_names": ("RECIPE_NAMES",),
    "recipes": ("RECIPES", "Fp8Recipe", "get_recipe", "unscaled_cast_control"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOME, globals())
