"""Model registry: a trained model's weights as one servable artifact at an fsspec URI.

Design decisions:
- A servable is a directory: ``config.json`` (the ``MoEConfig`` fields), ``weights.pt`` (a
  full, unsharded CPU state dict) and ``manifest.json`` written *last* with the size and
  SHA-256 of each file. A directory without a manifest is not a servable (a crash mid-write
  never produces something a server would load), and a manifest whose checksums disagree
  with the files is refused with a clear error.
- Full (gathered) weights, not the training checkpoint's shards: serving replicas load a
  model in one read, and they run a different parallel layout from training anyway. The
  sharded, reshardable training checkpoint lives in ``rayfleet.storage.checkpoint``.
- ``torch.save``/``torch.load(weights_only=True)`` keeps the file format plain and safe to
  load (no pickled code).
- The config travels as a plain dict (``dataclasses.asdict`` of whatever config dataclass the
  caller passes): storage imports nothing of rayfleet but ``errors``, and ``build_model``
  accepts the dict. Extra files (tokenizer files, the Hugging Face config a model was imported
  from) are stored beside the weights under the same manifest and checksums.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
import time
from dataclasses import dataclass

import fsspec
import torch

from rayfleet.errors import SpecError

__all__ = ["Servable", "save_servable", "load_servable", "servable_exists"]

_MANIFEST = "manifest.json"
_CONFIG = "config.json"
_WEIGHTS = "weights.pt"
FORMAT = "rayfleet-servable/1"


@dataclass(frozen=True)
class Servable:
    """A loaded servable: its config fields, its full state dict, the metadata it was saved
    with, and its extra files (name -> bytes)."""

    config: dict
    state_dict: dict[str, torch.Tensor]
    metadata: dict
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save_servable(uri: str, *, config: object, state_dict: dict[str, torch.Tensor],
                  metadata: dict | None = None, extra_files: dict[str, bytes] | None = None) -> str:
    """Write ``config`` (a dataclass or a dict) and ``state_dict`` (full tensors; moved to CPU)
    to ``uri``, plus ``extra_files``; returns ``uri``.

    Overwrites an existing servable at ``uri``: the old manifest is removed first, so a reader
    never pairs an old manifest with new files.
    """
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(path, exist_ok=True)
    manifest_path = _join(path, _MANIFEST)
    if fs.exists(manifest_path):
        fs.rm(manifest_path)
    buffer = io.BytesIO()
    torch.save({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}, buffer)
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)  # type: ignore[arg-type]
    for name in extra_files or {}:
        if name in (_CONFIG, _WEIGHTS, _MANIFEST) or "/" in name:
            raise SpecError("extra_files", name, "collides with the servable's own files or is a path",
                            "use a plain file name such as tokenizer.json")
    files = {
        _CONFIG: json.dumps(fields, indent=1, sort_keys=True).encode(),
        _WEIGHTS: buffer.getvalue(),
        **(extra_files or {}),
    }
    for name, data in files.items():
        with fs.open(_join(path, name), "wb") as f:
            f.write(data)
    manifest = {
        "format": FORMAT,
        "created_unix_s": time.time(),
        "files": {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in files.items()},
        "metadata": metadata or {},
    }
    with fs.open(manifest_path, "wb") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
    return uri


def servable_exists(uri: str) -> bool:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(_join(path, _MANIFEST))


def load_servable(uri: str) -> Servable:
    """Read and verify a servable. Raises ``SpecError`` naming ``uri`` when it is missing,
    incomplete, or corrupt."""
    fs, path = fsspec.core.url_to_fs(uri)
    manifest_path = _join(path, _MANIFEST)
    if not fs.exists(manifest_path):
        raise SpecError("checkpoint", uri, f"no servable model there (no {_MANIFEST})",
                        "point it at a directory written by training (its final model) or by "
                        "rayfleet.storage.model_registry.save_servable")
    with fs.open(manifest_path, "rb") as f:
        manifest = json.loads(f.read())
    if manifest.get("format") != FORMAT:
        raise SpecError("checkpoint", uri, f"format {manifest.get('format')!r} is not {FORMAT!r}",
                        "re-export the model with this version of rayfleet")
    blobs: dict[str, bytes] = {}
    for name, meta in manifest["files"].items():
        with fs.open(_join(path, name), "rb") as f:
            data = f.read()
        if len(data) != meta["bytes"] or _sha256(data) != meta["sha256"]:
            raise SpecError("checkpoint", uri, f"{name} does not match its manifest checksum",
                            "the copy is corrupt or was modified; export the model again")
        blobs[name] = data
    config = json.loads(blobs.pop(_CONFIG))
    try:  # weights_only: tensors and plain containers, never a pickled object or code
        state_dict = torch.load(io.BytesIO(blobs.pop(_WEIGHTS)), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise SpecError("checkpoint", uri, f"{_WEIGHTS} holds more than tensors ({str(exc).splitlines()[0][:200]})",
                        "export the weights as a plain state dict of tensors (save_servable does)") from None
    return Servable(config=config, state_dict=state_dict, metadata=manifest.get("metadata", {}), files=blobs)
