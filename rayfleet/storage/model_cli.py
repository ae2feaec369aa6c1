"""``rayfleet model import|export|inspect``: Hugging Face folders in, rayfleet servables out, and back.

Registered by ``rayfleet.cli``; heavy imports (torch, fsspec) happen in the handlers so that
``rayfleet model --help`` stays fast. Like every ``*cli.py`` this is a user-facing edge, so it may wire
``rayfleet.models`` (name and config mapping, pure) to ``rayfleet.storage`` (bytes through fsspec);
the rest of ``storage`` imports nothing of rayfleet but ``errors``.

- import: an HF folder/URI -> a servable (``model_registry``): the rayfleet state dict, the
  ``MoEConfig`` fields, the original ``config.json`` in the metadata and the tokenizer files as
  extra files, so that training and serving find everything in one place and export can go back.
- export: a servable (a training run's final model, FP8 runs included: they save master
  weights) or an HF folder -> an HF folder: ``config.json``, sharded safetensors + index,
  tokenizer files, ``generation_config.json``. Tensors keep their dtype, so import -> export
  reproduces the original tensors bit for bit.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rayfleet.errors import SpecError

if TYPE_CHECKING:
    import torch

__all__ = ["register", "import_hf_model", "export_hf_model", "create_random_hf_model", "ModelTransfer"]



@dataclass(frozen=True)
class ModelTransfer:
    """What an import or export did (printed by the CLI, returned to callers)."""

    source: str
    dest: str
    architecture: str
    num_tensors: int
    num_params: int
    files: tuple[str, ...]
    seconds: float


def _is_servable(uri: str) -> bool:
    from rayfleet.storage.model_registry import servable_exists

    return servable_exists(uri)


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    table = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise SpecError("--dtype", name, "unknown dtype", f"use one of {sorted(k for k in table if k)}")
    return table[name]


def import_hf_model(source: str, out: str, *, dtype: str | None = None) -> ModelTransfer:
    """Convert the HF folder ``source`` into a servable at ``out`` (tensors keep their dtype
    unless ``dtype`` is given)."""
    from rayfleet.models.hf import from_hf_config, load_hf_weights
    from rayfleet.storage.model_registry import save_servable
    from rayfleet.storage.safetensors_io import HFCheckpoint

    start = time.perf_counter()
    ckpt = HFCheckpoint(source)
    spec = from_hf_config(ckpt.config)
    state = load_hf_weights(spec, ckpt, dtype=_dtype(dtype))
    files = ckpt.side_files()
    metadata = {"hf": {"architecture": spec.architecture, "config": ckpt.config,
                       "tie_word_embeddings": spec.tie_word_embeddings}, "source": source}
    save_servable(out, config=spec.config, state_dict=state, metadata=metadata, extra_files=files)
    return ModelTransfer(source, out, spec.architecture, len(state), sum(t.numel() for t in state.values()),
                         tuple(sorted(files)), time.perf_counter() - start)


def _load_for_export(source: str) -> tuple[Any, dict[str, torch.Tensor], dict[str, bytes]]:
    """(export spec, rayfleet state dict, side files) of a servable or an HF folder."""
    import fsspec

    from rayfleet.models import MoEConfig
    from rayfleet.models.hf import from_hf_config, load_hf_weights, spec_for_export
    from rayfleet.storage.model_registry import load_servable
    from rayfleet.storage.safetensors_io import HFCheckpoint

    if _is_servable(source):
        servable = load_servable(source)
        hf = servable.metadata.get("hf") or {}
        spec = spec_for_export(MoEConfig.from_dict(servable.config), hf_config=hf.get("config"),
                               tie_word_embeddings=hf.get("tie_word_embeddings"))
        return spec, servable.state_dict, dict(servable.files)
    fs, path = fsspec.core.url_to_fs(source)
    if fs.exists(path.rstrip("/") + "/config.json"):
        ckpt = HFCheckpoint(source)
        spec = from_hf_config(ckpt.config)
        files = ckpt.side_files()
        return spec, load_hf_weights(spec, ckpt), files
    raise SpecError("RUN_OR_CHECKPOINT", source,
                    "is neither a rayfleet servable (a run's output.uri, with manifest.json) nor an HF folder",
                    "pass the training job's output.uri, a `rayfleet model import` result, or an HF folder")


def _generation_config(hf_config: dict[str, Any]) -> bytes:
    fields = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None}
    return json.dumps({"_from_model_config": True, **fields}, indent=2).encode()


def export_hf_model(source: str, out: str, *, max_shard_bytes: int = 1 << 30) -> ModelTransfer:
    """Write ``source`` (servable or HF folder) as an HF folder at ``out``."""
    from rayfleet.models.hf import HFModelSpec, export_hf_weights, to_hf_config
    from rayfleet.storage.safetensors_io import write_files, write_safetensors_shards

    start = time.perf_counter()
    spec, state, files = _load_for_export(source)
    tensors, tied = export_hf_weights(spec, state)
    spec = HFModelSpec(spec.architecture, spec.config, tied, spec.hf_config)
    config = to_hf_config(spec)
    config.setdefault("dtype", str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    names = write_safetensors_shards(out, tensors, max_shard_bytes=max_shard_bytes)
    files.setdefault("generation_config.json", _generation_config(config))
    files["config.json"] = json.dumps(config, indent=2, sort_keys=True).encode()
    write_files(out, files)  # config.json last among the small files: it marks a usable folder
    return ModelTransfer(source, out, spec.architecture, len(tensors), sum(t.numel() for t in tensors.values()),
                         tuple(sorted([*names, *files])), time.perf_counter() - start)


def create_random_hf_model(out: str, hf_config: dict[str, Any], *, seed: int = 0,
                           files: dict[str, bytes] | None = None) -> ModelTransfer:
    """Write a randomly initialised model of ``hf_config`` as an HF folder (no download, no
    transformers): rayfleet's init from ``seed``, exported like a trained model."""
    from rayfleet.models import build_model
    from rayfleet.models.hf import export_hf_weights, from_hf_config, to_hf_config
    from rayfleet.storage.safetensors_io import write_files, write_safetensors_shards

    start = time.perf_counter()
    spec = from_hf_config(hf_config)
    tensors, _ = export_hf_weights(spec, build_model(spec.config, seed=seed).state_dict())
    names = write_safetensors_shards(out, tensors)
    side = {**(files or {}), "config.json": json.dumps(to_hf_config(spec), indent=2, sort_keys=True).encode()}
    write_files(out, side)
    return ModelTransfer("random", out, spec.architecture, len(tensors), sum(t.numel() for t in tensors.values()),
                         tuple(sorted([*names, *side])), time.perf_counter() - start)


def _inspect(args: argparse.Namespace) -> int:
    from rayfleet.models.hf import from_hf_config
    from rayfleet.storage.safetensors_io import HFCheckpoint

    spec = from_hf_config(HFCheckpoint(args.source).config)
    print(json.dumps({"architecture": spec.architecture, "tie_word_embeddings": spec.tie_word_embeddings,
                      "params": asdict(spec.config.num_params()), "config": asdict(spec.config)}, indent=2))
    return 0


def _report(what: str, t: ModelTransfer) -> int:
    print(f"{what} {t.architecture}: {t.num_tensors} tensors, {t.num_params:,} parameters, "
          f"{t.source} -> {t.dest} in {t.seconds:.1f}s ({', '.join(t.files)})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="import/export Hugging Face models")
    commands = model.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    imp = commands.add_parser("import", help="HF folder or URI -> rayfleet servable",
                              description="Convert a Hugging Face model folder (config.json + safetensors + "
                                          "tokenizer files; local path or fsspec URI) into a rayfleet servable.")
    imp.add_argument("source", metavar="HF_DIR_OR_URI")
    imp.add_argument("--out", required=True, metavar="URI", help="servable folder to write")
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)")
    imp.set_defaults(func=lambda a: _report("imported", import_hf_model(a.source, a.out, dtype=a.dtype)))
    exp = commands.add_parser("export", help="servable / run output / HF folder -> HF folder",
                              description="Write a Hugging Face folder (config.json, sharded safetensors with "
                                          "index, tokenizer files, generation_config.json) that "
                                          "AutoModelForCausalLM.from_pretrained loads.")
    exp.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                     help="a training job's output.uri, a `model import` result, or an HF folder")
    exp.add_argument("--out", required=True, metavar="DIR_OR_URI")
    exp.add_argument("--max-shard-mib", type=int, default=1024, metavar="N",
                     help="largest safetensors shard in MiB (default 1024)")
    exp.set_defaults(func=lambda a: _report("exported", export_hf_model(
        a.source, a.out, max_shard_bytes=a.max_shard_mib << 20)))
    ins = commands.add_parser("inspect", help="how rayfleet maps an HF folder (or why it refuses it)")
    ins.add_argument("source", metavar="HF_DIR_OR_URI")
    ins.set_defaults(func=_inspect)
