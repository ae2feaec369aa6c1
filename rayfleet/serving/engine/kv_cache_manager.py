"""Per-request KV block tables on top of a ``BlockPool``: prefix lookup, allocation, freeing.

Design decisions:
- The middle layer (pool -> *manager* -> scheduler): it maps requests to blocks and tokens to
  block counts; the scheduler only sees ``ComputedPrefix`` / ``KVCacheBlocks`` (opaque, frozen)
  and block-id lists, never ``KVBlock`` objects or hashes.
- Prefix hits are whole blocks and stop one token short of the request: the last known token
  must be computed to get logits for the next one, and if a fully cached prompt were reused
  whole, that recompute would write into a shared block. So a hit covers at most
  ``(num_tokens - 1) // block_size`` blocks.
- A block is cached (made findable by hash) only *after* its KV has been written
  (``cache_computed_blocks``, called once a step has run), never when it is merely allocated:
  a request preempted before its step runs cannot leave half-written blocks in the cache.
- ``allocate_slots`` is all-or-nothing: if the pool cannot cover the prefix hit plus the new
  tokens it changes nothing and returns ``None``; the scheduler decides whom to preempt.
- Freeing goes tail-first so that a request's shared prefix blocks are evicted last.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.serving.engine.block_pool import BlockId, BlockPool, KVBlock
from rayfleet.serving.engine.request import Request, RequestId

__all__ = ["ComputedPrefix", "KVCacheBlocks", "KVCacheStats", "KVCacheManager"]


@dataclass(frozen=True)
class ComputedPrefix:
    """A prefix-cache hit for a waiting request: ``num_computed_tokens`` tokens in ``blocks``."""

    blocks: tuple[KVBlock, ...]
    num_computed_tokens: int


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks newly added to a request's table by one ``allocate_slots``."""

    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class KVCacheStats:
    """Counters for metrics: pool usage and prefix-cache queries/hits in tokens."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class KVCacheManager:
    """Owns the request -> blocks tables of one engine."""

    def __init__(self, block_pool: BlockPool, *, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[RequestId, list[KVBlock]] = {}
        self._num_cached_blocks: dict[RequestId, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def get_computed_prefix(self, request: Request) -> ComputedPrefix:
        """Longest run of the request's leading full blocks that is cached (see module doc).

        Pure: the hit is counted in the metrics only when ``allocate_slots`` applies it.
        """
        if not self.enable_prefix_caching:
            return ComputedPrefix((), 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedPrefix(tuple(hits), len(hits) * self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          prefix: ComputedPrefix | None = None) -> int:
        """Free blocks that ``allocate_slots`` with these arguments would consume. Pure."""
        held = self.req_to_blocks.get(request.request_id, ())
        num_computed = request.num_computed_tokens + (prefix.num_computed_tokens if prefix else 0)
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        new_blocks = max(0, total - len(held) - (len(prefix.blocks) if prefix else 0))
        # A hit on an unreferenced cached block takes it off the free list too.
        revived = sum(1 for b in prefix.blocks if b.ref_cnt == 0) if prefix else 0
        return new_blocks + revived

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: ComputedPrefix | None = None) -> KVCacheBlocks | None:
        """Give the request room for ``num_new_tokens`` more tokens after its computed ones.

        ``prefix`` (from ``get_computed_prefix``, passed when a waiting request is admitted)
        is referenced, becomes the head of its table and is counted in the prefix metrics.
        Mutates the pool, the table and the counters and returns the newly allocated blocks;
        returns ``None`` and changes nothing if the pool is too small. Does not advance
        ``request.num_computed_tokens`` (the scheduler does).
        """
        if self.num_blocks_needed(request, num_new_tokens, prefix) > self.pool.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if prefix is not None and self.enable_prefix_caching:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += prefix.num_computed_tokens
        if prefix is not None and prefix.blocks:
            assert not blocks, "a prefix hit is only applied to a request without blocks"
            self.pool.touch(prefix.blocks)
            blocks.extend(prefix.blocks)
            self._num_cached_blocks[request.request_id] = len(prefix.blocks)
        num_computed = request.num_computed_tokens + (prefix.num_computed_tokens if prefix else 0)
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        new = self.pool.get_new_blocks(max(0, total - len(blocks)))
        blocks.extend(new)
        return KVCacheBlocks(tuple(b.block_id for b in new))

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's full blocks whose KV is written (per ``num_computed_tokens``)
        findable by hash. Call after the step that computed them has run. Mutates the pool."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full > start:
            bs = self.block_size
            self.pool.cache_full_blocks(blocks[start:num_full], request.block_hashes[start:num_full],
                                        parent_block_hash=request.block_hashes[start - 1] if start else None,
                                        token_ids=request.all_token_ids[start * bs:num_full * bs], block_size=bs)
            self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first); cached ones stay reusable. Idempotent."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: RequestId) -> list[BlockId]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def stats(self) -> KVCacheStats:
        return KVCacheStats(num_blocks=self.pool.num_blocks, num_free_blocks=self.pool.num_free_blocks,
                            num_cached_blocks=self.pool.num_cached_blocks, usage=self.pool.usage,
                            prefix_query_tokens=self.prefix_query_tokens,
                            prefix_hit_tokens=self.prefix_hit_tokens)
