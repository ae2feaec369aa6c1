"""Loading a served model and its ``LLMEngine``: a preset, a training servable, or a Hugging Face folder.

Design decisions:
- Apart from the engine's runtime (``async_engine``): a replica loads once, while the runtime
  runs for its whole life; tests build engines from presets without either.
- ``kv_tiers`` is the engine's ``kv_connector.KVTierHooks`` (``kv.tier_connector`` implements
  it), passed in by whoever builds the replica, so the engine room never imports ``kv/``.
"""

from __future__ import annotations

from typing import Any

import torch

from rayfleet.serving.engine.kv_connector import KVTierHooks
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine

__all__ = ["load_engine", "replica_device"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_engine(*, preset_name: str | None, seed: int, checkpoint: str | None, dtype: str,
                overrides: dict[str, Any], config: EngineConfig, kv_tiers: KVTierHooks | None = None,
                hf: str | None = None, device: str | None = None) -> LLMEngine:
    """Build the served model (a preset from ``seed``, a training servable, or a Hugging Face
    folder/URI ``hf`` with its own tokenizer) and its engine (``kv_tiers``: an optional
    ``KVTierHooks``) on ``device``: by default the replica's accelerator (``replica_device``),
    so every caller (Serve replicas, in-process serving, tests) serves on the GPU a node has;
    pass ``"cpu"`` (or ``"cuda:1"``) to override."""
    from rayfleet.models import build_model, preset

    torch_dtype = _DTYPES[dtype]
    device = device or replica_device()
    if hf:
        return _load_hf_engine(hf, dtype=torch_dtype, config=config, kv_tiers=kv_tiers, device=device)
    if checkpoint:
        from rayfleet.storage.model_registry import load_servable

        servable = load_servable(checkpoint)
        model = build_model(servable.config, seed=seed, dtype=torch_dtype)
        model.load_state_dict({k: v.to(torch_dtype) if v.is_floating_point() and "expert_bias" not in k else v
                               for k, v in servable.state_dict.items()})
        model = model.to(device)
    else:
        model = build_model(preset(preset_name or "tiny", **overrides), seed=seed, dtype=torch_dtype, device=device)
    return LLMEngine(model, config, kv_tiers=kv_tiers)


def replica_device() -> str:
    """Where a replica's engine runs: the first accelerator this process may use, ``"cuda:0"``
    (Ray sets ``CUDA_VISIBLE_DEVICES`` to the replica's own GPU, so index 0 is it), else ``"cpu"``."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _load_hf_engine(uri: str, *, dtype: torch.dtype, config: EngineConfig,
                     kv_tiers: KVTierHooks | None, device: str) -> LLMEngine:
    """An HF model through the import path (``build_hf_model`` over the lazy safetensors reader;
    unsupported config fields are refused there, by name) with the folder's tokenizer. Sampling
    is limited to the tokenizer's ids (the embedding table may be padded past them) and EOS is
    ``generation_config.json``'s, else the tokenizer's, else ``config.json``'s."""
    import json
    from dataclasses import replace

    from rayfleet.models.hf import HFTokenizer, build_hf_model
    from rayfleet.storage.safetensors_io import HFCheckpoint

    ckpt = HFCheckpoint(uri)
    model, _ = build_hf_model(ckpt.config, ckpt, dtype=dtype)
    model = model.to(device)
    tokenizer = HFTokenizer.from_files(ckpt.side_files(), name=f"hf:{uri.rstrip('/').rsplit('/', 1)[-1]}")
    raw = ckpt.read_file("generation_config.json")
    eos = json.loads(raw).get("eos_token_id") if raw else None
    if eos is None:
        eos = tokenizer.eos_id if tokenizer.eos_id is not None else ckpt.config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    vocab_limit = min(tokenizer.vocab_size, model.config.vocab_size)
    return LLMEngine(model, replace(config, vocab_limit=vocab_limit), tokenizer=tokenizer, kv_tiers=kv_tiers,
                     eos_token_ids=eos_ids)
