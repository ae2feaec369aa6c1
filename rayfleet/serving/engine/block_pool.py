"""A fixed pool of KV blocks: ids, reference counts, an LRU free list and the prefix-cache map.

Design decisions:
- Bottom layer of the KV cache (block pool -> manager -> scheduler/engine, as in vLLM v1):
  it knows blocks and hashes, never requests or tokens. Pure Python; the tensors the ids index
  live in the engine (``rayfleet.models.PagedKVCache``).
- A freed block keeps its contents and its hash: it stays findable by ``get_cached_block``
  until it is *evicted*, i.e. handed out again by ``get_new_blocks``. So "free" means
  "unreferenced", and free blocks double as the prefix cache.
- The free list is an ``OrderedDict`` (O(1) pop from the front, O(1) removal from the middle
  when a cached block is hit): the front is evicted first. Uncached blocks go to the front
  (evicting them loses nothing); cached blocks go to the back in the order the caller frees
  them, so callers free a sequence's tail first and its shared prefix is evicted last.
- One block per hash: if a second block with an already-cached hash is offered (two requests
  computed the same prefix concurrently), it simply stays uncached and is recycled first.
- Optional KV events let a replica tell a router's prefix index and the KV tiers what it holds,
  without either reaching into the pool. They are vLLM's (``kv_events``): ``BlockStored`` per
  run of consecutive newly cached blocks (with parent hash and token ids when the caller passes
  them), ``BlockRemoved`` for the cached blocks ``get_new_blocks`` evicts, ``AllBlocksCleared``
  for a reset; so the index holds the replica's exact cache, evictions included.
- ``eviction_listener`` (set by a KV tier connector) is called synchronously with the
  ``(block_id, hash)`` of every cached block ``get_new_blocks`` evicts, *before* the caller can
  write into them: the one moment their KV can still be copied to a lower tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["BlockId", "KVBlock", "BlockPool", "KVCacheEvent", "NoFreeBlocksError"]

BlockId = NewType("BlockId", int)


class NoFreeBlocksError(RayfleetError):
    """More blocks were requested than the pool has free (callers check ``num_free_blocks``)."""


@dataclass(eq=False)
class KVBlock:
    """One block's bookkeeping; mutated only by ``BlockPool``. Identity equality."""

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class KVCacheEvent:
    """Hashes that became findable (``stored``) or stopped being findable (``removed``)."""

    stored: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()
    cleared = False  # the pool publishes ``kv_events``' shapes; this one is built by hand (tests, replays)


class BlockPool:
    """``num_blocks`` blocks; all free and uncached at the start."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True,
                 enable_kv_events: bool = False) -> None:
        if num_blocks <= 0:
            raise SpecError("num_blocks", num_blocks, "the KV pool needs at least one block",
                            "raise num_blocks (or the KV memory budget)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self._free: OrderedDict[BlockId, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._hash_to_block: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] | None = [] if enable_kv_events else None
        self.eviction_listener: Callable[[Sequence[tuple[BlockId, BlockHash]]], None] | None = None

    # -- queries (pure) -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks, cached or not: what ``get_new_blocks`` can hand out."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in ``[0, 1]``."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding ``block_hash``, referenced or not; ``None`` if not cached."""
        return self._hash_to_block.get(block_hash)

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free

    # -- mutations ------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the front of the free list, ``ref_cnt = 1`` each.

        Cached blocks taken this way are evicted: their hash is forgotten (and reported as a
        removal event). Raises ``NoFreeBlocksError`` if fewer blocks are free (nothing changes).
        """
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        taken = []
        removed = []
        evicted = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                removed.append(block.block_hash)
                evicted.append((block.block_id, block.block_hash))
                del self._hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        if removed and self._events is not None:
            self._events.append(BlockRemoved(tuple(removed)))
        if evicted and self.eviction_listener is not None:
            self.eviction_listener(evicted)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (a prefix hit); unreferenced ones leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching zero join the free list.

        Blocks are appended in the given order, so pass the ones to evict first first (a
        request frees its blocks tail-first). Uncached blocks jump to the front.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash], *,
                          parent_block_hash: BlockHash | None = None, token_ids: Sequence[int] = (),
                          block_size: int = 0) -> None:
        """Make ``blocks[i]`` findable under ``block_hashes[i]`` (blocks already cached are skipped).

        The caller guarantees each block is full and its KV has been written. A hash that is
        already cached under another block leaves this block uncached. No-op when caching is off.
        ``parent_block_hash`` (the hash before ``block_hashes[0]``), ``token_ids`` (the blocks'
        tokens, ``block_size`` each) only fill the ``BlockStored`` events' fields.
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes)
        runs: list[list[int]] = []  # indices of newly cached blocks, in runs of consecutive ones
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a cached block changed its prefix"
                continue
            if block_hash in self._hash_to_block:
                continue
            block.block_hash = block_hash
            self._hash_to_block[block_hash] = block
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        if self._events is None:
            return
        with_tokens = block_size > 0 and len(token_ids) == len(blocks) * block_size
        for run in runs:
            first, end = run[0], run[-1] + 1
            self._events.append(BlockStored(
                tuple(block_hashes[first:end]), block_hashes[first - 1] if first else parent_block_hash,
                tuple(token_ids[first * block_size:end * block_size]) if with_tokens else (), block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is referenced; returns whether it did."""
        if len(self._free) != self.num_blocks:
            return False
        had_any = bool(self._hash_to_block)
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()
        if had_any and self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first (empty when events are disabled)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events
