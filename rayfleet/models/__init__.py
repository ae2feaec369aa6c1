"""The MoE transformer (training and serving), its config presets, and the byte tokenizer.

This package imports neither Ray nor other rayfleet subpackages (only ``rayfleet.errors``), so
that a model can be built, tested and converted anywhere. FP8 lives in ``rayfleet.models.fp8``.
"""

from rayfleet.models.config import PRESETS, MoEConfig, ParamCount, preset
from rayfleet.models.kv_cache import PagedBatch, PagedKVCache, paged_attention
from rayfleet.models.layers import Attention, FeedForward, RMSNorm
from rayfleet.models.moe import (Dispatched, GroupedExperts, LocalDispatcher, MoELayer, Router,
                                 RouterOutput, TokenDispatcher, grouped_linear)
from rayfleet.models.tokenizer import ByteTokenizer
from rayfleet.models.transformer import MoETransformer, TransformerBlock, build_model, materialize

__all__ = [
    "PRESETS", "MoEConfig", "ParamCount", "preset",
    "PagedBatch", "PagedKVCache", "paged_attention",
    "Attention", "FeedForward", "RMSNorm",
    "Dispatched", "GroupedExperts", "LocalDispatcher", "MoELayer", "Router", "RouterOutput",
    "TokenDispatcher", "grouped_linear",
    "ByteTokenizer",
    "MoETransformer", "TransformerBlock", "build_model", "materialize",
]
