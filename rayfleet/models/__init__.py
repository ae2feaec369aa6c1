"""The MoE transformer (training and serving), its config presets, and the byte tokenizer.

This package imports neither Ray nor other rayfleet subpackages (only ``rayfleet.errors``), so
that a model can be built, tested and converted anywhere. FP8 lives in ``rayfleet.models.fp8``.

The names below load on first use (PEP 562), as in ``rayfleet.models.fp8``: a process that only
reads configs and presets (a job's driver validating its spec, Ray Train's controller unpickling
the loop's config) imports ``config``, not torch (about 2 s of CPU per process start).
"""

from __future__ import annotations

from rayfleet.models._lazy import lazy_exports

_HOME = {
    "config": ("PRESETS", "MoEConfig", "ParamCount", "preset"),
    "kv_cache": ("PagedBatch", "PagedKVCache", "paged_attention"),
    "layers": ("Attention", "FeedForward", "RMSNorm"),
    "moe": ("Dispatched", "GroupedExperts", "LocalDispatcher", "MoELayer", "Router", "RouterOutput",
            "TokenDispatcher", "grouped_linear"),
    "tokenizer": ("ByteTokenizer",),
    "transformer": ("MoETransformer", "TransformerBlock", "build_model", "materialize"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOME, globals())
