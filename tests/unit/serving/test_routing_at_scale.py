"""Routing at real prompt lengths and pool sizes: the overload term, the recent-work ledger, one
prefix walk per decision, and trace replays in the Mooncake format."""

from __future__ import annotations

import json
import math

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.engine.replica_state import ReplicaSnapshot, ReplicaId
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.ttft_cost import TTFTPolicy
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.recent_work import RecentWorkLedger
from rayfleet.serving.routing.router import RouterCore
from rayfleet.serving.routing.trace_replay import (TraceRequest, infinite_cache_bound, chain_block_hashes,
                                                   multi_turn_trace, read_mooncake_trace, replay_routing)

BLOCK = 16
ROOT = root_block_hash(model_id="tiny")


def snap(rid: str, recent: float, load: int = 0, running: int = 1) -> ReplicaSnapshot:
    """A replica of a busy pool (one request running: it adds no load cost); ``running=0`` on
    every replica is an idle pool, where the cache alone decides."""
    return ReplicaSnapshot(ReplicaId(rid), 1000, 1000, load, num_running_requests=running, recent_work_blocks=recent)


def test_an_idle_pool_keeps_a_prompt_on_its_cache_whatever_the_ledgers_say():
    """Nothing running or queued anywhere: no request waits, so balancing recent work would only
    throw a cache hit away (a repeated prompt must stay where it is cached)."""
    index = PrefixIndex()
    prompt = hash_full_blocks(list(range(10 * BLOCK)), block_size=BLOCK, root=ROOT)
    index.add_blocks(ReplicaId("r0"), prompt)
    policy = RouterPolicy()
    recent = {ReplicaId("r0"): 600.0, ReplicaId("r1"): 0.0}
    idle = [snap("r0", 0, running=0), snap("r1", 0, running=0)]
    assert policy.choose_prefill(idle, prompt, index, recent_work=recent, mean_request_blocks=10.0).replica_id == "r0"
    busy = [snap("r0", 0), snap("r1", 0)]  # the same ledgers on a busy pool: r0 is far over the mean
    assert policy.choose_prefill(busy, prompt, index, recent_work=recent, mean_request_blocks=10.0).replica_id == "r1"


def test_overload_term_worked_example():
    """10-block prompt, r0 caches all 10 but has done 60 blocks of recent work, r1 nothing
    cached and 20 blocks (80 >= 2 replicas x 10 blocks: the term is on). Pool mean after this
    request: (80 + 10) / 2 = 45.
    r0: to_prefill 0, over = (60 + 0 - 45) / 45 = 1/3, cost = 0 + 4 * 10 * 1/3 = 13.3.
    r1: to_prefill 10, over = (20 + 10 - 45) / 45 < 0 -> 0, cost = 10. r1 wins."""
    index = PrefixIndex()
    prompt = hash_full_blocks(list(range(10 * BLOCK)), block_size=BLOCK, root=ROOT)
    index.add_blocks(ReplicaId("r0"), prompt)
    policy = RouterPolicy(load_weight=0.0, overload_weight=4.0, spread_weight=0.0)  # the hinge alone
    decision = policy.choose_prefill([snap("r0", 60), snap("r1", 20)], prompt, index)
    assert decision.replica_id == "r1"
    assert decision.ranked[0].cost == pytest.approx(10.0)
    assert decision.ranked[1].cost == pytest.approx(40 / 3)
    # At 40 blocks r0 is at the mean (40 + 30 + 10) / 2: the prefix decides, r0 wins.
    assert policy.choose_prefill([snap("r0", 40), snap("r1", 30)], prompt, index).replica_id == "r0"
    # Below one request per replica of history (8 < 2 x 10) the term is off: stickiness wins.
    assert policy.choose_prefill([snap("r0", 8), snap("r1", 0)], prompt, index).replica_id == "r0"
    # Broken variant: without the term the cached replica wins however overloaded it is.
    assert RouterPolicy(load_weight=0.0, overload_weight=0.0, spread_weight=0.0).choose_prefill(
        [snap("r0", 6000), snap("r1", 20)], prompt, index).replica_id == "r0"


def test_router_policy_refuses_nan_weights():
    with pytest.raises(SpecError, match="overload_weight"):
        RouterPolicy(overload_weight=float("nan"))


def test_recent_work_ledger_decays_exponentially():
    ledger = RecentWorkLedger(memory_s=10.0)
    ledger.add("a", 100.0, now=0.0)
    assert ledger.value("a", 0.0) == pytest.approx(100.0)
    assert ledger.value("a", 10.0) == pytest.approx(100.0 / math.e)
    ledger.add("a", 50.0, now=10.0)
    assert ledger.value("a", 10.0) == pytest.approx(100.0 / math.e + 50.0)
    assert ledger.value("b", 5.0) == 0.0
    ledger.forget("a")
    assert ledger.value("a", 10.0) == 0.0
    with pytest.raises(SpecError, match="load_memory_s"):
        RecentWorkLedger(0)


def test_route_walks_the_prefix_once_and_books_only_new_blocks():
    core = RouterCore(roles={"colocated": ["r0", "r1"]}, block_size=BLOCK, model_id="tiny")
    walks = []
    original = core.index.match_prefix
    core.index.match_prefix = lambda hashes: walks.append(len(hashes)) or original(hashes)
    added = []
    original_add = core.index.add_blocks
    core.index.add_blocks = lambda rid, hashes: added.append(len(list(hashes))) or original_add(rid, hashes)
    prompt = list(range(8 * BLOCK))
    first = core.route(prompt, max_tokens=4, now_s=0.0).first[0]
    assert added == []  # the index update is off the decision path: booked, indexed later
    again = core.route(prompt + list(range(1000, 1000 + 2 * BLOCK)), max_tokens=4, now_s=1.0).first[0]
    assert again == first  # the cached prefix wins on an otherwise idle pool (a pending booking counts)
    assert walks == [8, 10]  # one walk per decision
    assert added == [8]
    core.flush_bookings()  # what the async shell runs once the decision has been returned
    assert added == [8, 2]  # the second request indexes only the 2 blocks the replica lacked
    assert core.recent_work.value(first, 1.0) > 0


def test_route_accepts_precomputed_hashes():
    core = RouterCore(roles={"colocated": ["r0", "r1"]}, block_size=BLOCK, model_id="tiny")
    prompt = list(range(4 * BLOCK))
    hashes = hash_full_blocks(prompt, block_size=BLOCK, root=root_block_hash(model_id="tiny"))
    rid = core.route(prompt, max_tokens=2, block_hashes=hashes).first[0]
    core.flush_bookings()
    assert core.index.match_prefix(hashes) == {rid: 4}


def test_mooncake_trace_reader_and_bound(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 2000, "input_length": 512, "output_length": 5, "hash_ids": [2]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = read_mooncake_trace(path)
    assert [r.arrival_s for r in trace] == [0.0, 1.0, 2.0]
    root = root_block_hash(model_id="x")
    # Block ids chain: [2] alone is not the second block of [1, 2], so it does not hit.
    assert infinite_cache_bound(chain_block_hashes(r.block_ids, root) for r in trace) == pytest.approx(2 / 6)
    path.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(SpecError, match="hash_ids"):
        read_mooncake_trace(path)


def _replay(trace, policy, num_replicas, *, book_running=False):
    """The two tests below measure the block-unit cost in the replay as it was before issue 30
    (``book_running=False``: no running requests, state current at every decision);
    ``test_replay_that_books_running_requests`` replays as the live router sees."""
    distinct = len({b for r in trace for b in r.block_ids})  # the benchmark's cache rule: 2x fair share
    return replay_routing(trace, policy=policy, num_replicas=num_replicas, book_running=book_running,
                          cache_blocks=-(-2 * distinct // num_replicas))


def test_replay_that_books_running_requests():
    """Running requests booked as the live router books them (published every 0.1 s, its own
    decisions in between): the block-unit cost prices running blocks as load and falls to 0.77
    of the hit bound at 8 replicas (0.99 unbooked, issue 30); the TTFT cost keeps 0.996 (a
    running decode costs a queued request one token a step, not a block of prefill). Its load
    max/mean is 1.22 (measured; 2.8 at 64 replicas): it balances waiting time, not work."""
    trace = multi_turn_trace(num_conversations=200, turns=8, seed=1, turn_blocks=(1, 8), system_blocks=4)
    ttft = _replay(trace, TTFTPolicy(), 8, book_running=True)
    assert ttft.share_of_bound >= 0.95, ttft
    block_unit = _replay(trace, RouterPolicy(), 8, book_running=True)
    assert block_unit.share_of_bound < 0.8, block_unit  # the broken variant the issue names
    assert _replay(trace, RouterPolicy(), 8).share_of_bound > 0.95  # ... which the unbooked replay hid


def test_replay_on_conversations_keeps_hits_and_balance():
    """Multi-turn conversations (~14k-token prompts) at 8 replicas: near the hit bound and
    balanced; round robin (the baseline) is far below the bound; the overload term alone (the
    policy before the spread term) leaves one replica 14% over the mean."""
    trace = multi_turn_trace(num_conversations=200, turns=8, seed=1, turn_blocks=(1, 8), system_blocks=4)
    ours = _replay(trace, RouterPolicy(spread_weight=3.0), 8)
    assert ours.share_of_bound >= 0.95 and ours.load_max_mean <= 1.1, ours
    before = _replay(trace, RouterPolicy(spread_weight=0.0), 8)
    assert before.load_max_mean > 1.1, before  # measured 1.14 (ours 1.05)
    rr = _replay(trace, None, 8)
    assert rr.share_of_bound < 0.6, rr
    assert ours.hit_rate > rr.hit_rate


def test_replay_balances_long_conversations_at_64_replicas():
    """300 conversations of 12 turns over 64 replicas (~5 per replica: lumpy work). Measured:
    ours 0.960 of the bound with max/mean 1.107; the overload term alone 0.968 with 1.170. Not
    the 1.1 goal: since a conversation's last turn is subtracted exactly (the per-prompt ledger,
    which fixed the live repeated-prompt failure) rather than as the mean booked work, turns
    larger than the mean stay home more often and this trace went from 1.08 to 1.107 (over 12
    other seeds of two shapes: share +0.002, max/mean +0.009 on average)."""
    trace = multi_turn_trace(num_conversations=300, turns=12, seed=9, turn_blocks=(1, 4), system_blocks=2)
    ours = _replay(trace, RouterPolicy(spread_weight=3.0), 64)
    assert ours.share_of_bound >= 0.95 and ours.load_max_mean <= 1.12, ours
    before = _replay(trace, RouterPolicy(spread_weight=0.0), 64)
    assert before.load_max_mean > 1.15, before
    assert ours.load_max_mean <= before.load_max_mean - 0.05, (ours, before)


def test_spread_term_worked_example():
    """A new conversation (nothing cached), 10-block prompt, mean request 10 blocks, two
    replicas with equal recent work (50) but r0 is busy now (activity 10, weight 3):
    projected r0 = 80, r1 = 50, mean after = (130 + 10) / 2 = 70, price = 3 x 10 / 70 = 3/7;
    overload (hinge, both): 4 x 10 x (50 + 10 - 55) / 55 = 3.636.
    r0: 10 + 3/7 x (80 + 10 - 70) + 3.636 = 22.208
    r1: 10 + 3/7 x (50 + 10 - 70) + 3.636 = 9.351 -> r1 wins.
    If r0 caches 6 of the 10 blocks (its conversation's last turn ran there) and a request books
    10 blocks on average, that turn is r0's own activity: 10 - 10 = 0, projected r0 = r1 = 50,
    mean after 55, price 3 x 10 / 55 = 6/11; r0: 4 + 6/11 x (50 + 4 - 55) (hinge: under) = 3.455,
    r1: 10 + 6/11 x 5 + 3.636 = 16.364 -> r0 wins (counted as competing, r0 costs
    4 + 3/7 x 14 = 10 > 9.351 and the conversation leaves its cache)."""
    prompt = hash_full_blocks(list(range(10 * BLOCK)), block_size=BLOCK, root=ROOT)
    snaps = [snap("r0", 0), snap("r1", 0)]
    recent = {ReplicaId("r0"): 50.0, ReplicaId("r1"): 50.0}
    busy = {ReplicaId("r0"): 10.0, ReplicaId("r1"): 0.0}
    policy = RouterPolicy(load_weight=0.0, spread_weight=3.0)  # the opt-in spread term
    decision = policy.choose_prefill(snaps, prompt, PrefixIndex(), recent_work=recent, mean_request_blocks=10.0,
                                     activity=busy, mean_request_work=10.0)
    assert [(s.replica_id, round(s.cost, 3)) for s in decision.ranked] == [("r1", 9.351), ("r0", 22.208)]
    # Broken variant: without the activity forecast both look alike and the tie goes to r0.
    assert policy.choose_prefill(snaps, prompt, PrefixIndex(), recent_work=recent,
                                 mean_request_blocks=10.0).replica_id == "r0"
    index = PrefixIndex()
    index.add_blocks(ReplicaId("r0"), prompt[:6])
    kept = policy.choose_prefill(snaps, prompt, index, recent_work=recent, mean_request_blocks=10.0,
                                 activity=busy, mean_request_work=10.0)
    assert [(s.replica_id, round(s.cost, 3)) for s in kept.ranked] == [("r0", 3.455), ("r1", 16.364)]
    # Broken variant: counted as competing activity, the conversation's own turn pushes it off its cache.
    assert policy.choose_prefill(snaps, prompt, index, recent_work=recent, mean_request_blocks=10.0,
                                 activity=busy).replica_id == "r1"


def test_prefix_walk_is_bounded_and_exact_for_contiguous_caches():
    """Past EXACT_WALK_BLOCKS the walk bisects: equal to a full walk when every replica holds a
    contiguous prefix, with O(log n) lookups per distinct match length (a 6,000-block prompt,
    100k tokens at 16 per block, costs ~100 lookups instead of 6,000)."""
    import random

    from rayfleet.serving.routing.prefix_index import EXACT_WALK_BLOCKS

    class CountingDict(dict):
        lookups = 0

        def get(self, key, default=None):
            CountingDict.lookups += 1
            return super().get(key, default)

    rng = random.Random(0)
    chain = hash_full_blocks(list(range(6000 * BLOCK)), block_size=BLOCK, root=ROOT)
    for trial in range(40):
        index = PrefixIndex()
        index._hash_to_mask = CountingDict()
        num = rng.choice([10, EXACT_WALK_BLOCKS, EXACT_WALK_BLOCKS + 1, 300, 6000])
        lengths = {ReplicaId(f"r{i}"): rng.randint(0, num) for i in range(rng.randint(1, 8))}
        for rid, length in lengths.items():
            index.add_blocks(rid, chain[:length])
        CountingDict.lookups = 0
        assert index.match_prefix(chain[:num]) == {r: n for r, n in lengths.items() if n}
        assert CountingDict.lookups <= EXACT_WALK_BLOCKS + 2 * 14 * len(lengths) + 1, CountingDict.lookups
    # A hole inside the exact part still ends the match there (an evicted parent).
    index = PrefixIndex()
    index.add_blocks(ReplicaId("a"), chain[:200])
    index.remove_blocks(ReplicaId("a"), [chain[5]])
    assert index.match_prefix(chain[:200]) == {"a": 5}


def test_replay_refuses_empty_pools():
    with pytest.raises(SpecError):
        replay_routing([TraceRequest(0.0, 512, 1, (1,))], policy=None, num_replicas=0, cache_blocks=4)
