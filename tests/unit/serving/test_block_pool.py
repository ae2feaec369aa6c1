"""Block pool: reference counts, LRU eviction of unreferenced cached blocks, events."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.block_pool import BlockPool, NoFreeBlocksError


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def test_ref_counts_and_free_count():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.touch([a])
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 0, 3)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4  # a failed allocation changes nothing


def test_lru_evicts_least_recently_freed_cached_block_and_uncached_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks[:3], [h(0), h(1), h(2)])
    # Free order = eviction order for cached blocks; the uncached block jumps the queue.
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    first = pool.get_new_blocks(1)[0]
    assert first is blocks[3]
    second = pool.get_new_blocks(1)[0]
    assert second is blocks[2] and pool.get_cached_block(h(2)) is None  # evicted, hash forgotten
    assert pool.get_cached_block(h(0)) is blocks[0]


def test_touching_a_cached_block_protects_it_from_eviction():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(0), h(1), h(2)])
    pool.free_blocks(blocks)  # LRU order 0, 1, 2
    hit = pool.get_cached_block(h(0))
    pool.touch([hit])  # a prefix hit: block 0 is referenced again
    assert pool.num_free_blocks == 2
    taken = pool.get_new_blocks(2)
    assert hit not in taken and pool.get_cached_block(h(0)) is hit
    pool.free_blocks([hit])
    assert pool.get_cached_block(h(0)) is hit  # freed but still findable


def test_duplicate_hash_keeps_first_block_and_events_report_changes():
    pool = BlockPool(2, enable_kv_events=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(7)])
    pool.cache_full_blocks([b], [h(7)])
    assert pool.get_cached_block(h(7)) is a and b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)
    events = pool.take_events()
    assert [e.stored for e in events] == [(h(7),), ()]
    assert events[1].removed == (h(7),)
    assert pool.take_events() == []


def test_caching_disabled_and_reset():
    off = BlockPool(2, enable_caching=False)
    blk = off.get_new_blocks(1)
    off.cache_full_blocks(blk, [h(1)])
    assert off.get_cached_block(h(1)) is None
    pool = BlockPool(2)
    blk = pool.get_new_blocks(1)
    pool.cache_full_blocks(blk, [h(1)])
    assert not pool.reset_prefix_cache()  # a block is still referenced
    pool.free_blocks(blk)
    assert pool.reset_prefix_cache() and pool.get_cached_block(h(1)) is None
    with pytest.raises(SpecError, match="num_blocks"):
        BlockPool(0)
