"""Training from a Hugging Face model (``model: {hf: DIR_OR_URI}`` in a job spec).

- ``hf_config``: the job's ``MoEConfig`` from the folder's ``config.json`` (read once through
  fsspec), with training-only overrides (aux loss, capacity, balancing rate) from ``model.config``.
- ``load_hf_into``: after ``materialize`` and before FP8 conversion and parallelization (the
  trainer's fixed order), every rank copies the checkpoint's weights over the random init. The
  whole model is read per rank because parallelization then slices it (EP keeps its experts,
  FSDP/TP shard); ``rayfleet.models.hf.sharding`` reads only a rank's slice where a caller
  knows its layout up front (serving, the loading benchmark).
- ``hf_origin``: what the final servable must carry so that ``rayfleet model export`` writes the
  same architecture and tokenizer back (the original ``config.json`` and the tokenizer files).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig

__all__ = ["TRAINING_OVERRIDES", "hf_config", "load_hf_into", "hf_origin"]

# MoEConfig fields a job may change on an HF model: they affect training, not the checkpoint's shape.
TRAINING_OVERRIDES = frozenset({"aux_loss_coef", "capacity_factor", "router_bias_update_rate", "init_std"})


def hf_config(uri: str, overrides: dict[str, Any]) -> MoEConfig:
    from rayfleet.models.hf import from_hf_config
    from rayfleet.storage.safetensors_io import HFCheckpoint

    bad = sorted(set(overrides) - TRAINING_OVERRIDES)
    if bad:
        raise SpecError(f"model.config.{bad[0]}", overrides[bad[0]], "would change the shape of the HF model",
                        f"with model.hf only {sorted(TRAINING_OVERRIDES)} may be set")
    return from_hf_config(HFCheckpoint(uri).config).config.with_overrides(**overrides)


def load_hf_into(model: nn.Module, uri: str) -> None:
    """Copy the HF checkpoint at ``uri`` into ``model`` (materialized, not yet parallelized)."""
    from rayfleet.models.hf import from_hf_config, load_hf_weights
    from rayfleet.storage.safetensors_io import HFCheckpoint

    ckpt = HFCheckpoint(uri)
    state = load_hf_weights(from_hf_config(ckpt.config), ckpt)
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)  # keeps the model's dtype and device


def hf_origin(uri: str | None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(servable metadata, extra files) that record the HF model a run started from."""
    if uri is None:
        return {}, {}
    from rayfleet.models.hf import from_hf_config
    from rayfleet.storage.safetensors_io import HFCheckpoint

    ckpt = HFCheckpoint(uri)
    spec = from_hf_config(ckpt.config)
    files = ckpt.side_files()
    return {"hf": {"architecture": spec.architecture, "config": ckpt.config,
                   "tie_word_embeddings": spec.tie_word_embeddings}, "source": uri}, files
