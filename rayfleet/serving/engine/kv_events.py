"""KV cache events in vLLM's shapes: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.

Design decisions:
- The built-in engine's block pool publishes the same three events vLLM's KV-events publisher
  sends (``vllm.distributed.kv_events``: ``BlockStored(block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium)``, ``BlockRemoved(block_hashes, medium)``,
  ``AllBlocksCleared()``), so one consumer (the router's ``PrefixIndex``, the hash log a pool
  replica publishes, the global KV index) reads either engine's events as the exact state of
  what that replica caches and has evicted. Engines without events fall back to the router's
  estimate (text blocks, bookings).
- Frozen values that pickle (they cross Ray from a replica to routers and the index actor).
  Every event also answers ``stored`` / ``removed`` / ``cleared``, the three facts a consumer
  needs, so consumers need no ``isinstance`` ladder and the older ``KVCacheEvent(stored,
  removed)`` (``block_pool``) is still accepted where it is built by hand (tests, replays).
- ``AllBlocksCleared`` is its own event, not a ``BlockRemoved`` of every hash: a reset cache
  would otherwise publish a cache-sized list, and consumers drop a replica's entries at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rayfleet.serving.engine.block_hash import BlockHash

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEvent", "is_cleared"]


@dataclass(frozen=True)
class BlockStored:
    """``block_hashes`` became findable: consecutive full blocks of one sequence, the first
    one's parent ``parent_block_hash`` (None at the sequence's root), their ``token_ids``
    (``len(block_hashes) * block_size`` of them)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"

    @property
    def stored(self) -> tuple[BlockHash, ...]:
        return self.block_hashes

    @property
    def removed(self) -> tuple[BlockHash, ...]:
        return ()

    cleared = False


@dataclass(frozen=True)
class BlockRemoved:
    """``block_hashes`` were evicted (handed out again): no longer findable."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = "GPU"

    @property
    def stored(self) -> tuple[BlockHash, ...]:
        return ()

    @property
    def removed(self) -> tuple[BlockHash, ...]:
        return self.block_hashes

    cleared = False


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached hash of the replica was forgotten (``reset_prefix_cache``)."""

    stored: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()
    cleared = True


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def is_cleared(event: object) -> bool:
    """True for ``AllBlocksCleared`` (any event without the attribute: False)."""
    return bool(getattr(event, "cleared", False))
