"""The built-in engine's KV events in vLLM's shapes drive the router's index as exact per-replica
state: what a replica evicts stops attracting requests (issue 30, item 1, engine side)."""

from __future__ import annotations

import pickle

from rayfleet.serving.engine.block_pool import BlockPool
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager
from rayfleet.serving.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.kv.global_index import GlobalKVIndex
from rayfleet.serving.kv.tiers import Tier
from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
from rayfleet.serving.routing.router import RouterCore

BLOCK = 4


def prefill(m: KVCacheManager, req) -> None:
    prefix = m.get_computed_prefix(req)
    assert m.allocate_slots(req, req.num_tokens - prefix.num_computed_tokens, prefix) is not None
    req.num_computed_tokens = req.num_tokens
    m.cache_computed_blocks(req)


def test_pool_publishes_vllm_shaped_events(make_request):
    m = KVCacheManager(BlockPool(4, enable_kv_events=True), block_size=BLOCK, enable_prefix_caching=True)
    req = make_request("a", list(range(10)))  # two full blocks and a partial one
    prefill(m, req)
    (stored,) = m.pool.take_events()
    assert stored == BlockStored(tuple(req.block_hashes[:2]), None, tuple(range(8)), BLOCK)
    assert stored.stored == stored.block_hashes and stored.removed == () and not stored.cleared
    m.free(req)
    other = make_request("b", list(range(100, 116)))  # 4 blocks: evicts both cached ones
    prefill(m, other)
    removed, stored_b = m.pool.take_events()
    # Tail first: the request freed its blocks tail-first, so its shared prefix goes last.
    assert removed == BlockRemoved(tuple(req.block_hashes[1::-1])) and removed.removed == removed.block_hashes
    assert stored_b.parent_block_hash is None and len(stored_b.token_ids) == 4 * BLOCK
    m.free(other)
    assert m.pool.reset_prefix_cache()
    assert m.pool.take_events() == [AllBlocksCleared()]
    assert pickle.loads(pickle.dumps(stored_b)) == stored_b  # they cross Ray


def test_a_later_run_names_its_parent(make_request):
    m = KVCacheManager(BlockPool(8, enable_kv_events=True), block_size=BLOCK, enable_prefix_caching=True)
    req = make_request("a", list(range(6)))
    prefix = m.get_computed_prefix(req)
    m.allocate_slots(req, req.num_tokens, prefix)
    req.num_computed_tokens = 6
    m.cache_computed_blocks(req)  # block 0
    for t in range(6, 12):
        req.append_output_token(t)
    m.allocate_slots(req, 6)
    req.num_computed_tokens = 12
    m.cache_computed_blocks(req)  # blocks 1 and 2: one run whose parent is block 0
    first, later = m.pool.take_events()
    assert first.block_hashes == (req.block_hashes[0],)
    assert later.block_hashes == tuple(req.block_hashes[1:3]) and later.parent_block_hash == req.block_hashes[0]
    assert later.token_ids == tuple(range(4, 12))


def _evict_all(pool: BlockPool) -> None:
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))


def test_an_evicted_block_stops_attracting_requests(make_request):
    """Replica b caches a prompt; while it does, the prompt goes to b. b then evicts it (its
    pool hands the blocks to other work): the BlockRemoved events reach the router and the prompt
    goes to a (equal queues; a by name once neither caches it). Broken variant: an index fed
    only the stored events keeps sending it to b."""
    pools = {r: KVCacheManager(BlockPool(8, enable_kv_events=True), block_size=BLOCK, enable_prefix_caching=True)
             for r in ("a", "b")}
    req = make_request("p", list(range(16)))
    prefill(pools["b"], req)
    pools["b"].free(req)
    hashes = list(req.block_hashes)

    def core_after(events_by_replica, *, drop_removals=False):
        core = RouterCore(roles={"colocated": ["a", "b"]}, block_size=BLOCK, model_id="tiny")
        for r, events in events_by_replica.items():
            kept = [e for e in events if not (drop_removals and e.removed)]
            core.observe(r, ReplicaSnapshot(ReplicaId(r), 8, 8, 0), kept)
        return core

    stored = {"a": pools["a"].pool.take_events(), "b": pools["b"].pool.take_events()}
    assert core_after(stored).route(list(range(16)), max_tokens=1, block_hashes=hashes).first[0] == "b"
    _evict_all(pools["b"].pool)
    evicted = {"a": [], "b": stored["b"] + pools["b"].pool.take_events()}
    assert any(isinstance(e, BlockRemoved) for e in evicted["b"])
    assert core_after(evicted).route(list(range(16)), max_tokens=1, block_hashes=hashes).first[0] == "a"
    stale = core_after(evicted, drop_removals=True)
    assert stale.route(list(range(16)), max_tokens=1, block_hashes=hashes).first[0] == "b"

    # The same through a pool replica's hash log (Serve's request router path) and the global index.
    publisher, pool_core = HashLogPublisher(), PoolRouterCore(role="colocated")
    stats = {"version": 1, "num_total_blocks": 8, "num_free_blocks": 8, "num_active_blocks": 0}
    publisher.apply(stored["b"])
    pool_core.observe("a", {**stats, **HashLogPublisher().fields(0.0)})
    pool_core.observe("b", {**stats, **publisher.fields(0.0)})
    assert pool_core.rank(["a", "b"], RouteHint(block_hashes=tuple(hashes), num_prompt_blocks=4))[0] == ["b"]
    publisher.apply(evicted["b"][len(stored["b"]):])
    pool_core.observe("b", {**stats, "version": 2, **publisher.fields(1.0)})  # drops the unclocked booking too
    assert pool_core.rank(["a", "b"], RouteHint(block_hashes=tuple(hashes), num_prompt_blocks=4))[0] == ["a"]
    index = GlobalKVIndex()
    index.apply_engine_events("n0", "b", evicted["b"])
    assert not any(loc.tier is Tier.ENGINE for h in hashes for loc in index.locate(h))
    index.apply_engine_events("n0", "a", stored["b"])
    index.apply_engine_events("n0", "a", [AllBlocksCleared()])
    assert index.num_entries == 0


def test_cleared_cache_empties_the_replica_in_the_index_and_starts_a_new_hash_epoch(make_request):
    m = KVCacheManager(BlockPool(8, enable_kv_events=True), block_size=BLOCK, enable_prefix_caching=True)
    req = make_request("p", list(range(8)))
    prefill(m, req)
    m.free(req)
    assert m.pool.reset_prefix_cache()
    events = m.pool.take_events()
    core = RouterCore(roles={"colocated": ["a", "b"]}, block_size=BLOCK, model_id="tiny")
    core.observe("b", ReplicaSnapshot(ReplicaId("b"), 8, 8, 0), events[:1])
    assert core.index.num_blocks_on(ReplicaId("b")) == 2
    core.observe("b", ReplicaSnapshot(ReplicaId("b"), 8, 8, 0), events[1:])
    assert core.index.num_blocks_on(ReplicaId("b")) == 0
    publisher = HashLogPublisher()
    publisher.apply(events[:1])
    epoch = publisher.epoch
    assert publisher.apply(events[1:]) and publisher.epoch != epoch and not publisher.cached
