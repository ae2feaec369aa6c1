"""Token datasets: tokenized Parquet shards plus a JSON manifest, written and read via fsspec.

Design decisions:
- Layout under one URI (local path, ``memory://``, ``s3://`` ... anything fsspec opens):
  ``shard-00000.parquet`` ... and ``manifest.json``. Each shard has one column ``tokens``
  (``list<uint16>``), one row per ``seq_len`` window of the document stream
  (``BOS doc EOS BOS doc EOS ...``; the last row of the last shard may be shorter). Readers
  that want a different training length concatenate rows and cut again.
- The manifest is written last: on object stores (no atomic directory rename) its presence is
  what marks a dataset complete, and readers refuse a URI without one.
- The manifest records the tokenizer (its ``to_dict()``), per-shard token counts and the
  sources, so a trainer can check vocabulary and size without opening shards.
- The tokenizer is passed in (anything with ``encode(text, add_bos=, add_eos=)``, ``to_dict()``
  and ``vocab_size``: ``rayfleet.models.ByteTokenizer`` or a Hugging Face ``HFTokenizer``);
  storage imports nothing of rayfleet but ``errors``. Without one, ``ByteCodec`` writes the
  byte tokenizer's format (UTF-8 bytes, BOS 256, EOS 257; a unit test holds it equal to
  ``ByteTokenizer``) so that the zero-download default needs no model code.
- ``CharCodec`` is a character-level vocabulary (nanoGPT's ``shakespeare_char``): the sorted set
  of characters a corpus uses, no BOS/EOS, the characters stored in ``to_dict()`` so any reader
  can decode without this module. Used by ``rayfleet.storage.shakespeare``.
- The manifest's ``metadata`` (free-form JSON: provenance, licence, split) travels with the
  dataset; manifests written before it existed read back with ``{}``.
- Tokens are ``uint16`` while the vocabulary fits (bytes, small BPEs) and ``uint32`` beyond
  (Llama-3 / Qwen vocabularies); readers return the stored width.
- pyarrow for Parquet and fsspec for I/O rather than a custom format: any worker of the fleet
  reads shards with the same two libraries the checkpoint store uses.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterator, Sequence
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayfleet.errors import SpecError

__all__ = [
    "MANIFEST_NAME", "TOKEN_FORMAT", "TokenShard", "TokenManifest", "find_text_files",
    "prepare_token_dataset", "read_manifest", "read_shard_tokens", "load_tokens",
    "default_text_sources", "TextTokenizer", "ByteCodec", "CharCodec", "count_byte_tokens", "count_token_shards",
    "write_token_dataset",
]

MANIFEST_NAME = "manifest.json"
TOKEN_FORMAT = "rayfleet-tokens/1"
_TOKEN_TYPE = pa.list_(pa.uint16())
_WIDE_TOKEN_TYPE = pa.list_(pa.uint32())
_SHARD_NAME = "shard-{index:05d}.parquet"
_SHARD_GLOB = "shard-*.parquet"


class TextTokenizer(Protocol):
    """What ``prepare_token_dataset`` needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def to_dict(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class ByteCodec:
    """The byte tokenizer's format without its class: ids 0..255 are UTF-8 bytes, then BOS, EOS, PAD."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    name: str = "byte"

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str | bytes, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8") if isinstance(text, str) else bytes(text))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}


@dataclass(frozen=True)
class CharCodec:
    """A character-level vocabulary: id ``i`` is ``chars[i]`` (sorted, unique); no BOS/EOS/PAD.

    ``add_bos``/``add_eos`` are refused rather than ignored: a character corpus is one stream.
    """

    chars: str
    name: str = "char"

    def __post_init__(self) -> None:
        if not self.chars or "".join(sorted(set(self.chars))) != self.chars:
            raise ValueError("CharCodec.chars must be the sorted, unique characters of a corpus")

    @classmethod
    def for_text(cls, text: str) -> "CharCodec":
        """The vocabulary of every character ``text`` uses."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        if add_bos or add_eos:
            raise ValueError("a character vocabulary has no BOS/EOS tokens")
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise SpecError("text", "".join(unknown[:10]), "holds characters outside the vocabulary",
                            "build the CharCodec from the whole corpus (CharCodec.for_text)")
        return [index[c] for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "vocab_size": self.vocab_size, "chars": self.chars}


@dataclass(frozen=True)
class TokenShard:
    path: str  # relative to the dataset URI
    num_tokens: int
    num_rows: int


@dataclass(frozen=True)
class TokenManifest:
    format: str
    tokenizer: dict
    seq_len: int
    num_tokens: int
    num_documents: int
    shards: tuple[TokenShard, ...]
    sources: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)  # provenance, licence, split ...

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "TokenManifest":
        raw = json.loads(text)
        return cls(format=raw["format"], tokenizer=raw["tokenizer"], seq_len=raw["seq_len"],
                   num_tokens=raw["num_tokens"], num_documents=raw["num_documents"],
                   shards=tuple(TokenShard(**s) for s in raw["shards"]),
                   sources=tuple(raw["sources"]), metadata=dict(raw.get("metadata") or {}))


def find_text_files(sources: Sequence[str], *, glob: str = "*.py") -> list[str]:
    """Files named by ``sources`` (files as given; directories searched recursively for ``glob``).

    Returned as fsspec URLs/paths in a stable (sorted) order so that datasets are reproducible.
    """
    files: list[str] = []
    for src in sources:
        fs, path = fsspec.core.url_to_fs(src)
        if not fs.exists(path):
            raise SpecError("SRC", src, "does not exist", "name existing files or directories")
        if fs.isdir(path):
            found = sorted(fs.glob(posixpath.join(path.rstrip("/"), "**", glob)))
            files.extend(fs.unstrip_protocol(p) if "://" in src else p for p in found if fs.isfile(p))
        else:
            files.append(src)
    if not files:
        raise SpecError("SRC", list(sources), f"contains no files matching {glob!r}",
                        "point at a folder of text files or change --glob")
    return files


def _token_stream(files: Sequence[str], tokenizer: TextTokenizer, dtype: type) -> Iterator[np.ndarray]:
    is_bytes = tokenizer.to_dict() == ByteCodec().to_dict()
    for url in files:
        with fsspec.open(url, "rb") as f:
            data = f.read()
        if is_bytes:  # the default: no per-token Python work
            doc = np.frombuffer(data, dtype=np.uint8).astype(dtype)
            yield np.concatenate(([ByteCodec.bos_id], doc, [ByteCodec.eos_id])).astype(dtype)
        else:
            ids = tokenizer.encode(data.decode("utf-8", errors="replace"), add_bos=True, add_eos=True)
            yield np.asarray(ids, dtype=dtype)


def prepare_token_dataset(sources: Sequence[str], out_uri: str, *, shard_tokens: int = 1 << 22,
                          seq_len: int = 2048, glob: str = "*.py",
                          tokenizer: TextTokenizer | None = None) -> TokenManifest:
    """Tokenize text files into Parquet shards of about ``shard_tokens`` tokens under ``out_uri``.

    ``tokenizer``: default ``ByteCodec`` (the byte tokenizer's ids).
    """
    _check_sizes(shard_tokens=shard_tokens, seq_len=seq_len)
    tokenizer = tokenizer or ByteCodec()
    files = find_text_files(sources, glob=glob)
    return write_token_dataset(_token_stream(files, tokenizer, _token_dtype(tokenizer)[0]), out_uri,
                               tokenizer=tokenizer, num_documents=len(files), sources=sources,
                               shard_tokens=shard_tokens, seq_len=seq_len)


def _check_sizes(*, shard_tokens: int, seq_len: int) -> None:
    if seq_len <= 0:
        raise SpecError("--seq-len", seq_len, "must be positive", "pass e.g. --seq-len 2048")
    if shard_tokens < seq_len:
        raise SpecError("--shard-tokens", shard_tokens, f"is smaller than seq_len={seq_len}",
                        "pass --shard-tokens >= --seq-len")


def _token_dtype(tokenizer: TextTokenizer) -> tuple[type, pa.DataType]:
    wide = tokenizer.vocab_size > 1 << 16
    return (np.uint32, _WIDE_TOKEN_TYPE) if wide else (np.uint16, _TOKEN_TYPE)


def write_token_dataset(documents: Iterable[np.ndarray], out_uri: str, *, tokenizer: TextTokenizer,
                        num_documents: int, sources: Sequence[str], shard_tokens: int = 1 << 22,
                        seq_len: int = 2048, metadata: dict[str, Any] | None = None) -> TokenManifest:
    """Write already-tokenized ``documents`` (one id array each, concatenated in order) as a dataset
    under ``out_uri``; the manifest, written last, records ``tokenizer``, ``sources`` and ``metadata``."""
    _check_sizes(shard_tokens=shard_tokens, seq_len=seq_len)
    dtype, token_type = _token_dtype(tokenizer)
    fs, root = fsspec.core.url_to_fs(out_uri)
    fs.makedirs(root, exist_ok=True)
    rows_per_shard = shard_tokens // seq_len
    shards: list[TokenShard] = []
    pending: list[np.ndarray] = []
    pending_tokens = 0

    def flush(final: bool) -> None:
        nonlocal pending, pending_tokens
        stream = np.concatenate(pending) if pending else np.zeros(0, dtype)
        while stream.size >= rows_per_shard * seq_len or (final and stream.size):
            take = min(stream.size, rows_per_shard * seq_len)
            chunk, stream = stream[:take], stream[take:]
            starts = range(0, take, seq_len)
            table = pa.table({"tokens": pa.array([chunk[s:s + seq_len] for s in starts], type=token_type)})
            name = _SHARD_NAME.format(index=len(shards))
            with fs.open(posixpath.join(root, name), "wb") as f:
                pq.write_table(table, f)
            shards.append(TokenShard(path=name, num_tokens=int(take), num_rows=len(starts)))
        pending, pending_tokens = [stream], int(stream.size)

    for doc in documents:
        pending.append(np.asarray(doc).astype(dtype, copy=False))
        pending_tokens += doc.size
        if pending_tokens >= rows_per_shard * seq_len:
            flush(final=False)
    flush(final=True)
    manifest = TokenManifest(format=TOKEN_FORMAT, tokenizer=tokenizer.to_dict(), seq_len=seq_len,
                             num_tokens=sum(s.num_tokens for s in shards), num_documents=num_documents,
                             shards=tuple(shards), sources=tuple(str(s) for s in sources),
                             metadata=dict(metadata or {}))
    with fs.open(posixpath.join(root, MANIFEST_NAME), "w") as f:  # last: marks completion
        f.write(manifest.to_json())
    return manifest


def count_byte_tokens(files: Sequence[str]) -> int:
    """Tokens the default ``ByteCodec`` makes of ``files``: one per byte plus BOS and EOS per file.

    Known from file sizes before anything is encoded, so a progress bar can have a total.
    """
    return sum(fsspec.core.url_to_fs(f)[0].size(f) + 2 for f in files)


def count_token_shards(uri: str) -> int:
    """Shards present under the dataset folder ``uri`` (0 when it does not exist yet).

    ``prepare_token_dataset`` has no progress hook; a caller that shows progress polls this
    from another thread. Shards of an earlier run in the same folder count too.
    """
    fs, root = fsspec.core.url_to_fs(uri)
    try:
        return len(fs.glob(posixpath.join(root, _SHARD_GLOB)))
    except (FileNotFoundError, OSError):
        return 0


def read_manifest(uri: str) -> TokenManifest:
    fs, root = fsspec.core.url_to_fs(uri)
    path = posixpath.join(root, MANIFEST_NAME)
    if not fs.exists(path):
        raise SpecError("dataset", uri, f"has no {MANIFEST_NAME} (missing or still being written)",
                        "run `rayfleet data prepare ... --out URI` first")
    with fs.open(path, "r") as f:
        manifest = TokenManifest.from_json(f.read())
    if manifest.format != TOKEN_FORMAT:
        raise SpecError("dataset.format", manifest.format, "is not a format this reader knows",
                        f"re-prepare the dataset ({TOKEN_FORMAT})")
    return manifest


def read_shard_tokens(uri: str, shard: TokenShard) -> np.ndarray:
    """The shard's tokens as one flat ``uint16`` (or, for large vocabularies, ``uint32``) array."""
    fs, root = fsspec.core.url_to_fs(uri)
    with fs.open(posixpath.join(root, shard.path), "rb") as f:
        column = pq.read_table(f, columns=["tokens"]).column("tokens").combine_chunks()
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return flat.astype(np.uint32 if flat.dtype == np.uint32 else np.uint16, copy=False)


def load_tokens(uri: str, *, max_tokens: int | None = None) -> np.ndarray:
    """All tokens of a dataset (or its first ``max_tokens``) as one flat ``uint16`` array."""
    manifest = read_manifest(uri)
    parts, total = [], 0
    for shard in manifest.shards:
        if max_tokens is not None and total >= max_tokens:
            break
        parts.append(read_shard_tokens(uri, shard))
        total += parts[-1].size
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint16)  # widths never mix in a dataset
    return tokens if max_tokens is None else tokens[:max_tokens]


def default_text_sources() -> list[str]:
    """The Python standard library's sources: real text that every machine has offline."""
    import sysconfig

    return [os.path.realpath(sysconfig.get_paths()["stdlib"])]
