"""Hugging Face models in and out: config mapping, weight names, tokenizers (no I/O here).

``from_hf_config`` maps a ``config.json`` dict onto ``MoEConfig``; ``load_hf_weights`` reads a
rank's slice of each tensor from a ``TensorSource`` (``rayfleet.storage.safetensors_io`` reads
safetensors lazily through fsspec); ``build_hf_model`` puts the two together;
``export_hf_weights``/``to_hf_config`` go back. ``transformers`` is never imported: it is the
oracle the tests compare against, not a runtime dependency.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rayfleet.errors import SpecError
from rayfleet.models.hf.config_map import (SUPPORTED_ARCHITECTURES, HFModelSpec, from_hf_config,
                                           hf_architecture_for, to_hf_config)
from rayfleet.models.hf.tokenizer import HFTokenizer
from rayfleet.models.hf.weights import (DictSource, ShardFn, TensorSource, WeightRule, export_hf_weights,
                                        load_hf_weights, weight_rules)
from rayfleet.models.transformer import MoETransformer, build_model

__all__ = ["SUPPORTED_ARCHITECTURES", "HFModelSpec", "from_hf_config", "to_hf_config", "hf_architecture_for",
           "TensorSource", "DictSource", "ShardFn", "WeightRule", "weight_rules", "load_hf_weights",
           "export_hf_weights", "build_hf_model", "spec_for_export", "HFTokenizer"]


def build_hf_model(hf_config: Mapping[str, Any], source: TensorSource, *, dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> tuple[MoETransformer, HFModelSpec]:
    """A full (unsharded) rayfleet model holding the HF checkpoint's weights.

    Built on meta and allocated once: the checkpoint is the init, so no random init is spent.
    """
    spec = from_hf_config(hf_config)
    model = build_model(spec.config, device="meta", dtype=dtype)
    model.to_empty(device=device)
    for buf in model.buffers():
        buf.zero_()
    state = load_hf_weights(spec, source, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("expert_bias")]
    if missing or unexpected:
        raise SpecError("checkpoint", (missing or unexpected)[0], "does not match the model built from config.json",
                        "check the checkpoint's config.json")
    return model, spec


def spec_for_export(config: Any, *, hf_config: Mapping[str, Any] | None = None,
                    tie_word_embeddings: bool | None = None) -> HFModelSpec:
    """The export spec of a rayfleet model: its imported HF config when it has one."""
    base = dict(hf_config or {})
    arch = hf_architecture_for(config)
    tie = bool(base.get("tie_word_embeddings", False)) if tie_word_embeddings is None else tie_word_embeddings
    return HFModelSpec(architecture=arch, config=config, tie_word_embeddings=tie, hf_config=base)
