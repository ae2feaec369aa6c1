"""``rayfleet model import|export|inspect``: Hugging Face folders in, rayfleet servables out, and back.

Registered by ``rayfleet.cli.entry``; heavy imports (torch, fsspec) happen in the handlers so that
``rayfleet model --help`` stays fast. The mapping is ``rayfleet.models.hf.convert`` (pure) and the
bytes are ``rayfleet.storage`` (``HFCheckpoint``, ``save_servable``/``load_servable``,
``write_hf_folder``); the functions here only wire the two together, which no module inside an
area may do (``models`` and ``storage`` import neither each other), and time the result.
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

    from rayfleet.models.hf import HFFolderContent

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


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    table = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise SpecError("--dtype", name, "unknown dtype", f"use one of {sorted(k for k in table if k)}")
    return table[name]


def import_hf_model(source: str, out: str, *, dtype: str | None = None) -> ModelTransfer:
    """Convert the HF folder ``source`` into a servable at ``out`` (tensors keep their dtype
    unless ``dtype`` is given)."""
    from rayfleet.models.hf import servable_from_hf
    from rayfleet.storage.model_registry import save_servable
    from rayfleet.storage.safetensors_io import HFCheckpoint

    start = time.perf_counter()
    ckpt = HFCheckpoint(source)
    servable = servable_from_hf(hf_config=ckpt.config, source=ckpt, side_files=ckpt.side_files(), origin=source,
                                dtype=_dtype(dtype))
    save_servable(out, config=servable.spec.config, state_dict=servable.state_dict, metadata=servable.metadata,
                  extra_files=servable.files)
    return ModelTransfer(source, out, servable.spec.architecture, len(servable.state_dict), servable.num_params,
                         tuple(sorted(servable.files)), time.perf_counter() - start)


def _hf_folder_of(source: str) -> HFFolderContent:
    """The HF folder contents of a servable or of an HF folder (re-sharded, config normalised)."""
    from rayfleet.models.hf import from_hf_config, hf_folder_from_servable, hf_folder_from_state, load_hf_weights
    from rayfleet.storage.model_registry import load_servable, servable_exists
    from rayfleet.storage.safetensors_io import HFCheckpoint, is_hf_folder

    if servable_exists(source):
        servable = load_servable(source)
        return hf_folder_from_servable(config=servable.config, state_dict=servable.state_dict,
                                       metadata=servable.metadata, files=servable.files)
    if is_hf_folder(source):
        ckpt = HFCheckpoint(source)
        spec = from_hf_config(ckpt.config)
        return hf_folder_from_state(spec=spec, state_dict=load_hf_weights(spec, ckpt), files=ckpt.side_files())
    raise SpecError("RUN_OR_CHECKPOINT", source,
                    "is neither a rayfleet servable (a run's output.uri, with manifest.json) nor an HF folder",
                    "pass the training job's output.uri, a `rayfleet model import` result, or an HF folder")


def export_hf_model(source: str, out: str, *, max_shard_bytes: int = 1 << 30) -> ModelTransfer:
    """Write ``source`` (servable or HF folder) as an HF folder at ``out``."""
    from rayfleet.storage.safetensors_io import write_hf_folder

    start = time.perf_counter()
    folder = _hf_folder_of(source)
    names = write_hf_folder(out, tensors=folder.tensors, files=folder.files, max_shard_bytes=max_shard_bytes)
    return ModelTransfer(source, out, folder.spec.architecture, len(folder.tensors), folder.num_params,
                         tuple(sorted(names)), time.perf_counter() - start)


def create_random_hf_model(out: str, hf_config: dict[str, Any], *, seed: int = 0,
                           files: dict[str, bytes] | None = None) -> ModelTransfer:
    """Write a randomly initialised model of ``hf_config`` as an HF folder (no download, no
    transformers): rayfleet's init from ``seed``, exported like a trained model."""
    from rayfleet.models.hf import random_hf_folder
    from rayfleet.storage.safetensors_io import write_hf_folder

    start = time.perf_counter()
    folder = random_hf_folder(hf_config, seed=seed, files=files)
    names = write_hf_folder(out, tensors=folder.tensors, files=folder.files)
    return ModelTransfer("random", out, folder.spec.architecture, len(folder.tensors), folder.num_params,
                         tuple(sorted(names)), time.perf_counter() - start)


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
    """Add ``rayfleet model {import,export,inspect}``."""
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
