"""The KV disk tier: content-addressed, checksummed block files at any fsspec URI, LRU-bounded.

Design decisions:
- One file per block, named by the block's hash (hex), under ``<uri>/<first 2 hex>/``: a
  block is written once and read whole, so a key-value file layout needs no index file that
  could get out of step with the data. The in-memory catalogue (key -> size, LRU order) is
  rebuilt by listing the directory at start-up, so the tier survives a restart of the process
  that owns it (the files are the truth; the catalogue is a cache of the listing).
- Every file is framed: ``MAGIC | key (16 B) | BLAKE2b-128(payload) | len | payload``. A read
  checks all four, so a torn write, bit rot, a truncated upload or a file copied under the wrong
  name is *detected*: ``get`` deletes it and returns ``None``, and the caller recomputes. A
  wrong KV block would silently change outputs, so a miss is the only safe answer.
- Atomic writes: on a local filesystem, write ``<name>.tmp-<uuid>`` then rename over the final
  name (POSIX rename is atomic: readers see the old file or the new one, never a prefix). On
  object stores (s3, gcs, memory) a single ``pipe_file`` PUT is already atomic, and their
  ``mv`` is a copy, so they get one PUT. fsync is skipped on purpose: a cache may lose recent
  blocks in a crash, and the checksum catches any half-written file that survives one.
- Capacity is in blocks (the unit every tier and the 1:4:16 sizing speak); LRU eviction
  deletes files. The disk tier is the last one, so evicted blocks are dropped, not moved.
- Keys are opaque ``bytes`` (serving's 16-byte block hashes) and payloads opaque ``bytes``:
  ``storage`` knows nothing of tensors or serving (the serving layer encodes blocks).
- Not thread-safe by itself; the owner (``rayfleet.serving.kv.tiers.NodeKVTiers``) serialises
  calls under its lock.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import fsspec

from rayfleet.errors import SpecError

__all__ = ["DiskKVStore", "DiskKVStats"]

_MAGIC = b"RFKV\x01"
_HEADER = struct.Struct(f"<{len(_MAGIC)}s16s16sQ")  # magic, key, digest, payload length
_LOCAL_PROTOCOLS = {"file", "local"}


@dataclass(frozen=True)
class DiskKVStats:
    num_blocks: int
    capacity_blocks: int
    num_writes: int
    num_reads: int
    num_evictions: int
    num_corrupt: int


def _age(info: dict) -> float:
    """Modification time of a listed file as seconds (local fs: float; memory fs: datetime)."""
    stamp = info.get("mtime") or info.get("created") or 0
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class DiskKVStore:
    """``capacity_blocks`` checksummed block files under ``uri``. Mutates the filesystem."""

    def __init__(self, uri: str, *, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise SpecError("kv_cache.disk.blocks", capacity_blocks, "the disk tier needs room for a block",
                            "pass blocks >= 1, or leave kv_cache.disk out to disable the disk tier")
        self.uri = uri
        self.capacity_blocks = capacity_blocks
        self.fs, self.root = fsspec.core.url_to_fs(uri)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self._atomic_rename = protocol in _LOCAL_PROTOCOLS
        self.fs.makedirs(self.root, exist_ok=True)
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._removed: list[bytes] = []  # keys dropped since the last take_removed (evicted/corrupt)
        self.num_writes = self.num_reads = self.num_evictions = self.num_corrupt = 0
        self._load_catalogue()

    # -- layout ---------------------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self.root.rstrip('/')}/{name[:2]}/{name}.kv"

    def _load_catalogue(self) -> None:
        """Adopt block files already under ``uri`` (oldest modification first as LRU order)."""
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return
        entries = []
        for path, info in found.items():
            base = path.rsplit("/", 1)[-1]
            if ".tmp-" in base:  # a write that never finished: garbage
                self.fs.rm_file(path)
                continue
            if not base.endswith(".kv"):
                continue
            try:
                key = bytes.fromhex(base[:-3])
            except ValueError:
                continue
            entries.append((_age(info), key))
        for _, key in sorted(entries):
            self._lru[key] = None
        while len(self._lru) > self.capacity_blocks:
            self._evict_one()

    # -- queries --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def keys(self) -> list[bytes]:
        """Keys held, least recently used first."""
        return list(self._lru)

    def stats(self) -> DiskKVStats:
        return DiskKVStats(len(self._lru), self.capacity_blocks, self.num_writes, self.num_reads,
                           self.num_evictions, self.num_corrupt)

    # -- mutations ------------------------------------------------------------------------------

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        """Store ``payload`` under ``key`` (atomically; see module doc) and return the keys
        evicted to make room, least recently used first. A key already held is only marked
        recently used: blocks are immutable (the key is a hash of their content's prefix)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return []
        evicted = []
        while len(self._lru) >= self.capacity_blocks:
            evicted.append(self._evict_one())
        frame = _HEADER.pack(_MAGIC, key, _digest(payload), len(payload)) + payload
        path = self._path(key)
        if self._atomic_rename:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self.fs.pipe_file(tmp, frame)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, frame)
        self._lru[key] = None
        self.num_writes += 1
        return evicted

    def get(self, key: bytes) -> bytes | None:
        """The payload under ``key`` (marked recently used), or ``None`` if absent or corrupt.
        A corrupt file is deleted and counted (``num_corrupt``); it never reaches the caller."""
        if key not in self._lru:
            return None
        path = self._path(key)
        try:
            frame = self.fs.cat_file(path)
        except FileNotFoundError:
            frame = b""
        payload = self._verified(key, frame)
        if payload is None:
            self.num_corrupt += 1
            self._drop(key)
            return None
        self._lru.move_to_end(key)
        self.num_reads += 1
        return payload

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` recently used without I/O; False if it is not held."""
        if key not in self._lru:
            return False
        self._lru.move_to_end(key)
        return True

    def remove(self, key: bytes) -> bool:
        """Delete one block; False if it was not held."""
        if key not in self._lru:
            return False
        self._drop(key)
        return True

    def take_removed(self) -> list[bytes]:
        """Keys that left the tier (evicted or found corrupt) since the last call."""
        removed, self._removed = self._removed, []
        return removed

    def clear(self, keys: Iterable[bytes] | None = None) -> None:
        for key in list(self._lru if keys is None else keys):
            self.remove(key)

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _verified(key: bytes, frame: bytes) -> bytes | None:
        if len(frame) < _HEADER.size:
            return None
        magic, stored_key, digest, length = _HEADER.unpack_from(frame)
        payload = frame[_HEADER.size:]
        if magic != _MAGIC or stored_key != key or length != len(payload) or _digest(payload) != digest:
            return None
        return payload

    def _evict_one(self) -> bytes:
        key, _ = self._lru.popitem(last=False)
        self._delete_file(key)
        self._removed.append(key)
        self.num_evictions += 1
        return key

    def _drop(self, key: bytes) -> None:
        del self._lru[key]
        self._delete_file(key)
        self._removed.append(key)

    def _delete_file(self, key: bytes) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
