"""KV events drive the router's prefix index, live on the shared fleet (issue 30): a prompt's
blocks prefilled on replica r appear in the index as held by r, attract the prompt's follow-up
to r, and, once r's small KV pool has evicted them, stop being claimed on r within a bounded
time, so the prompt goes to the replica that really caches (part of) it.

Which router, and why this one: a deployed app routes inside every process that holds a handle
to the pool (``routing.request_router.PrefixLoadRequestRouter``, one instance per process, each
fed by the same routing stats the replicas publish with ``record_routing_stats``). The test
holds such a handle, so Serve builds the product's router in the test process, where its index
(``core.index``) and its choices can be read; the ingress's instance is another copy of the same
class, out of reach. Every prompt reaches its replica pinned (``RouteHint.replica``, which books
nothing) except the two whose routing is the point, so all the router knows of r's and s's caches
came from their engines' KV events: ``BlockPool`` (``BlockStored``/``BlockRemoved``) ->
``AsyncEngine.poll_state`` -> ``EngineReplica.record_routing_stats`` (``hash_log`` publisher) ->
Serve's controller -> ``HashSetMirror`` -> ``PrefixIndex``.

The built-in engine, tiny model, 2 colocated replicas of one H100 each (the fleet has 32), an
engine pool of 48 blocks of 16 tokens: one 40-block prompt evicts most of what was cached.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest
from live_helpers import free_port

from .conftest import wait_until

pytestmark = pytest.mark.cluster

APP = "test-kv-events"
MODEL = {"preset": "tiny", "seed": 7, "dtype": "float32", "overrides": {"max_seq_len": 1024}}
BLOCK = 16
ENGINE = {"block_size": BLOCK, "num_blocks": 48, "max_num_seqs": 4, "max_num_batched_tokens": 256}
PREFIX_BLOCKS = 16  # the prompt under test: 16 full blocks (P)
SHARED_BLOCKS = 15  # what the other replica caches of P (its first 15 blocks)
FILLER_BLOCKS = 40  # each filler prompt; three of them push every older block out of 48
EVICTION_DEADLINE_S = 15.0  # stats are published every 0.5 s; the rest is slack for a busy machine


def _spec() -> dict:
    from rayfleet.serving.spec import HttpSpec

    http = {"port": free_port(), "route_prefix": "/kv-events"}
    if "auth" in HttpSpec.model_fields:
        http["auth"] = "disabled"
    return {"name": APP, "model": MODEL, "engine": ENGINE, "mode": "colocated",
            "colocated": {"replicas": 2, "accelerators_per_replica": 1, "accelerator_type": "H100"},
            "http": http, "request_timeout_s": 60}


@pytest.fixture(scope="module")
def served(local_fleet):
    from ray import serve

    from rayfleet.serving.deployer import deploy

    app = deploy(_spec())
    try:
        yield app
    finally:
        app.shutdown()
        serve.shutdown()


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


class _Pool:
    """The colocated pool through a handle of the test process (see module doc): calls routed
    by the product's request router, hints built by the ingress's own ``PoolClient``."""

    def __init__(self, app_name: str) -> None:
        from ray import serve

        from rayfleet.serving.deploy.pool_client import PoolClient
        from rayfleet.serving.spec import ServeSpec

        self.handle = serve.get_deployment_handle("colocated", app_name=app_name)
        model_id = ServeSpec.parse(_spec()).engine_config().model_id
        self.client = PoolClient("colocated", self.handle, block_size=BLOCK, model_id=model_id, app_name=app_name)
        self.app_name = app_name

    def refresh(self) -> None:
        """One control call: the router reads every replica's latest published stats (its index
        learns their KV events) and routes the call to the least loaded one (no booking)."""
        from rayfleet.serving.routing.router import RouteHint

        self.handle.block_usage.remote(route=RouteHint()).result(timeout_s=30)

    @property
    def router(self):
        from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter

        router = PrefixLoadRequestRouter.for_deployment(self.app_name, "colocated")
        assert router is not None, "no request router in the test process (no call made yet?)"
        return router

    def hashes(self, prompt: list[int]) -> tuple:
        return self.client.prompt_hint(prompt, None).block_hashes

    def holders(self, block_hash) -> set[str]:
        """Replicas the router's index says cache ``block_hash``."""
        return set(self.router.core.index.match_prefix([block_hash]))

    def matched(self, prompt: list[int]) -> dict[str, int]:
        """Cached prefix length in blocks per replica, as the router's index has it."""
        return {str(r): n for r, n in self.router.core.index.match_prefix(list(self.hashes(prompt))).items()}

    def generate(self, prompt: list[int], *, pin: str | None = None) -> tuple[str, int]:
        """One greedy request (2 tokens): the replica that served it and its cached prompt tokens.
        Pinned to ``pin``, else routed by the prompt's hashes as the ingress routes it."""
        from rayfleet.serving.engine.sampling import SamplingParams
        from rayfleet.serving.routing.router import RouteHint

        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        route = RouteHint(replica=pin) if pin else self.client.prompt_hint(prompt, None, params.max_tokens)
        gen = self.handle.options(stream=True).generate.remote(f"kv-events-{uuid.uuid4().hex[:8]}", prompt,
                                                               params, None, route=route)
        chunks = list(gen)
        assert chunks and chunks[-1].finished, chunks
        return chunks[0].replica, chunks[0].num_cached_tokens


def test_an_evicted_prefix_stops_attracting_requests_in_the_live_routers_index(served):
    """(1) P prefilled on r (pinned) appears in the router's index on r, and only there, once r
    publishes its ``BlockStored`` events; (2) P plus a new tail, routed by its hashes, goes to r
    and hits 16 blocks there; s then caches P's first 15 blocks (pinned); (3) three 40-block
    fillers pinned to r overflow its 48-block pool, and within ``EVICTION_DEADLINE_S`` of the
    last one the index holds none of P's blocks on r (its ``BlockRemoved`` events) while s keeps
    its 15; P plus another tail then goes to s (15 blocks cached there, none on r: the TTFT cost
    of r is 17 blocks of prefill against 2 on s), and hits 15 blocks there; r's engine indeed
    recomputes P from scratch (the index agrees with the engine).

    Broken variants: a replica that publishes no events (or a router that does not apply them)
    fails (1): the index never shows P on r, and (2) would go by load, not by cache; an index
    that never drops removed blocks (``HashSetMirror`` ignoring a log entry's ``removed``, or the
    block pool not reporting evictions) fails (3): r keeps claiming all 16 blocks of P past the
    deadline (and would attract P: 1 block to prefill on r against 2 on s)."""
    pool = _Pool(served.name)

    def both_published():
        pool.refresh()
        stats = pool.router.replica_stats()
        return len(stats) == 2 and all("version" in st for st in stats.values())
    wait_until(both_published, timeout_s=60, interval_s=0.5, what="two replicas publishing routing stats")
    r, s = sorted(pool.router.replica_stats())  # the router's names for them: Serve replica ids

    prefix = _tokens(1, PREFIX_BLOCKS * BLOCK)
    p_hashes = pool.hashes(prefix)
    assert len(p_hashes) == PREFIX_BLOCKS
    assert pool.matched(prefix) == {}, "a fresh pool's index already holds the prompt"

    # (1) Prefilled on r: its stored events put every block of P on r, and nowhere else.
    assert pool.generate(prefix + [7] * 8, pin=r)[0] == r
    started = time.monotonic()

    def indexed_on_r():
        pool.refresh()
        return pool.matched(prefix) == {r: PREFIX_BLOCKS}
    wait_until(indexed_on_r, timeout_s=EVICTION_DEADLINE_S, interval_s=0.2,
               what=f"P's {PREFIX_BLOCKS} blocks in the router's index on {r} (BlockStored events)")
    print(f"stored -> index: {time.monotonic() - started:.2f} s")
    assert all(pool.holders(h) == {r} for h in p_hashes)

    # (2) A follow-up sharing P is attracted to r, where the engine reuses all of P.
    replica, cached = pool.generate(prefix + _tokens(2, 8))
    assert (replica, cached) == (r, PREFIX_BLOCKS * BLOCK), (replica, cached, r, s)

    # s caches P's first 15 blocks: after the eviction, the only real cache of P.
    shared = prefix[:SHARED_BLOCKS * BLOCK] + _tokens(3, 8)
    assert pool.generate(shared, pin=s)[0] == s
    wait_until(lambda: (pool.refresh(), pool.matched(prefix).get(s) == SHARED_BLOCKS)[1],
               timeout_s=EVICTION_DEADLINE_S, interval_s=0.2, what=f"P's first blocks in the index on {s}")
    assert pool.matched(prefix) == {r: PREFIX_BLOCKS, s: SHARED_BLOCKS}

    # (3) Fillers overflow r's pool: its removed events take P off r in the index, promptly.
    for seed in (10, 11, 12):
        assert pool.generate(_tokens(seed, FILLER_BLOCKS * BLOCK), pin=r)[0] == r
    evicted = time.monotonic()

    def dropped_from_r():
        pool.refresh()
        return not any(r in pool.holders(h) for h in p_hashes)
    try:
        wait_until(dropped_from_r, timeout_s=EVICTION_DEADLINE_S, interval_s=0.2,
                   what=f"P's blocks to leave {r} in the router's index (BlockRemoved events)")
    except AssertionError as exc:
        still = sum(r in pool.holders(h) for h in p_hashes)
        raise AssertionError(f"{exc}; still on r: {still} of {PREFIX_BLOCKS} blocks, "
                             f"matched: {pool.matched(prefix)}") from None
    print(f"removed -> index: {time.monotonic() - evicted:.2f} s")
    assert pool.matched(prefix) == {s: SHARED_BLOCKS}  # s's cache untouched, r's gone

    # No longer attracted to r: P with a new tail goes to s, which serves 15 blocks from cache.
    replica, cached = pool.generate(prefix + _tokens(4, 8))
    assert (replica, cached) == (s, SHARED_BLOCKS * BLOCK), (replica, cached, r, s)
    # The index agrees with the engine: r really evicted P (it recomputes all of it).
    assert pool.generate(prefix + _tokens(5, 8), pin=r) == (r, 0)
