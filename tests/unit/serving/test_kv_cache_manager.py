"""KV cache manager: prefix hits in whole blocks, caching only written blocks, no leaks."""

from __future__ import annotations

from rayfleet.serving.engine.block_pool import BlockPool
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager


def manager(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching=caching), block_size=4,
                          enable_prefix_caching=caching)


def prefill(m: KVCacheManager, req) -> None:
    prefix = m.get_computed_prefix(req)
    assert m.allocate_slots(req, req.num_tokens - prefix.num_computed_tokens, prefix) is not None
    req.num_computed_tokens = req.num_tokens  # the step ran
    m.cache_computed_blocks(req)


def test_prefix_hit_after_a_finished_request(make_request):
    m = manager()
    first = make_request("a", list(range(10)))
    prefill(m, first)
    first_ids = m.get_block_ids("a")
    assert len(first_ids) == 3
    m.free(first)
    assert m.pool.num_free_blocks == 8
    second = make_request("b", list(range(8)) + [50, 51, 52])
    prefix = m.get_computed_prefix(second)
    assert prefix.num_computed_tokens == 8  # two full shared blocks; the partial one is never cached
    m.allocate_slots(second, second.num_tokens - 8, prefix)
    second_ids = m.get_block_ids("b")
    assert second_ids[:2] == first_ids[:2] and len(second_ids) == 3
    assert second_ids[2] != first_ids[2] or m.pool.get_cached_block(first.block_hashes[1]) is not None
    stats = m.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (21, 8)


def test_a_fully_cached_prompt_still_computes_its_last_token(make_request):
    m = manager()
    first = make_request("a", list(range(8)))
    prefill(m, first)
    m.free(first)
    again = make_request("b", list(range(8)))
    # Both blocks are cached, but the hit stops one token short: the last block is recomputed
    # into a fresh block (writing into the shared one would corrupt it).
    assert m.get_computed_prefix(again).num_computed_tokens == 4


def test_blocks_are_cached_only_once_written(make_request):
    m = manager()
    req = make_request("a", list(range(8)))
    m.allocate_slots(req, 8, m.get_computed_prefix(req))
    other = make_request("b", list(range(8)) + [1])
    assert m.get_computed_prefix(other).num_computed_tokens == 0  # allocated but not computed
    req.num_computed_tokens = 4
    m.cache_computed_blocks(req)
    assert m.get_computed_prefix(other).num_computed_tokens == 4


def test_allocation_is_all_or_nothing_and_shared_blocks_are_refcounted(make_request):
    m = manager(num_blocks=4)
    a = make_request("a", list(range(8)) + [9])
    prefill(m, a)  # 3 blocks
    b = make_request("b", list(range(8)) + [7])
    prefix = m.get_computed_prefix(b)
    assert prefix.num_computed_tokens == 8
    assert m.allocate_slots(b, 1, prefix) is not None  # shares 2 blocks, takes 1 new
    assert m.pool.num_free_blocks == 0
    c = make_request("c", [5, 5, 5])
    assert m.allocate_slots(c, 3, m.get_computed_prefix(c)) is None
    assert m.pool.num_free_blocks == 0 and m.get_block_ids("c") == []
    m.free(a)
    m.free(b)
    m.free(b)  # idempotent
    assert m.pool.num_free_blocks == 4


def test_decode_allocates_a_block_only_when_one_fills(make_request):
    m = manager(caching=False)
    req = make_request("a", list(range(3)))
    prefill(m, req)
    assert len(m.get_block_ids("a")) == 1
    req.append_output_token(1)
    assert m.allocate_slots(req, 1).block_ids == ()  # position 3 still fits in block 0
    req.num_computed_tokens += 1
    req.append_output_token(1)
    assert len(m.allocate_slots(req, 1).block_ids) == 1  # position 4 opens block 1


def test_freed_request_is_evicted_tail_first_so_its_prefix_survives(make_request):
    m = manager(num_blocks=3)
    first = make_request("a", list(range(12)))
    prefill(m, first)
    m.free(first)
    m.pool.get_new_blocks(1)  # pressure: one block must be evicted
    again = make_request("b", list(range(12)) + [1])
    assert m.get_computed_prefix(again).num_computed_tokens == 8  # blocks 0, 1 kept; 2 evicted
