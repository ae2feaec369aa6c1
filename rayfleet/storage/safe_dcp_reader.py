"""Reading a DCP checkpoint's ``.metadata`` without unpickling arbitrary objects.

Design decisions:
- torch's DCP writes its ``.metadata`` with ``pickle`` and its reader loads it with a plain
  ``pickle.load``, which runs whatever a crafted file names: a checkpoint would be code. Our
  reader subclasses torch's ``FsspecReader`` and unpickles with an allowlist: the classes of
  ``torch.distributed.checkpoint.metadata``, DCP's ``_StorageInfo``, ``torch.Size``, dtypes and
  the layout helper torch pickles. Anything else is refused (``UnpicklingError``) before any
  object is built. Tensor data itself is read by DCP with ``torch.load(weights_only=True)``.
- Kept apart from ``checkpoint`` so that the allowlist is one small reviewed place; it tracks
  what torch 2.13 writes (see the test that saves and reads a real checkpoint).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["SafeFsspecReader", "safe_load_metadata"]

_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not DCP metadata; "
                                     "refusing to load it (a checkpoint is data, not code)")


def safe_load_metadata(stream: Any) -> Metadata:
    """Unpickle DCP metadata from ``stream`` with the allowlist; raises ``UnpicklingError``."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFsspecReader(FsspecReader):
    """``FsspecReader`` whose ``read_metadata`` uses ``safe_load_metadata`` (module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_load_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
