"""FP8 numerics, recipes and model converters (see ``convert.convert_to_fp8``)."""

from rayfleet.models.fp8.convert import (FP8_LINEAR_NAMES, HIGH_PRECISION_PARTS,
                                         Fp8ConversionReport, convert_to_fp8)
from rayfleet.models.fp8.functional import DelayedScalingState, fp8_grouped_mm
from rayfleet.models.fp8.modules import Fp8GroupedExperts, Fp8Linear
from rayfleet.models.fp8.numerics import (BLOCK_128x128, E4M3, E5M2, FP8_MAX, ROWWISE, TENSORWISE,
                                          TILE_1x128, Fp8Tensor, dequantize, fp8_mm, quantize,
                                          scaled_mm_fast, scaled_mm_supported)
from rayfleet.models.fp8.packing import pack_fp8_rows, packed_row_bytes, unpack_fp8_rows
from rayfleet.models.fp8.recipes import RECIPES, Fp8Recipe, get_recipe, unscaled_cast_control

__all__ = [
    "FP8_LINEAR_NAMES", "HIGH_PRECISION_PARTS", "Fp8ConversionReport", "convert_to_fp8",
    "DelayedScalingState", "fp8_grouped_mm", "Fp8GroupedExperts", "Fp8Linear",
    "BLOCK_128x128", "E4M3", "E5M2", "FP8_MAX", "ROWWISE", "TENSORWISE", "TILE_1x128",
    "Fp8Tensor", "dequantize", "fp8_mm", "quantize", "scaled_mm_fast", "scaled_mm_supported",
    "pack_fp8_rows", "packed_row_bytes", "unpack_fp8_rows",
    "RECIPES", "Fp8Recipe", "get_recipe", "unscaled_cast_control",
]
