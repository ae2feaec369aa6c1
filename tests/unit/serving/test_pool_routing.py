"""Pools as Serve deployments, the Ray-free parts: ``PoolRouterCore`` ranking replicas from
their published routing stats (prefix + load, P/D decode by free KV, booking between
publications, pins, avoided replicas), the autoscaling bounds clamp, failed-replica memory and
vLLM's finished_reason labels."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.deploy.pool_client import FailedReplicas
from rayfleet.serving.deploy.pool_scaling import clamp_to_bounds
from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.deploy.serving_metrics import ServingMetrics, finished_reason_label
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint

BLOCK = 4
PROMPT = list(range(1, 33))  # 8 full blocks
HASHES = tuple(hash_full_blocks(PROMPT, block_size=BLOCK, root=root_block_hash(model_id="tiny")))


def stats(version: int, *, free: int = 100, active: int = 0, queued: int = 0, hashes=(), running: int = 0) -> dict:
    return {"version": version, "num_total_blocks": 100, "num_free_blocks": free, "num_active_blocks": active,
            "num_queued_blocks": queued, "num_running_requests": running, "max_num_seqs": 8,
            "block_hashes": tuple(hashes)}


def hint(hashes=HASHES) -> RouteHint:
    return RouteHint(block_hashes=tuple(hashes), num_prompt_blocks=len(hashes) + 1, num_blocks_needed=12)


def test_prefill_pool_ranks_the_replica_that_published_the_prefix_first():
    core = PoolRouterCore(role="prefill", policy=RouterPolicy(load_weight=0.5))
    core.observe("a", stats(1))
    core.observe("b", stats(1, hashes=HASHES))
    assert core.rank(["a", "b"], hint()) == [["b"], ["a"]]
    # Its publication drops the prefix (evicted): the booked copy is dropped too, "a" is idle.
    core.observe("b", stats(2, hashes=(), queued=40))
    assert core.rank(["a", "b"], hint())[0] == ["a"]


def test_same_version_is_not_reapplied_so_bookings_survive_until_the_next_publication():
    core = PoolRouterCore(role="prefill")
    for r in ("a", "b"):
        core.observe(r, stats(1))
    firsts = Counter(core.rank(["a", "b"], hint(tuple(hash_full_blocks([i] * 32, block_size=BLOCK,
                                                                       root=root_block_hash())))) [0][0]
                     for i in range(10))
    assert firsts == {"a": 5, "b": 5}  # booked queue alternates distinct prompts
    assert not core.observe("a", stats(1))  # same version: no reset of the booked load
    assert core.snapshots["a"].num_queued_blocks > 0
    # Broken variant: re-applying the publication before every route sends the burst to one replica.
    frozen = PoolRouterCore(role="prefill")
    picks = set()
    for i in range(10):
        for r in ("a", "b"):
            frozen.versions.pop(r, None)
            frozen.hashes.forget(r)
            frozen.observe(r, stats(1))
        picks.add(frozen.rank(["a", "b"], hint(tuple(hash_full_blocks([i] * 32, block_size=BLOCK,
                                                                        root=root_block_hash()))))[0][0])
    assert picks == {"a"}


def test_decode_pool_ranks_by_free_kv_and_books_the_request():
    core = PoolRouterCore(role="decode")
    core.observe("d0", stats(1, free=30))
    core.observe("d1", stats(1, free=90))
    assert core.rank(["d0", "d1"], RouteHint(num_blocks_needed=50)) == [["d1"], ["d0"]]
    assert core.snapshots["d1"].num_free_blocks == 40 and core.snapshots["d1"].num_running_requests == 1
    assert core.rank(["d0", "d1"], RouteHint(num_blocks_needed=35)) == [["d1"], ["d0"]]  # d0 lacks 35
    assert core.rank(["d0", "d1"], RouteHint(num_blocks_needed=20))[0] == ["d0"]  # now d0 has more room


def test_pins_avoids_unknown_replicas_and_departures():
    core = PoolRouterCore(role="prefill")
    core.observe("a", stats(1, hashes=HASHES))
    core.observe("b", stats(1))
    assert core.rank(["a", "b"], RouteHint(replica="b")) == [["b"]]
    assert core.rank(["a", "b"], RouteHint(replica="gone")) == []  # the caller falls back; the replica refuses
    assert core.rank(["a", "b"], RouteHint(block_hashes=HASHES, num_prompt_blocks=9, avoid=("a",))) == [["b"]]
    assert core.rank(["a"], RouteHint(block_hashes=HASHES, num_prompt_blocks=9, avoid=("a",))) == [["a"]]
    # A replica that has not published yet is ranked (as roomy as the others), not skipped.
    assert sorted(t[0] for t in core.rank(["a", "b", "new"], hint())) == ["a", "b", "new"]
    core.retain(["b"])  # "a" left the pool: its prefix is forgotten
    assert "a" not in core.snapshots and "a" not in core.index.match_prefix(list(HASHES))


def test_round_robin_mode_rotates_and_a_bad_role_is_a_spec_error():
    core = PoolRouterCore(role="colocated", mode="round_robin")
    assert [core.rank(["a", "b", "c"], hint())[0][0] for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(SpecError, match="role"):
        PoolRouterCore(role="router")


def test_bounds_clamp_serve_rule_and_hold_the_floor_without_bounds():
    assert clamp_to_bounds(3.4, current=1, bounds=(1, 8), base=1) == 4
    assert clamp_to_bounds(3.4, current=1, bounds=(1, 2), base=1) == 2  # the shared autoscaler's ceiling
    assert clamp_to_bounds(0.0, current=3, bounds=(3, 3), base=1) == 3  # a lent replica is kept
    assert clamp_to_bounds(9.0, current=1, bounds=None, base=1) == 1  # no bounds: the spec's replicas


def test_failed_replicas_are_avoided_for_a_while():
    now = [0.0]
    failed = FailedReplicas(avoid_s=10, clock=lambda: now[0])
    failed.add("r1")
    now[0] = 5
    failed.add("r2")
    assert failed.current() == ("r1", "r2")
    now[0] = 12
    assert failed.current() == ("r2",)


def test_finished_reason_uses_vllm_label_values():
    assert [finished_reason_label(r) for r in ("stop", "length", None, "abort", "error")] == \
        ["stop", "length", "abort", "abort", "abort"]
    metrics = ServingMetrics("tiny")
    metrics.observe_end(0.1, 3, 2, "stop")
    metrics.observe_end(0.1, 3, 2, "length")
    metrics.observe_end(0.1, 3, 0, None)
    text = metrics.render({}).decode()
    for reason in ("stop", "length", "abort"):
        assert f'rayfleet:request_success_total{{finished_reason="{reason}",model_name="tiny"}} 1.0' in text
    assert "finished_reason=\"finished\"" not in text


def test_a_replica_that_joins_starts_at_its_peers_recent_work_and_a_repeat_stays_on_its_cache():
    """A restarted replica (new id) must not draw requests away from the replica caching them
    because its ledger is empty: it joins at its peers' mean. Broken variant: started at 0, the
    newcomer looks idle against the survivor's history."""
    from rayfleet.serving.routing.recent_work import RecentWorkLedger

    ledger = RecentWorkLedger(300.0)
    ledger.add("a", 90.0, now=0.0)
    ledger.add("c", 30.0, now=10.0)
    ledger.join("b", ["a", "c"])
    expected = (90.0 * math.exp(-10.0 / 300.0) + 30.0) / 2
    assert ledger.value("b", 10.0) == pytest.approx(expected)
    ledger.join("b", ["a"])  # already known: unchanged
    assert ledger.value("b", 10.0) == pytest.approx(expected)
    fresh = RecentWorkLedger(300.0)
    fresh.join("x", ["y"])  # no peer history: nothing to join
    assert fresh.value("x", 0.0) == 0.0

    def stays_on_its_cache_after_a_restart(join: bool) -> list[bool]:
        # The ledgers are the block-unit cost's input (the TTFT cost reads none): pin that cost.
        core = PoolRouterCore(role="prefill", policy=RouterPolicy())
        core.observe("a", stats(1))
        core.observe("c", stats(1))
        t = 0.0
        for i in range(30):  # history: distinct prompts over both replicas
            h = tuple(hash_full_blocks([i + 100] * 32, block_size=BLOCK, root=root_block_hash(model_id="tiny")))
            core.rank(["a", "c"], hint(h), now_s=t)
            core.flush_bookings()
            t += 0.5
        prompt = tuple(hash_full_blocks(list(range(200, 264)), block_size=BLOCK, root=root_block_hash(model_id="tiny")))
        core.rank(["a", "c"], hint(prompt), now_s=t)  # the prompt is cached on one of them
        core.flush_bookings()
        holder = "a" if core.index.match_prefix(prompt).get("a") else "c"
        core.retain([holder])  # the other one is killed; "b" replaces it
        if not join:
            core.recent_work.join = core.activity.join = lambda *a, **k: None
        core.observe("b", stats(1))
        core.observe(holder, stats(2, hashes=prompt, running=1))  # a busy pool: the ledgers count
        stays = []
        for version in range(3, 6):
            t += 1.5
            stays.append(core.rank([holder, "b"], hint(prompt), now_s=t)[0][0] == holder)
            core.flush_bookings()
            core.observe(holder, stats(version, hashes=prompt, running=1))
        return stays

    assert stays_on_its_cache_after_a_restart(True) == [True] * 3
    assert stays_on_its_cache_after_a_restart(False) != [True] * 3  # the broken variant is caught


def test_a_repeated_long_prompt_stays_on_its_cache_when_the_router_sees_its_own_bookings():
    """The live failure (tests/cluster/test_serving.py, disaggregated app, spread term on): a
    24-block prompt, then the same prompt three times. Between publications (Serve's controller
    relays them every ~0.5 s or later) the router's snapshot of the chosen replica still holds the
    blocks it booked there, so the pool looks busy and the ledgers count; the home's activity
    ledger holds the prompt's own first turn (24 blocks), and the old stand-in for a
    conversation's own turn, the pool's mean booked work per request (~5 blocks here, and lower
    with every repeat, each booking 1 block), left ~19 of them counted as competing activity,
    priced per mean request (which grows with each 25-block repeat): the third repeat left its
    cache. The per-prompt ledger subtracts what this prompt itself booked there."""
    from rayfleet.serving.routing.recent_work import PrefixWorkLedger

    block = 8

    def h(tokens) -> tuple:
        return tuple(hash_full_blocks(tokens, block_size=block, root=root_block_hash(model_id="tiny")))

    def run(own_ledger: bool) -> list[bool]:
        core = PoolRouterCore(role="prefill", policy=RouterPolicy(spread_weight=3.0))
        if not own_ledger:  # the broken variant: no per-prompt bookings, the mean stands in
            core.own_activity.own = lambda *a, **k: {}
        for r in ("a", "b"):
            core.observe(r, stats(1))
        t = 0.0
        for i, blocks in enumerate((12, 4, 1, 12, 4, 1, 4, 12, 4, 4, 2)):  # the earlier tests' prompts
            tokens = [1000 + i] * (blocks * block - 3)
            core.rank(["a", "b"], RouteHint(block_hashes=h(tokens), num_prompt_blocks=blocks), now_s=t)
            core.flush_bookings()
            t += 2.0
        prompt = list(range(1, 194))  # 24 full blocks and a partial one
        long_hint = RouteHint(block_hashes=h(prompt), num_prompt_blocks=25)
        home = core.rank(["a", "b"], long_hint, now_s=t)[0][0]
        core.flush_bookings()
        t += 1.5  # the test's sleep; no publication has reached the router yet
        stays = []
        for _ in range(5):
            stays.append(core.rank(["a", "b"], long_hint, now_s=t)[0][0] == home)
            core.flush_bookings()
            t += 0.1
        return stays

    assert run(True) == [True] * 5
    assert run(False) != [True] * 5  # the broken variant is caught (measured: the third repeat left)
    ledger = PrefixWorkLedger(30.0)
    turn1 = h(list(range(1, 41)))  # 5 blocks
    ledger.add("a", turn1, 5.0, now=0.0)
    ledger.add("b", h([7] * 16 + list(range(100, 124))), 9.0, now=0.0)  # another conversation
    turn2 = h(list(range(1, 81)))  # extends turn 1
    own = ledger.own(turn2, {"a": 5, "b": 2}, now=30.0)
    assert own == {"a": pytest.approx(5.0 * math.exp(-1.0))}  # decayed; b's prompt is not a prefix of it
    assert ledger.own(turn2, {"a": 4}, now=0.0) == {}  # a caches less than turn 1: not its booking
    small = PrefixWorkLedger(30.0, max_entries=1)
    small.add("a", turn1, 5.0, now=0.0)
    small.add("a", turn2, 5.0, now=0.0)  # evicts turn 1 (least recently booked)
    assert small.own(turn2, {"a": 10}, now=0.0) == {"a": 5.0}
