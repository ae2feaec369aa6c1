"""A node's KV tiers below the engine pool: host memory, then disk (local files or fsspec).

Design decisions:
- ``NodeKVTiers`` composes the pure ``HostKVPool`` and the storage layer's ``DiskKVStore`` and
  carries out the write-back rule: a block evicted from a tier goes to the next one (engine ->
  host via ``put_many``, host -> disk here, disk -> dropped). It is the object behind the
  per-node Ray actor (``tier_actors``) and, in one process, what tests and the benchmark
  share between engines "on one node".
- Inclusive tiers: a disk hit is promoted into host memory (it is about to be used) and stays
  on disk; a host block evicted to disk that disk already holds is only touched. Re-evictions
  then cost no I/O, and a block lost from host memory is still on disk.
- Block identity is the chained ``BlockHash`` (``block_hash``): a hash names the whole prefix,
  so a block can be loaded only if its parent chain matched, and tiers never compare tokens.
- Blocks travel as ``KVBlockData`` (K and V of one block for every layer, ``[num_layers,
  block_size, kv_heads, head_dim]``); on disk they are a small self-describing byte string
  whose integrity the disk store checks (checksum), so a corrupt block is a miss, never wrong KV.
- Prefetch: ``prefetch`` promotes disk blocks into host memory on a background thread, so a
  queued request's blocks are in memory when it is admitted. All state is under one lock (the
  engine thread, the prefetch thread and actor calls may interleave).
- Events (``take_events``): which hashes each tier stored or dropped, for the global index.
- ``shutdown`` simulates (or follows) the loss of the node's pool: every later call raises
  ``KVTierUnavailableError`` and callers fall back to recomputing.
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.kv.host_pool import HostKVPool

__all__ = ["Tier", "KVBlockData", "LoadedBlock", "TierEvent", "KVTierStats", "NodeKVTiers",
           "KVTierUnavailableError"]


class KVTierUnavailableError(RayfleetError):
    """A node's KV tiers are gone (node lost, actor dead, pool shut down): recompute instead."""


class Tier(str, enum.Enum):
    ENGINE = "engine"  # an engine replica's block pool (accelerator memory)
    HOST = "host"  # the node's shared host-memory pool
    DISK = "disk"  # local files or an fsspec URI


_DTYPE_BITS = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: store its bits
_HEADER = struct.Struct("<16s4I")  # dtype name, shape [num_layers, block_size, kv_heads, head_dim]


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of exactly its own elements (a copy when it is a view of more)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class KVBlockData:
    """One block's K and V for every layer, each ``[num_layers, block_size, kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def __reduce__(self):
        # A block is often a view: one of many evicted blocks copied out together, or K and V
        # halves of one buffer read from disk. Pickling a view ships its whole storage, so a
        # write-back of 90 blocks sent 90 copies of all 90 (265 MB for 3 MB of K, measured):
        # the host tier was slower than recomputing. Ship each block's own bytes only.
        return (KVBlockData, (_compact(self.k), _compact(self.v)))

    def to_bytes(self) -> bytes:
        dtype = str(self.k.dtype).removeprefix("torch.")
        parts = [_HEADER.pack(dtype.encode(), *self.k.shape)]
        for t in (self.k, self.v):
            t = t.detach().to("cpu").contiguous()
            t = t.view(_DTYPE_BITS.get(t.dtype, t.dtype))
            parts.append(t.numpy().tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVBlockData":
        """Inverse of ``to_bytes``. Raises ``ValueError`` for a malformed string."""
        name, *shape = _HEADER.unpack_from(data)
        dtype = getattr(torch, name.rstrip(b"\x00").decode())
        stored = _DTYPE_BITS.get(dtype, dtype)
        numel = int(np.prod(shape))
        item = torch.empty((), dtype=stored).element_size()
        if len(data) != _HEADER.size + 2 * numel * item:
            raise ValueError(f"KV block of {len(data)} bytes does not match shape {shape} {dtype}")
        flat = torch.frombuffer(bytearray(data[_HEADER.size:]), dtype=stored)
        k, v = flat[:numel].view(dtype).view(*shape), flat[numel:].view(dtype).view(*shape)
        return cls(k, v)


@dataclass(frozen=True)
class LoadedBlock:
    tier: Tier
    block: KVBlockData


@dataclass(frozen=True)
class TierEvent:
    """Hashes that ``tier`` of ``node_id`` started (``stored``) or stopped (``removed``) holding."""

    node_id: str
    tier: Tier
    stored: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class KVTierStats:
    num_host_blocks: int
    host_capacity_blocks: int
    num_disk_blocks: int
    disk_capacity_blocks: int
    host_hits: int
    disk_hits: int
    misses: int
    writes_to_host: int
    writes_to_disk: int
    num_corrupt: int
    num_prefetched: int


class NodeKVTiers:
    """Host memory (``host_blocks``) over an optional disk tier (``disk_uri``, ``disk_blocks``)."""

    def __init__(self, node_id: str, *, host_blocks: int, disk_uri: str | None = None,
                 disk_blocks: int = 0) -> None:
        from rayfleet.storage.kv_disk import DiskKVStore

        if disk_uri is None and disk_blocks:
            raise SpecError("kv_cache.disk.uri", None, f"disk.blocks={disk_blocks} needs a place to write",
                            "set kv_cache.disk.uri (a local path or an fsspec URI)")
        self.node_id = node_id
        self.host: HostKVPool[KVBlockData] = HostKVPool(host_blocks)
        self.disk = DiskKVStore(disk_uri, capacity_blocks=disk_blocks) if disk_uri else None
        self._lock = threading.RLock()
        self._events: list[TierEvent] = []
        if self.disk is not None and len(self.disk):  # blocks adopted from an earlier run
            self._events.append(TierEvent(node_id, Tier.DISK, stored=tuple(map(BlockHash, self.disk.keys()))))
        self._prefetcher: ThreadPoolExecutor | None = None
        self._alive = True
        self.host_hits = self.disk_hits = self.misses = 0
        self.writes_to_host = self.writes_to_disk = self.num_prefetched = 0

    # -- queries --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._alive

    def _check_alive(self) -> None:
        if not self._alive:
            raise KVTierUnavailableError(f"the KV tiers of node {self.node_id} are gone; recompute")

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier | None]:
        """Fastest tier holding each hash (``None``: not on this node). Touches nothing."""
        with self._lock:
            self._check_alive()
            return [Tier.HOST if h in self.host else Tier.DISK if self.disk is not None and h in self.disk
                    else None for h in block_hashes]

    def stats(self) -> KVTierStats:
        with self._lock:
            return KVTierStats(
                num_host_blocks=len(self.host), host_capacity_blocks=self.host.capacity_blocks,
                num_disk_blocks=len(self.disk) if self.disk else 0,
                disk_capacity_blocks=self.disk.capacity_blocks if self.disk else 0,
                host_hits=self.host_hits, disk_hits=self.disk_hits, misses=self.misses,
                writes_to_host=self.writes_to_host, writes_to_disk=self.writes_to_disk,
                num_corrupt=self.disk.num_corrupt if self.disk else 0, num_prefetched=self.num_prefetched)

    # -- reads ----------------------------------------------------------------------------------

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock | None]:
        """Each block from the fastest tier holding it, ``None`` if none does (or the disk copy
        was corrupt). Disk hits are promoted into host memory (see module doc)."""
        with self._lock:
            self._check_alive()
            return [self._get(h) for h in block_hashes]

    def _get(self, block_hash: BlockHash) -> LoadedBlock | None:
        block = self.host.get(block_hash)
        if block is not None:
            self.host_hits += 1
            return LoadedBlock(Tier.HOST, block)
        payload = self.disk.get(block_hash) if self.disk is not None else None
        if payload is None:
            self.misses += 1
            self._flush_disk_removals()  # a corrupt file was dropped
            return None
        self.disk_hits += 1
        block = KVBlockData.from_bytes(payload)
        self._put_host(block_hash, block)
        return LoadedBlock(Tier.DISK, block)

    # -- writes ---------------------------------------------------------------------------------

    def put_many(self, blocks: Sequence[tuple[BlockHash, KVBlockData]]) -> None:
        """Write back blocks evicted from an engine pool, oldest eviction first."""
        with self._lock:
            self._check_alive()
            for block_hash, block in blocks:
                self._put_host(block_hash, block)

    def _put_host(self, block_hash: BlockHash, block: KVBlockData) -> None:
        if self.host.capacity_blocks and block_hash not in self.host:
            self.writes_to_host += 1
            self._events.append(TierEvent(self.node_id, Tier.HOST, stored=(block_hash,)))
        evicted = self.host.put(block_hash, block)
        if self.host.capacity_blocks and evicted:
            self._events.append(TierEvent(self.node_id, Tier.HOST, removed=tuple(h for h, _ in evicted)))
        if self.disk is None:
            return
        for h, b in evicted:  # write-back to the next tier
            if self.disk.touch(h):  # already on disk (inclusive tiers): no I/O
                continue
            self.disk.put(h, b.to_bytes())
            self.writes_to_disk += 1
            self._events.append(TierEvent(self.node_id, Tier.DISK, stored=(h,)))
        self._flush_disk_removals()

    def _flush_disk_removals(self) -> None:
        if self.disk is not None:
            removed = self.disk.take_removed()
            if removed:
                self._events.append(TierEvent(self.node_id, Tier.DISK, removed=tuple(map(BlockHash, removed))))

    # -- prefetch -------------------------------------------------------------------------------

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> Future | None:
        """Promote these blocks from disk into host memory on a background thread; returns its
        future (``None`` when nothing is on disk only). Blocks already in memory are skipped."""
        with self._lock:
            self._check_alive()
            wanted = [h for h in block_hashes if h not in self.host and self.disk is not None and h in self.disk]
            if not wanted or self.host.capacity_blocks == 0:
                return None
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-prefetch-{self.node_id}")
        return self._prefetcher.submit(self._prefetch, wanted)

    def _prefetch(self, block_hashes: list[BlockHash]) -> int:
        done = 0
        for h in block_hashes:
            with self._lock:  # one block per hold, so engine calls interleave with a long prefetch
                if not self._alive:
                    return done
                if h in self.host or self.disk is None:
                    continue
                payload = self.disk.get(h)
                if payload is None:
                    self._flush_disk_removals()
                    continue
                self._put_host(h, KVBlockData.from_bytes(payload))
                self.num_prefetched += 1
                done += 1
        return done

    # -- events and lifecycle -------------------------------------------------------------------

    def take_events(self) -> list[TierEvent]:
        """Tier events since the last call, oldest first (for ``GlobalKVIndex.apply_tier_events``)."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def shutdown(self) -> None:
        """The pool is lost: drop host memory, stop prefetching, refuse later calls. The disk
        files stay (another process may adopt them); the global index must drop this node."""
        with self._lock:
            self._alive = False
            self.host.clear()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
