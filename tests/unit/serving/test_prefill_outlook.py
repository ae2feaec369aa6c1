"""The TTFT cost's inputs beyond the snapshots (``routing.prefill_outlook``): queues drained at the
measured rate between reports, later requests per prompt, and the ``later_s`` term they price."""

from __future__ import annotations

import pytest

from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint, report_time
from rayfleet.serving.routing.prefill_outlook import PrefillOutlook, QueuedWork
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.recent_work import FollowUpEstimate
from rayfleet.serving.routing.router import RouterCore
from rayfleet.serving.routing.ttft_cost import MAX_BUSY, TTFTPolicy

BLOCK = 16
ROOT = root_block_hash(model_id="tiny")


def blocks(*ids: int) -> list:
    return hash_full_blocks([t for i in ids for t in [i] * BLOCK], block_size=BLOCK, root=ROOT)


def test_queued_work_drains_at_the_replica_rate_between_reports():
    queue = QueuedWork()
    queue.report("r0", 3000.0, now_s=10.0)
    assert queue.ahead("r0", 10.0, rate=1000.0) == 3000.0
    assert queue.ahead("r0", 12.0, rate=1000.0) == pytest.approx(1000.0)  # 2 s at 1000 tok/s
    assert queue.ahead("r0", 20.0, rate=1000.0) == 0.0  # drained, never negative
    # A booking drains to its own time first, then adds: 1000 left at 12 s + 500 booked.
    queue.book("r0", 500.0, 12.0, rate=1000.0)
    assert queue.ahead("r0", 12.5, rate=1000.0) == pytest.approx(1000.0)
    # A report resets the fluid to the replica's own figure.
    queue.report("r0", 200.0, now_s=12.5)
    assert queue.ahead("r0", 12.5, rate=1000.0) == 200.0
    # Without a time (a caller with no clock) nothing drains; unknown replicas give the default.
    queue.report("r1", 700.0, now_s=None)
    assert queue.ahead("r1", 99.0, rate=1000.0) == 700.0
    assert queue.ahead("r2", 99.0, rate=1000.0, default=64.0) == 64.0


def test_follow_up_estimate_counts_later_turns_that_find_their_prompt_cached():
    est = FollowUpEstimate(memory_s=1e9)  # no decay: plain shares
    # 8-turn conversations: each turn extends the last; 1 in 8 requests starts a conversation.
    t = 0.0
    for conversation in range(40):
        chain = blocks(10_000 + 100 * conversation)
        for turn in range(8):
            est.add(chain, cached_blocks=len(chain), now=t)  # the whole prompt was cached somewhere
            chain = chain + blocks(10_000 + 100 * conversation + turn + 1)[-1:]
            t += 1.0
    assert est.expected(t) == pytest.approx(7.0)  # p = 7/8, p / (1 - p)
    # Where every turn's context was evicted before it came back, no turn is tied to a replica.
    evicted = FollowUpEstimate(memory_s=1e9)
    chain = blocks(1)
    for turn in range(8):
        evicted.add(chain, cached_blocks=0, now=float(turn))
        chain = chain + blocks(1, turn + 2)[-1:]
    assert evicted.expected(8.0) == 0.0
    # Single-turn traffic sharing a system prompt expects nothing either.
    single = FollowUpEstimate(memory_s=1e9)
    for i in range(20):
        single.add(blocks(1, 2, 1000 + i), cached_blocks=2, now=float(i))
    assert single.expected(20.0) == 0.0


def test_later_requests_worked_example():
    # Two idle replicas cache the same 2-block system prompt of an 8-block (128-token) prompt:
    # ttft = 96 tokens / 1000 tok/s = 96 ms on both. 3 later requests expected, pool mean
    # prefill 100 tokens, 10 s of memory. r0 was booked 4904 tokens: busy = (4904 + 96) / 10000
    # = 0.5, M/M/1 wait = 100 * 0.5 / 0.5 = 100 tokens, later_s = 3 * 100 / 1000 = 300 ms.
    # r1 was booked 904: busy = 0.1, wait = 11.1 tokens, later_s = 33.3 ms. r1 wins.
    prompt = blocks(1, 2, 3, 4, 5, 6, 7, 8)
    index = PrefixIndex()
    index.add_blocks(ReplicaId("r0"), prompt[:2])
    index.add_blocks(ReplicaId("r1"), prompt[:2] + blocks(9, 9, 9))  # r1 holds more: ties go to r0
    snaps = [ReplicaSnapshot(ReplicaId(r), 1000, 1000, 0) for r in ("r0", "r1")]
    rates = {"r0": 1000.0, "r1": 1000.0}
    policy = TTFTPolicy()

    def choose(booked: dict, follow_ups: float):
        return policy.choose_prefill(snaps, prompt, index, prefill_rate=rates, tokens_per_block=BLOCK,
                                     booked_prefill_tokens=booked, booked_memory_s=10.0,
                                     mean_prefill_tokens=100.0, follow_up_requests=follow_ups)

    decision = choose({"r0": 4904.0, "r1": 904.0}, 3.0)
    assert decision.replica_id == "r1"
    assert {s.replica_id: round(s.cost, 6) for s in decision.ranked} == {
        "r1": round(0.096 + 3 * (100 * 0.1 / 0.9) / 1000, 6), "r0": round(0.096 + 0.3, 6)}
    # Broken variant, the cost before: blind to later requests, the tie goes to r0, the busy one.
    assert choose({"r0": 4904.0, "r1": 904.0}, 0.0).replica_id == "r0"
    # Bounds: r0 booked past its rate is priced at MAX_BUSY, and a later request waits at most what
    # prefilling its whole context (128 tokens) elsewhere takes: 3 * 128 / 1000 s.
    saturated = choose({"r0": 50_000.0, "r1": 50_000.0}, 3.0)
    assert 100 * MAX_BUSY / (1 - MAX_BUSY) > 128
    assert saturated.ranked[0].cost == pytest.approx(0.096 + 3 * 0.128)


def test_router_core_drains_queues_and_learns_follow_ups():
    core = RouterCore(roles={"colocated": ["r0", "r1"]}, block_size=BLOCK, model_id="tiny")
    for r in ("r0", "r1"):
        core.prefill_rates.observe(r, 4000, 1.0)  # 4000 tok/s measured
    core.observe("r0", ReplicaSnapshot(ReplicaId("r0"), 1000, 1000, 0, num_queued_blocks=250), now_s=0.0)
    core.observe("r1", ReplicaSnapshot(ReplicaId("r1"), 1000, 1000, 0), now_s=0.0)
    rates = core.prefill_rates.rates(["r0", "r1"])
    inputs = core.outlook.cost_inputs([("r0", 4000.0), ("r1", 0.0)], rates, now_s=0.5)
    assert inputs["queued_tokens"]["r0"] == pytest.approx(4000.0 - 0.5 * rates["r0"])
    # A conversation's turns, each extending the last: the router learns they follow up.
    chain = blocks(1, 2)
    for turn in range(6):
        tokens = [0] * (len(chain) * BLOCK)
        core.route(tokens, max_tokens=8, block_hashes=chain, now_s=1.0 + turn)
        core.flush_bookings()
        chain = chain + blocks(1, 2, turn + 3)[-1:]
    assert core.outlook.follow_ups.expected(7.0) > 1.0
    # Without a clock the cost gets none of these inputs (the term is off, as before).
    assert core.outlook.cost_inputs([("r0", 0.0)], rates, now_s=None) == {}


def test_pool_router_books_the_same_inputs():
    core = PoolRouterCore(role="prefill", tokens_per_block=BLOCK)
    stats = {"version": 1, "num_total_blocks": 100, "num_free_blocks": 100, "num_active_blocks": 0,
             "num_queued_blocks": 10, "num_running_requests": 0, "max_num_seqs": 8}
    core.observe("a", stats, now_s=0.0)
    core.observe("b", {**stats, "num_queued_blocks": 0}, now_s=0.0)
    hashes = tuple(blocks(5, 6, 7))
    assert core.rank(["a", "b"], RouteHint(block_hashes=hashes, num_prompt_blocks=3), now_s=0.0)[0] == ["b"]
    assert core.outlook.booked.value("b", 0.0) == 3 * BLOCK
    assert isinstance(core.outlook, PrefillOutlook)
    # A second later, a's 160 queued tokens are done at the prior 4000 tok/s: a is as idle as b
    # and caches fewer blocks, so a new prompt goes there (undrained, a still looked busy).
    other = tuple(blocks(8, 9, 10))
    assert core.rank(["a", "b"], RouteHint(block_hashes=other, num_prompt_blocks=3), now_s=1.0)[0] == ["a"]


@pytest.mark.parametrize("age_s, stays_home", [(1.0, True), (0.0, False)])
def test_a_late_report_is_dated_when_the_replica_took_it(age_s, stays_home):
    """Tenant a's home publishes a report taken while a's first request was queued (4 blocks);
    the router reads it ``age_s`` later, just before a's second request. Dated when taken (1 s
    ago at 4000 tok/s: long drained) the queue is gone and a stays home; a report that is really
    current (age 0) does make the home busy, and a's 33 uncached tokens on the other replica are
    then sooner. Before ``taken_at`` every report was dated when read: the CI flake of the vLLM
    tier's tenant test, one of a's four requests on b's replica."""
    core = PoolRouterCore(role="colocated", policy=TTFTPolicy(step_token_budget=512), tokens_per_block=32)

    def stats(version, queued=0, running=0, taken_at=None):
        out = {"version": version, "num_total_blocks": 1000, "num_free_blocks": 1000 - queued,
               "num_active_blocks": 0, "num_queued_blocks": queued, "num_running_requests": running,
               "max_num_seqs": 8, "block_hashes": ()}
        return out if taken_at is None else {**out, "taken_at": taken_at}

    tenant_a = RouteHint(block_hashes=("a1", "a2"), num_prompt_blocks=4)
    tenant_b = RouteHint(block_hashes=("b1",), num_prompt_blocks=2)
    for replica in ("x", "y"):
        core.observe(replica, stats(0), now_s=0.0, wall_s=1000.0)
    (home,), _ = core.rank(["x", "y"], tenant_a, now_s=0.0)
    (other,), _ = core.rank(["x", "y"], tenant_b, now_s=1.0)
    assert other != home
    wall = 1002.0
    core.observe(home, stats(1, queued=4, running=1, taken_at=wall - age_s), now_s=2.0, wall_s=wall)
    assert core.rank(["x", "y"], tenant_a, now_s=2.0)[0] == [home if stays_home else other]


def test_report_time_subtracts_the_reports_age_and_never_dates_it_ahead():
    assert report_time(50.0, 1000.0, 998.5) == 48.5
    assert report_time(50.0, 1000.0, 1003.0) == 50.0  # the replica's clock ahead: dated now
    assert report_time(50.0, 1000.0, None) == 50.0  # a replica that does not say
    assert report_time(50.0, None, 998.5) == 50.0 and report_time(None, 1000.0, 998.5) is None


def test_trace_replay_gives_the_cost_what_the_live_router_gives_it(monkeypatch):
    """Regression: ``trace_replay.replay_routing`` called the TTFT cost without these inputs, so the
    replay measured a router the live one no longer was (64 replicas, C=200 T=10 conversations:
    requests max/mean 3.00 in the replay, 1.62 with the inputs, hit rate 0.8246 vs 0.8245)."""
    from rayfleet.serving.routing.trace_replay import multi_turn_trace, replay_routing

    seen = []
    original = PrefillOutlook.cost_inputs

    def spy(self, replicas, rates, now_s):
        inputs = original(self, replicas, rates, now_s)
        seen.append(inputs)
        return inputs

    monkeypatch.setattr(PrefillOutlook, "cost_inputs", spy)
    trace = multi_turn_trace(num_conversations=10, turns=4, seed=1)
    replay_routing(trace, policy=TTFTPolicy(), num_replicas=4, cache_blocks=64)
    assert len(seen) == len(trace) and seen[-1]["follow_up_requests"] > 0
