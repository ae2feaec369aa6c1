"""Hugging Face checkpoint folders over fsspec: lazy, sliced safetensors reads and sharded writes.

Design decisions:
- The safetensors format is an 8-byte header length, a JSON header (name -> dtype, shape, byte
  offsets) and the raw tensors. We parse the header ourselves and read each tensor with one
  ranged read (``fs.cat_file(path, start, end)``), so a rank asks the filesystem or object
  store for exactly the bytes of its slice: rows ``[start, stop)`` of dim 0 are contiguous.
  A slice along another dim reads the tensor's whole span once and keeps the slice (peak: one
  tensor, not the checkpoint). ``safetensors.safe_open`` would mmap local files only; fsspec
  URIs (``s3://``, ``memory://``) are the point here.
- Writes use ``safetensors.torch.save`` (the reference serializer) into shards of at most
  ``max_shard_bytes`` plus ``model.safetensors.index.json``, as ``save_pretrained`` does; a
  single shard is ``model.safetensors`` with no index. Files are written before the index, and
  the index/config last, so a reader never sees an index naming a missing shard.
- This module imports nothing of rayfleet but ``errors`` (storage's rule): callers map names
  (``rayfleet.models.hf``) and pass plain tensors and bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import fsspec
import torch

from rayfleet.errors import SpecError

__all__ = ["SafetensorsFile", "HFCheckpoint", "write_safetensors_shards", "write_files", "write_hf_folder",
           "is_hf_folder", "INDEX_NAME", "SINGLE_NAME", "SIDE_FILES", "read_side_files"]

INDEX_NAME = "model.safetensors.index.json"
# Files of an HF folder that describe tokenization and generation; copied through unchanged.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")
SINGLE_NAME = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file; the header is read on open, tensors on demand."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        head = fs.cat_file(path, start=0, end=8)
        if len(head) < 8:
            raise SpecError("checkpoint", path, "is not a safetensors file (shorter than its header)",
                            "point at a folder written by save_pretrained or `rayfleet model export`")
        (size,) = struct.unpack("<Q", head)
        header = json.loads(fs.cat_file(path, start=8, end=8 + size))
        self.metadata: dict = header.pop("__metadata__", {}) or {}
        base = 8 + size
        self.entries: dict[str, _Entry] = {}
        for name, meta in header.items():
            if meta["dtype"] not in _DTYPES:
                raise SpecError("checkpoint", f"{path}:{name}", f"dtype {meta['dtype']} is not supported",
                                f"use one of {sorted(_DTYPES)}")
            begin, end = meta["data_offsets"]
            self.entries[name] = _Entry(_DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin, base + end)

    def get(self, name: str, *, dim: int = 0, start: int | None = None, stop: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name``, or its ``[start, stop)`` slice along ``dim`` (only those bytes for dim 0).

        ``out``: a contiguous tensor of the slice's shape and dtype to read into (no extra copy).
        """
        e = self.entries[name]
        lo, hi = (0, e.shape[dim] if e.shape else 0) if start is None and stop is None else (
            start or 0, e.shape[dim] if stop is None else stop)
        if e.shape and not 0 <= lo <= hi <= e.shape[dim]:
            raise SpecError("shard", (name, dim, lo, hi), f"outside the tensor's shape {e.shape}",
                            "check the parallel plan against the model's dimensions")
        if dim == 0 or not e.shape or (lo, hi) == (0, e.shape[dim]):
            row = (e.end - e.begin) // max(e.shape[0], 1) if e.shape else 0
            begin, end = (e.begin + lo * row, e.begin + hi * row) if e.shape else (e.begin, e.end)
            shape = (hi - lo, *e.shape[1:]) if e.shape else ()
            return self._read(e, begin, end, shape, out)
        return _copy_out(self._read(e, e.begin, e.end, e.shape, None).narrow(dim, lo, hi - lo), out)

    def _read(self, e: _Entry, begin: int, end: int, shape: tuple[int, ...],
              out: torch.Tensor | None) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=e.dtype) if out is None else out
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != e.dtype or not tensor.is_contiguous():
            return _copy_out(self._read(e, begin, end, shape, None), out)
        if begin == end:
            return tensor
        # Read straight into the tensor's memory: one copy from the file, none in Python.
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        with self.fs.open(self.path, "rb") as f:
            f.seek(begin)
            done = 0
            while done < end - begin:
                n = f.readinto(view[done:])
                if not n:
                    raise SpecError("checkpoint", self.path, "ends before its header says",
                                    "the file is truncated: copy or export it again")
                done += n
        return tensor


def _copy_out(tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return tensor.clone() if not tensor.is_contiguous() else tensor
    out.copy_(tensor)
    return out


class HFCheckpoint:
    """A Hugging Face model folder (local path or fsspec URI) as a lazy ``TensorSource``.

    ``config`` is ``config.json``; tensors come from ``model.safetensors`` or the shards named
    by ``model.safetensors.index.json``. Shard headers are read when first needed.
    """

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.path = fsspec.core.url_to_fs(uri)
        config_path = _join(self.path, "config.json")
        if not self.fs.exists(config_path):
            raise SpecError("model.hf", uri, "no config.json there",
                            "point at a Hugging Face model folder (save_pretrained output)")
        self.config: dict = json.loads(self.fs.cat_file(config_path))
        self._files: dict[str, SafetensorsFile] = {}
        index_path = _join(self.path, INDEX_NAME)
        if self.fs.exists(index_path):
            self.weight_map: dict[str, str] = json.loads(self.fs.cat_file(index_path))["weight_map"]
        elif self.fs.exists(_join(self.path, SINGLE_NAME)):
            self.weight_map = {name: SINGLE_NAME for name in self._file(SINGLE_NAME).entries}
        else:
            raise SpecError("model.hf", uri, "no safetensors weights there (model.safetensors or its index)",
                            "save the model with safe_serialization (the default of save_pretrained)")

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.fs, _join(self.path, name))
        return self._files[name]

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.weight_map[name]).entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._file(self.weight_map[name]).entries[name].dtype

    def get(self, name: str, *, dim: int = 0, start: int | None = None, stop: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        if name not in self.weight_map:
            raise SpecError("checkpoint", name, f"no such tensor in {self.uri}", "check the model's config.json")
        return self._file(self.weight_map[name]).get(name, dim=dim, start=start, stop=stop, out=out)

    def side_files(self) -> dict[str, bytes]:
        """The tokenizer/generation files present (``SIDE_FILES``), name -> bytes."""
        return read_side_files(self.uri)

    def read_file(self, name: str) -> bytes | None:
        """Bytes of a side file (tokenizer.json, generation_config.json ...), None when absent."""
        path = _join(self.path, name)
        return self.fs.cat_file(path) if self.fs.exists(path) else None


def read_side_files(uri: str) -> dict[str, bytes]:
    """The ``SIDE_FILES`` (tokenizer, generation config ...) present in the folder ``uri``."""
    fs, path = fsspec.core.url_to_fs(uri)
    found = {}
    for name in SIDE_FILES:
        full = _join(path, name)
        if fs.exists(full):
            found[name] = fs.cat_file(full)
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors_shards(uri: str, tensors: Mapping[str, torch.Tensor], *,
                             max_shard_bytes: int = 1 << 30) -> list[str]:
    """Write ``tensors`` (in their order) as shards plus index under ``uri``; returns file names."""
    from safetensors.torch import save

    if max_shard_bytes <= 0:
        raise SpecError("max_shard_bytes", max_shard_bytes, "must be positive", "pass e.g. 1 GiB")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().cpu().contiguous()
        size += _nbytes(t)
    count = len(shards)
    names = [SINGLE_NAME] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(path, exist_ok=True)
    for name, shard in zip(names, shards):
        with fs.open(_join(path, name), "wb") as f:
            f.write(save(shard, metadata={"format": "pt"}))
    if count > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        with fs.open(_join(path, INDEX_NAME), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True))
    return names


def write_files(uri: str, files: Mapping[str, bytes | str]) -> None:
    """Write small side files (config.json, tokenizer files ...) under ``uri``."""
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(path, exist_ok=True)
    for name, data in files.items():
        with fs.open(_join(path, name), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def is_hf_folder(uri: str) -> bool:
    """Whether ``uri`` holds a Hugging Face folder (its ``config.json``, written last, is there)."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(_join(path, "config.json"))


def write_hf_folder(uri: str, *, tensors: Mapping[str, torch.Tensor], files: Mapping[str, bytes | str],
                    max_shard_bytes: int = 1 << 30) -> list[str]:
    """Write an HF folder under ``uri``: ``tensors`` as safetensors shards (plus index), then the
    small ``files``, ``config.json`` last, since its presence is what marks a usable folder
    (``is_hf_folder``). Returns the names of the shards and files written (not the index)."""
    names = write_safetensors_shards(uri, tensors, max_shard_bytes=max_shard_bytes)
    others = {name: data for name, data in files.items() if name != "config.json"}
    write_files(uri, others)
    if "config.json" in files:
        write_files(uri, {"config.json": files["config.json"]})
    return [*names, *others, *(["config.json"] if "config.json" in files else [])]
