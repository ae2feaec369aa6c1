"""The host-memory KV tier: an LRU map of block hash -> block, bounded in blocks.

Design decisions:
- Pure and generic: it stores whatever block object it is given (``KVBlockData`` in serving)
  and knows nothing of tensors, disks or Ray. ``put`` *returns* the blocks it evicted, oldest
  first, and the owner (``NodeKVTiers``) writes them back to the next tier; the pool itself
  never does I/O, so its order and capacity rules are unit-tested exactly.
- Blocks are immutable (a hash names a prefix's content), so putting a hash already held only
  marks it recently used; the tiers are inclusive (a block loaded into an engine stays here, so
  evicting it from the engine again costs no copy).
- One pool per node, shared by every engine replica on the node (``tier_actors`` wraps it
  in a named actor per node): replicas on one node then share one prefix cache in host memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash

__all__ = ["HostKVPool"]

BlockT = TypeVar("BlockT")


class HostKVPool(Generic[BlockT]):
    """At most ``capacity_blocks`` blocks; ``capacity_blocks == 0`` holds nothing (pass-through)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise SpecError("kv_cache.host_blocks", capacity_blocks, "cannot be negative",
                            "pass host_blocks >= 0 (0 disables the host-memory tier)")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[BlockHash, BlockT] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def keys(self) -> list[BlockHash]:
        """Hashes held, least recently used first."""
        return list(self._lru)

    def get(self, block_hash: BlockHash) -> BlockT | None:
        """The block (now most recently used), or ``None``."""
        block = self._lru.get(block_hash)
        if block is not None:
            self._lru.move_to_end(block_hash)
        return block

    def put(self, block_hash: BlockHash, block: BlockT) -> list[tuple[BlockHash, BlockT]]:
        """Hold ``block`` as most recently used; returns the ``(hash, block)`` pairs evicted to
        make room, least recently used first (with capacity 0: the block itself)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return []
        if self.capacity_blocks == 0:
            return [(block_hash, block)]
        evicted = []
        while len(self._lru) >= self.capacity_blocks:
            evicted.append(self._lru.popitem(last=False))
        self._lru[block_hash] = block
        return evicted

    def remove(self, block_hash: BlockHash) -> BlockT | None:
        return self._lru.pop(block_hash, None)

    def clear(self) -> list[BlockHash]:
        """Drop everything (the node's pool was lost); returns the hashes that were held."""
        held = list(self._lru)
        self._lru.clear()
        return held
