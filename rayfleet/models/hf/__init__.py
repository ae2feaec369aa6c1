"""Hugging Face models in and out: config mapping, weight names, tokenizers (no I/O here).

``from_hf_config`` maps a ``config.json`` dict onto ``MoEConfig``; ``load_hf_weights`` reads a
rank's slice of each tensor from a ``TensorSource`` (``rayfleet.storage.safetensors_io`` reads
safetensors lazily through fsspec); ``build_hf_model`` puts the two together;
``export_hf_weights``/``to_hf_config`` go back; ``convert`` turns a whole folder's contents into a
servable's and back (``rayfleet model import|export``). ``transformers`` is never imported: it is the
oracle the tests compare against, not a runtime dependency.
"""

from __future__ import annotations

from rayfleet.models.hf.config_map import (SUPPORTED_ARCHITECTURES, HFModelSpec, from_hf_config,
                                           hf_architecture_for, to_hf_config)
from rayfleet.models.hf.convert import (HFFolderContent, ServableContent, build_hf_model, hf_folder_from_servable,
                                        hf_folder_from_state, random_hf_folder, servable_from_hf, spec_for_export)
from rayfleet.models.hf.tokenizer import HFTokenizer
from rayfleet.models.hf.weights import (DictSource, ShardFn, TensorSource, WeightRule, export_hf_weights,
                                        load_hf_weights, weight_rules)

__all__ = ["SUPPORTED_ARCHITECTURES", "HFModelSpec", "from_hf_config", "to_hf_config", "hf_architecture_for",
           "TensorSource", "DictSource", "ShardFn", "WeightRule", "weight_rules", "load_hf_weights",
           "export_hf_weights", "build_hf_model", "spec_for_export", "HFTokenizer", "ServableContent",
           "HFFolderContent", "servable_from_hf", "hf_folder_from_state", "hf_folder_from_servable",
           "random_hf_folder"]
