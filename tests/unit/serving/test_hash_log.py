"""Replica block hashes published as a bounded log plus a periodic full set (``routing.hash_log``),
mirrored by ``PoolRouterCore``: deltas equal the full set, missed publications are caught up,
an emptied cache or a restarted replica clears stale entries, and a publication's size is
bounded by the log, not the cache. Also: the routed prompt is indexed off the decision path."""

from __future__ import annotations

import pickle
import random

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
from rayfleet.serving.engine.replica_state import ReplicaId

SNAP = {"num_total_blocks": 1000, "num_free_blocks": 1000, "num_active_blocks": 0, "num_queued_blocks": 0}


class Replica:
    """A replica's cache driven by random store/evict events, publishing like ``EngineReplica``."""

    def __init__(self, seed: int, **kwargs) -> None:
        self.rng = random.Random(seed)
        self.pub = HashLogPublisher(**kwargs)
        self.version = 0
        self.now_s = 0.0

    def step(self, num_events: int = 3) -> None:
        events = []
        for _ in range(num_events):
            stored = tuple(self.rng.randbytes(16) for _ in range(self.rng.randint(0, 6)))
            cached = sorted(self.pub.cached | set(stored))
            removed = tuple(self.rng.sample(cached, min(len(cached), self.rng.randint(0, 5))))
            events.append(KVCacheEvent(stored=stored, removed=removed))
        self.pub.apply(events)

    def publish(self, dt_s: float = 0.5) -> dict:
        self.now_s += dt_s
        self.version += 1
        return {"version": self.version, **SNAP, **self.pub.fields(self.now_s)}


def indexed(core: PoolRouterCore, rid: str) -> set:
    return set(core.index._replica_to_hashes.get(ReplicaId(rid), set()))


def test_deltas_applied_in_order_equal_the_full_set():
    replica = Replica(0, max_log_hashes=64, full_period_s=1e9)  # one full set, then deltas only
    core = PoolRouterCore(role="prefill")
    sizes = []
    for _ in range(300):
        replica.step()
        stats = replica.publish()
        sizes.append("block_hashes" in stats)
        core.observe("r", stats)
        assert indexed(core, "r") == replica.pub.cached
    assert sizes.count(True) == 1 and len(replica.pub.cached) > 100


def test_a_consumer_that_missed_publications_catches_up():
    replica = Replica(1, max_log_hashes=80, full_period_s=10.0)  # 2 steps hold <= 66
    near, far = PoolRouterCore(role="prefill"), PoolRouterCore(role="prefill")
    fell_behind = resynced = 0
    for i in range(400):
        replica.step()
        stats = replica.publish()
        if i % 2 == 0:  # misses every other publication: the log still covers the gap
            near.observe("r", stats)
            assert indexed(near, "r") == replica.pub.cached
        if i % 9 == 0 or "block_hashes" in stats:  # misses more than the log holds
            far.observe("r", stats)
            # Never a claim the replica evicted, however much it missed.
            assert indexed(far, "r") <= replica.pub.cached
            if "block_hashes" in stats:
                assert indexed(far, "r") == replica.pub.cached  # exact again at each full set
                resynced += 1
            fell_behind += not far.hashes.in_step(ReplicaId("r"))
    assert fell_behind and resynced > 5  # it did fall behind the log (else this proves nothing)


def test_a_consumer_behind_the_log_drops_evicted_blocks_and_recovers_at_the_next_full_set():
    replica = Replica(2, max_log_hashes=8, full_period_s=5.0)
    core = PoolRouterCore(role="prefill")
    gone = tuple(replica.rng.randbytes(16) for _ in range(4))
    kept = tuple(replica.rng.randbytes(16) for _ in range(4))
    replica.pub.apply([KVCacheEvent(stored=gone + kept)])
    core.observe("r", replica.publish())
    assert set(gone + kept) == indexed(core, "r")
    replica.pub.apply([KVCacheEvent(removed=gone)])
    replica.publish()  # missed
    replica.pub.apply([KVCacheEvent(stored=(replica.rng.randbytes(16),)) for _ in range(20)])
    replica.publish()  # missed; the next one drops the removal from the log
    stats = replica.publish()
    assert "block_hashes" not in stats and stats["hash_log_start"] > 1
    core.observe("r", stats)
    # Broken variant (keep what it knew, apply the log): ``gone`` would stay claimed.
    assert not set(gone) & indexed(core, "r") and indexed(core, "r") <= replica.pub.cached
    assert not set(kept) & indexed(core, "r") and not core.hashes.in_step(ReplicaId("r"))  # the price
    while "block_hashes" not in (stats := replica.publish()):
        core.observe("r", stats)
    core.observe("r", stats)
    assert indexed(core, "r") == replica.pub.cached and set(kept) <= indexed(core, "r")
    assert core.hashes.in_step(ReplicaId("r"))


def test_an_emptied_cache_or_a_restarted_replica_clears_stale_entries_at_once():
    replica = Replica(3, full_period_s=1e9)
    core = PoolRouterCore(role="prefill")
    for _ in range(20):
        replica.step()
        core.observe("r", replica.publish())
    old_epoch = replica.pub.epoch
    replica.pub.apply([KVCacheEvent(removed=tuple(replica.pub.cached))])  # reset_prefix_cache
    assert replica.pub.epoch != old_epoch and replica.pub.seq == 0
    stats = replica.publish()
    assert "block_hashes" not in stats and len(pickle.dumps(stats)) < 1000  # no cache-sized event
    core.observe("r", stats)
    assert indexed(core, "r") == set()
    replica.step()
    core.observe("r", replica.publish())
    assert indexed(core, "r") == replica.pub.cached
    # Restart under the same name: a new process, a new epoch, nothing of the old cache kept.
    restarted = Replica(4, full_period_s=1e9)
    restarted.now_s, restarted.version = replica.now_s, replica.version
    restarted.pub._last_full_s = 0.0  # its first full set is not here yet: the log must suffice
    restarted.step()
    core.observe("r", restarted.publish())
    assert indexed(core, "r") == restarted.pub.cached


def test_publication_size_is_bounded_by_the_log_not_the_cache():
    def delta_bytes(num_cached: int) -> int:
        pub = HashLogPublisher(max_log_hashes=256, full_period_s=10.0)
        rng = random.Random(num_cached)
        cached = [rng.randbytes(16) for _ in range(num_cached)]
        pub.apply([KVCacheEvent(stored=tuple(cached))])
        pub.fields(0.0)  # the first publication carries the full set
        for i in range(100):  # a publication per stats period
            new = tuple(rng.randbytes(16) for _ in range(8))
            pub.apply([KVCacheEvent(stored=new), KVCacheEvent(removed=tuple(cached[8 * i:8 * i + 8]))])
            fields = pub.fields(1.0 + 0.01 * i)
        assert "block_hashes" not in fields
        assert sum(len(s) + len(r) for _, s, r in fields["hash_log"]) <= 256 + 16  # + one period's events
        return len(pickle.dumps(fields))

    small, large = delta_bytes(2_000), delta_bytes(50_000)
    assert large < 1.2 * small and large < 20_000  # 25x the cache, the same publication
    full = HashLogPublisher()
    full.apply([KVCacheEvent(stored=tuple(random.Random(0).randbytes(16) for _ in range(50_000)))])
    assert len(pickle.dumps(full.fields(0.0))) > 40 * large  # what every publication used to be


def test_routed_prompt_is_indexed_after_the_decision_and_dropped_unless_published():
    replica = Replica(5, full_period_s=1e9)
    # The block-unit cost keeps a burst of one prompt together; the TTFT cost would rightly send
    # the repeat to the idle replica (its 9 queued blocks cost more than 9 blocks of prefill).
    core = PoolRouterCore(role="prefill", policy=RouterPolicy())
    core.observe("r", replica.publish())
    core.observe("s", {"version": 1, **SNAP})
    prompt = tuple(bytes([i]) * 16 for i in range(8))
    first = core.rank(["r", "s"], RouteHint(block_hashes=prompt, num_prompt_blocks=9))[0][0]
    assert core.index.match_prefix(list(prompt)) == {}  # not indexed on the decision path
    core.flush_bookings()
    assert core.index.match_prefix(list(prompt)) == {ReplicaId(first): 8}
    # The next rank runs a pending flush first, so a burst of one prompt still sticks together.
    assert core.rank(["r", "s"], RouteHint(block_hashes=prompt, num_prompt_blocks=9))[0][0] == first
    # The replica publishes without them (it never cached them): the booking goes.
    if first == "r":
        replica.step()
        core.observe("r", replica.publish())
    else:
        core.observe("s", {"version": 2, **SNAP})
    assert core.index.match_prefix(list(prompt)) == {}


def test_a_publication_taken_before_the_routed_request_arrived_keeps_the_booking_for_the_grace():
    """Serve delivers a replica's stats some time after the replica took them: a whole-set
    publication (the Serve LLM pools' text blocks) that predates the routed request must not
    unbook it, or the tenant's next request goes elsewhere (seen live). Past the grace, a
    publication that still lacks the blocks drops them (the request never cached them)."""
    a_prefix = tuple(bytes([1, i]) * 8 for i in range(10))  # tenant a's prompts are longer (as live)
    b_prefix = tuple(bytes([2, i]) * 8 for i in range(4))
    old = {"num_running_requests": 0, "max_num_seqs": 8, **SNAP}

    def route(core: PoolRouterCore, prefix: tuple, t: float, order: tuple = ("r", "s")) -> str:
        return core.rank(list(order), RouteHint(block_hashes=prefix, num_prompt_blocks=len(prefix) + 1), now_s=t)[0][0]

    for grace, kept in ((10.0, True), (0.0, False)):
        core = PoolRouterCore(role="colocated", booking_grace_s=grace)
        for name in ("r", "s"):
            core.observe(name, {"version": 1, "block_hashes": (), **old}, 0.0)
        first_a, first_b = route(core, a_prefix, 1.0), route(core, b_prefix, 2.0)
        assert first_a != first_b  # the load term spreads the two tenants
        core.flush_bookings()
        # Both replicas' next publications were taken before the requests arrived (empty sets).
        for name in ("r", "s"):
            core.observe(name, {"version": 2, "block_hashes": (), **old}, 2.5)
        assert core.index.match_prefix(list(a_prefix)) == ({ReplicaId(first_a): 10} if kept else {})
        if kept:  # each tenant back to its replica, whichever candidate Serve lists first
            again = [route(core, p, 3.0 + i, order=(first_b, first_a)) for i, p in enumerate((a_prefix, b_prefix))]
            assert again == [first_a, first_b], again
    # Past the grace, an unconfirmed booking goes.
    core = PoolRouterCore(role="colocated", booking_grace_s=5.0)
    core.observe("r", {"version": 1, "block_hashes": (), **old}, 0.0)
    route(core, a_prefix, 1.0)
    core.flush_bookings()
    core.observe("r", {"version": 2, "block_hashes": (), **old}, 3.0)
    assert core.index.match_prefix(list(a_prefix)) == {ReplicaId("r"): 10}
    core.observe("r", {"version": 3, "block_hashes": (), **old}, 6.5)
    assert core.index.match_prefix(list(a_prefix)) == {}
    # A publication that holds them confirms them for good.
    route(core, a_prefix, 7.0)
    core.flush_bookings()
    core.observe("r", {"version": 4, "block_hashes": a_prefix, **old}, 7.5)
    core.observe("r", {"version": 5, "block_hashes": a_prefix, **old}, 100.0)
    assert core.index.match_prefix(list(a_prefix)) == {ReplicaId("r"): 10}
    with pytest.raises(SpecError, match="booking_grace_s"):
        PoolRouterCore(role="prefill", booking_grace_s=-1)


def test_bad_publisher_settings_are_spec_errors():
    with pytest.raises(SpecError, match="max_log_hashes"):
        HashLogPublisher(max_log_hashes=0)
    with pytest.raises(SpecError, match="full_period_s"):
        HashLogPublisher(full_period_s=0)


def test_a_real_engines_events_published_as_a_log_mirror_its_prefix_cache(tiny_model):
    """Hashes agree end to end: an engine evicting under pressure, then resetting its prefix
    cache, publishes through ``HashLogPublisher`` (as ``EngineReplica.record_routing_stats``)
    and a router's mirror equals the engine's cached hashes after every publication."""
    from rayfleet.serving.engine.engine_config import EngineConfig
    from rayfleet.serving.engine.llm_engine import LLMEngine
    from rayfleet.serving.engine.sampling import SamplingParams

    engine = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=16, enable_kv_events=True, model_id="tiny"))
    pub = HashLogPublisher(max_log_hashes=6, full_period_s=1e9)
    in_step, behind = PoolRouterCore(role="prefill"), PoolRouterCore(role="prefill")
    rng = random.Random(7)
    for version in range(12):
        prompt = [rng.randrange(3, 250) for _ in range(rng.choice((9, 17, 25)))]
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
        if version == 8:
            assert engine.block_pool.reset_prefix_cache()
        pub.apply(engine.take_kv_events())
        stats = {"version": version, **SNAP, **pub.fields(float(version))}
        in_step.observe("e0", stats)
        truth = set(engine.block_pool._hash_to_block)
        assert indexed(in_step, "e0") == truth == pub.cached
        if version % 4 == 3:  # reads a third of the publications: behind the 6-hash log
            behind.observe("e0", stats)
            assert indexed(behind, "e0") <= truth
    assert pub.epoch.endswith(":1")  # the reset started an epoch


def test_a_call_without_a_prompt_goes_to_the_least_loaded_replica_and_books_nothing():
    core = PoolRouterCore(role="prefill")
    core.observe("busy", {"version": 1, **SNAP, "num_queued_blocks": 50})
    core.observe("idle", {"version": 1, **SNAP})
    assert core.rank(["busy", "idle"], RouteHint(), now_s=1.0) == [["idle"], ["busy"]]
    assert core.snapshots["idle"].num_queued_blocks == 0 and core.recent_work.value("idle", 1.0) == 0
