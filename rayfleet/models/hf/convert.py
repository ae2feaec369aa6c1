"""A Hugging Face folder's contents <-> a rayfleet servable's contents, in memory.

This is the logic of ``rayfleet model import|export``, kept apart from the bytes: ``storage``
reads an HF folder (``HFCheckpoint``: its config, tensors and side files) or a servable
(``load_servable``) and writes what this module returns (``save_servable``,
``write_hf_folder``). Models import nothing of ``storage`` (rule 1 of docs/architecture.md), so
the command (``rayfleet.cli.model``) and the demo wire the two; each wiring is a few calls.

- ``build_hf_model``: a full rayfleet model holding an HF checkpoint's weights (serving, tests).

- import: ``servable_from_hf`` keeps the rayfleet state dict, the ``MoEConfig``, the original
  ``config.json`` in the metadata and the tokenizer files as extra files, so that training and
  serving find everything in one place and export can go back.
- export: ``hf_folder_from_servable`` (a training run's final model, FP8 runs included: they
  save master weights) or ``hf_folder_from_state`` gives ``config.json``, the HF tensors,
  the tokenizer files and ``generation_config.json``. Tensors keep their dtype, so import ->
  export reproduces the original tensors bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig
from rayfleet.models.hf.config_map import HFModelSpec, from_hf_config, hf_architecture_for, to_hf_config
from rayfleet.models.hf.weights import TensorSource, export_hf_weights, load_hf_weights
from rayfleet.models.transformer import MoETransformer, build_model

__all__ = ["build_hf_model", "ServableContent", "HFFolderContent", "servable_from_hf", "spec_for_export", "hf_folder_from_state",
           "hf_folder_from_servable", "random_hf_folder"]


@dataclass(frozen=True)
class ServableContent:
    """What ``save_servable`` stores for an imported HF model (its ``config`` is ``spec.config``)."""

    spec: HFModelSpec
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    files: dict[str, bytes]

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.state_dict.values())


@dataclass(frozen=True)
class HFFolderContent:
    """An HF folder to write: tensors by HF name and small files, ``config.json`` among them (the
    writer puts it last, since its presence marks a usable folder)."""

    spec: HFModelSpec
    tensors: dict[str, torch.Tensor]
    files: dict[str, bytes]

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def servable_from_hf(*, hf_config: Mapping[str, Any], source: TensorSource, side_files: Mapping[str, bytes],
                     origin: str, dtype: torch.dtype | None = None) -> ServableContent:
    """The servable of the HF model ``hf_config`` whose tensors ``source`` reads.

    Tensors keep their dtype unless ``dtype`` is given; ``origin`` (the folder's URI) is recorded
    in the metadata. Raises ``SpecError`` for an architecture or config field rayfleet cannot run.
    """
    spec = from_hf_config(hf_config)
    state = load_hf_weights(spec, source, dtype=dtype)
    metadata = {"hf": {"architecture": spec.architecture, "config": dict(hf_config),
                       "tie_word_embeddings": spec.tie_word_embeddings}, "source": origin}
    return ServableContent(spec, state, metadata, dict(side_files))


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


def spec_for_export(config: MoEConfig, *, hf_config: Mapping[str, Any] | None = None,
                    tie_word_embeddings: bool | None = None) -> HFModelSpec:
    """The export spec of a rayfleet model: its imported HF config when it has one."""
    base = dict(hf_config or {})
    arch = hf_architecture_for(config)
    tie = bool(base.get("tie_word_embeddings", False)) if tie_word_embeddings is None else tie_word_embeddings
    return HFModelSpec(architecture=arch, config=config, tie_word_embeddings=tie, hf_config=base)


def _generation_config(hf_config: Mapping[str, Any]) -> bytes:
    fields = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None}
    return json.dumps({"_from_model_config": True, **fields}, indent=2).encode()


def hf_folder_from_state(*, spec: HFModelSpec, state_dict: Mapping[str, torch.Tensor],
                         files: Mapping[str, bytes]) -> HFFolderContent:
    """The HF folder of a rayfleet ``state_dict`` of ``spec``, with the side files ``files``.

    The embeddings stay tied only if they still are bit for bit; ``config.json`` records the
    tensors' dtype; a ``generation_config.json`` is made from the token ids when ``files`` lack one.
    """
    tensors, tied = export_hf_weights(spec, state_dict)
    spec = HFModelSpec(spec.architecture, spec.config, tied, spec.hf_config)
    config = to_hf_config(spec)
    config.setdefault("dtype", str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    out = dict(files)
    out.setdefault("generation_config.json", _generation_config(config))
    out["config.json"] = json.dumps(config, indent=2, sort_keys=True).encode()
    return HFFolderContent(spec, tensors, out)


def hf_folder_from_servable(*, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                            metadata: Mapping[str, Any], files: Mapping[str, bytes]) -> HFFolderContent:
    """The HF folder of a servable's parts (``load_servable``'s fields): written back as the HF
    architecture and ``config.json`` it was imported from, when it was."""
    hf = metadata.get("hf") or {}
    spec = spec_for_export(MoEConfig.from_dict(dict(config)), hf_config=hf.get("config"),
                           tie_word_embeddings=hf.get("tie_word_embeddings"))
    return hf_folder_from_state(spec=spec, state_dict=state_dict, files=files)


def random_hf_folder(hf_config: Mapping[str, Any], *, seed: int = 0,
                     files: Mapping[str, bytes] | None = None) -> HFFolderContent:
    """A randomly initialised model of ``hf_config`` as an HF folder (no download, no
    transformers): rayfleet's init from ``seed``, mapped like a trained model."""
    spec = from_hf_config(hf_config)
    tensors, _ = export_hf_weights(spec, build_model(spec.config, seed=seed).state_dict())
    side = {**(files or {}), "config.json": json.dumps(to_hf_config(spec), indent=2, sort_keys=True).encode()}
    return HFFolderContent(spec, tensors, side)
