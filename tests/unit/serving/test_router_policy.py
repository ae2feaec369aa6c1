"""Prefix-aware routing: cached replica wins at equal load, a hot prefix spreads as load grows,
decode goes where KV is free, and a decision stays well under a millisecond at fleet scale."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import replace

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash, hash_full_blocks, root_block_hash
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.policy import RouterPolicy

ROOT = root_block_hash(model_id="tiny")
BLOCK = 16


def hashes(tokens: list[int]) -> list[BlockHash]:
    return hash_full_blocks(tokens, block_size=BLOCK, root=ROOT)


def snapshot(rid: str, *, load: int = 0, free: int = 1000, **kw) -> ReplicaSnapshot:
    return ReplicaSnapshot(ReplicaId(rid), num_total_blocks=1000, num_free_blocks=free,
                           num_active_blocks=load, **kw)


def test_prefix_index_matches_contiguous_prefixes_only():
    index = PrefixIndex()
    hs = hashes(list(range(5 * BLOCK)))
    index.add_blocks(ReplicaId("a"), hs[:3])
    index.add_blocks(ReplicaId("b"), hs)
    index.add_blocks(ReplicaId("c"), hs[1:])  # lost its first block: matches nothing
    assert index.match_prefix(hs) == {"a": 3, "b": 5}
    index.apply_events(ReplicaId("b"), [KVCacheEvent(removed=(hs[2],))])
    assert index.match_prefix(hs) == {"a": 3, "b": 2}
    index.remove_replica(ReplicaId("a"))
    index.add_blocks(ReplicaId("d"), hs[:1])  # reuses a's bit
    assert index.match_prefix(hs) == {"b": 2, "d": 1}
    assert index.match_prefix([]) == {}


def test_cached_replica_wins_when_load_is_equal():
    index = PrefixIndex()
    prompt = hashes(list(range(8 * BLOCK)))
    index.add_blocks(ReplicaId("r2"), prompt[:6])
    snaps = [snapshot(f"r{i}", load=10) for i in range(4)]
    decision = RouterPolicy().choose_prefill(snaps, prompt, index)
    assert decision.replica_id == "r2"
    assert decision.ranked[0].blocks_to_prefill == 2 and "longest cached prefix" in decision.reason
    # Broken variant: a prefix-blind policy (all weight on load) would not prefer r2.
    blind = RouterPolicy(load_weight=1.0).choose_prefill(snaps, prompt, PrefixIndex())
    assert blind.replica_id == "r0"


def test_hot_shared_prefix_spreads_across_replicas_as_load_grows():
    """Simulate 40 requests sharing a 12-block system prompt (+1 own block) on 4 replicas.

    Each routed request adds its 13 blocks to that replica's decode load and its hashes to the
    index (as the replica's KV events would). The first request goes where the prefix is cached; later
    ones spread once that replica's load outweighs the prefill it saves.
    """
    index = PrefixIndex()
    system = list(range(12 * BLOCK))
    index.add_blocks(ReplicaId("r0"), hashes(system))
    snaps = {f"r{i}": snapshot(f"r{i}") for i in range(4)}
    policy = RouterPolicy(load_weight=0.5)
    chosen, hits = [], []
    for n in range(40):
        prompt = hashes(system + [1000 + n] * BLOCK)
        decision = policy.choose_prefill(list(snaps.values()), prompt, index)
        rid = decision.replica_id
        chosen.append(rid)
        hits.append(decision.ranked[0].cached_blocks)
        snap = snaps[rid]
        # The request runs there and reads its whole context (13 blocks) every decode step.
        snaps[rid] = replace(snap, num_active_blocks=snap.num_active_blocks + len(prompt))
        index.add_blocks(ReplicaId(rid), prompt)
    counts = Counter(chosen)
    assert chosen[0] == "r0"
    assert len(counts) == 4, counts  # every replica took part of the hot prefix
    assert max(counts.values()) <= 20, counts  # and none took half the traffic
    # Spreading did not give up the cache: each of r1..r3 paid the 12-block prefill once.
    assert sum(1 for h in hits if h < 12) == 3, hits
    # Broken variant: prefix-only routing (no load term) piles everything onto r0.
    piled = PrefixIndex()
    piled.add_blocks(ReplicaId("r0"), hashes(system))
    blind = RouterPolicy(load_weight=0.0)
    assert {blind.choose_prefill([snapshot(f"r{i}", load=500 if i == 0 else 0) for i in range(4)],
                                 hashes(system + [n] * BLOCK), piled).replica_id for n in range(5)} == {"r0"}


def test_new_prefixes_on_an_idle_pool_spread_over_the_caches():
    """Regression: ties went to the first replica by name, so on an idle pool every new prefix
    (a new tenant, or one evicted everywhere) landed on r0 and only r0's cache was used."""
    def route_tenants(index: PrefixIndex) -> Counter:
        idle = [snapshot(f"r{i}") for i in range(2)]
        chosen = Counter()
        for tenant in range(6):  # one at a time, each finished before the next: the pool is idle
            prompt = hashes([tenant] * 8 * BLOCK)
            rid = RouterPolicy().choose_prefill(idle, prompt, index).replica_id
            index.add_blocks(rid, prompt)  # its KV events
            chosen[rid] += 1
        return chosen

    assert route_tenants(PrefixIndex()) == {"r0": 3, "r1": 3}
    # Broken variant: the by-name tie-break (nothing cached anywhere as far as ties go).
    by_name = PrefixIndex()
    by_name.num_blocks_on = lambda replica_id: 0
    assert route_tenants(by_name) == {"r0": 6}


def test_unhealthy_and_full_replicas():
    index = PrefixIndex()
    prompt = hashes(list(range(4 * BLOCK)))
    index.add_blocks(ReplicaId("sick"), prompt)
    index.add_blocks(ReplicaId("full"), prompt[:3])
    snaps = [snapshot("sick", healthy=False), snapshot("full", free=0), snapshot("ok", load=50)]
    decision = RouterPolicy().choose_prefill(snaps, prompt, index)
    assert decision.replica_id == "ok" and [s.replica_id for s in decision.ranked] == ["ok", "full"]
    assert RouterPolicy().choose_prefill([snaps[0]], prompt, index).replica_id is None
    with pytest.raises(SpecError, match="load_weight"):
        RouterPolicy(load_weight=-1)


def test_decode_choice_by_free_blocks_then_load():
    snaps = [snapshot("a", free=100, load=5), snapshot("b", free=300, load=50),
             snapshot("c", free=300, load=10), snapshot("d", free=900, num_running_requests=4, max_num_seqs=4)]
    decision = RouterPolicy().choose_decode(snaps, num_blocks_needed=20)
    assert [s.replica_id for s in decision.ranked] == ["c", "b", "a", "d"]  # d has no sequence slot
    assert RouterPolicy().choose_decode(snaps[:1], num_blocks_needed=200).reason.startswith("a: no replica")


def test_decision_latency_at_fleet_scale():
    """64 replicas, 100k indexed blocks, 64-block prompts sharing prefixes of varied length."""
    rng = random.Random(0)
    index = PrefixIndex()
    prefixes = [hashes([p] * (64 * BLOCK)) for p in range(32)]  # 32 popular 64-block chains
    for r in range(64):
        rid = ReplicaId(f"r{r}")
        for p in rng.sample(range(32), 4):
            index.add_blocks(rid, prefixes[p][:rng.randint(8, 64)])
        index.add_blocks(rid, [BlockHash(rng.getrandbits(128).to_bytes(16, "big")) for _ in range(1600)])
    assert index.num_indexed_blocks >= 100_000
    snaps = [snapshot(f"r{r}", load=rng.randint(0, 500)) for r in range(64)]
    policy = RouterPolicy()
    wall, cpu = [], []
    for i in range(1000):
        prompt = prefixes[i % 32]
        start_wall, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = policy.choose_prefill(snaps, prompt, index)
        cpu.append(time.thread_time_ns() - start_cpu)
        wall.append(time.perf_counter_ns() - start_wall)
        assert decision.replica_id is not None
    wall.sort()
    cpu.sort()
    pct = lambda xs, q: xs[int(len(xs) * q)] / 1e3  # noqa: E731  (microseconds)
    print(f"router decision: wall p50={pct(wall, .5):.0f}us p99={pct(wall, .99):.0f}us; "
          f"cpu p50={pct(cpu, .5):.0f}us p99={pct(cpu, .99):.0f}us")
    # Goal: p99 <= 1 ms. Asserted on thread CPU time, because wall-clock p99 on the shared
    # 2-core dev machines measures the OS scheduler, not the policy; the wall bound is loose.
    assert pct(cpu, .99) < 1000 and pct(wall, .5) < 1000


def test_worked_example_from_the_module_docstring():
    index = PrefixIndex()
    prompt = hashes(list(range(8 * BLOCK)))
    index.add_blocks(ReplicaId("r0"), prompt[:6])
    policy = RouterPolicy(load_weight=0.5)
    busy = policy.choose_prefill([snapshot("r0", load=20), snapshot("r1", load=0)], prompt, index)
    assert [(s.replica_id, s.cost) for s in busy.ranked] == [("r1", 8.0), ("r0", 12.0)]
    assert busy.reason.startswith("r1: spread: r0 caches 6 blocks")
    calm = policy.choose_prefill([snapshot("r0", load=4), snapshot("r1", load=0)], prompt, index)
    assert [(s.replica_id, s.cost) for s in calm.ranked] == [("r0", 4.0), ("r1", 8.0)]


def test_engine_kv_events_feed_the_index_and_the_router_finds_the_cached_engine(tiny_model):
    """Hashes agree across layers: an engine's KV events, indexed, make the router pick it."""
    from rayfleet.serving.engine.engine_config import EngineConfig
    from rayfleet.serving.engine.llm_engine import LLMEngine
    from rayfleet.serving.engine.sampling import SamplingParams

    config = EngineConfig(block_size=4, num_blocks=16, enable_kv_events=True, model_id="tiny")
    engines = {ReplicaId("e0"): LLMEngine(tiny_model, config), ReplicaId("e1"): LLMEngine(tiny_model, config)}
    prompt = list(range(30, 47))  # 17 tokens: 4 full blocks
    engines[ReplicaId("e1")].generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    index = PrefixIndex()
    for rid, eng in engines.items():
        index.apply_events(rid, eng.take_kv_events())
    request_hashes = engines[ReplicaId("e0")].block_hashes_of(prompt)
    assert index.match_prefix(request_hashes) == {"e1": 4}
    snaps = [eng.replica_snapshot(rid) for rid, eng in engines.items()]
    assert snaps[0] == ReplicaSnapshot(ReplicaId("e0"), num_total_blocks=16, num_free_blocks=16,
                                       num_active_blocks=0, max_num_seqs=config.max_num_seqs)
    assert RouterPolicy().choose_prefill(snaps, request_hashes, index, num_prompt_blocks=5).replica_id == "e1"
    salted = engines[ReplicaId("e0")].block_hashes_of(prompt, cache_salt="tenant-b")
    assert index.match_prefix(salted) == {}
