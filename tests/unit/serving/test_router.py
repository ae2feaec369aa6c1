"""RouterCore: prefix-aware ranking fed by KV events, booking of routed work between polls,
round robin as the baseline, unhealthy replicas excluded and re-admitted."""

from __future__ import annotations

from collections import Counter

from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.router import RouterCore
from rayfleet.serving.routing.policy import RouterPolicy

BLOCK = 4
SHARED = list(range(1, 33))  # 8 full blocks


def core(mode="prefix_aware", **roles) -> RouterCore:
    roles = roles or {"prefill": ["p0", "p1"], "decode": ["d0", "d1"]}
    return RouterCore(roles=roles, policy=RouterPolicy(load_weight=0.5), mode=mode, block_size=BLOCK,
                      model_id="tiny", num_blocks_hint=100)


def snap(name: str, *, free: int = 100, active: int = 0, queued: int = 0) -> ReplicaSnapshot:
    return ReplicaSnapshot(ReplicaId(name), 100, free, active, queued)


def test_prompt_goes_where_its_prefix_is_cached_per_kv_events():
    r = core()
    cached = hash_full_blocks(SHARED, block_size=BLOCK, root=root_block_hash(model_id="tiny"))
    r.observe("p1", snap("p1"), [KVCacheEvent(stored=tuple(cached))])
    plan = r.route(SHARED + [99], max_tokens=4)
    assert plan.first[0] == "p1" and "longest cached prefix" in plan.reason
    # A different salt is a different hash chain: no hit, tie broken by name.
    assert core().route(SHARED + [99], max_tokens=4, cache_salt="tenant-b").first[0] == "p0"


def test_burst_between_polls_is_spread_by_booked_load():
    r = core()
    firsts = Counter(r.route([i] * 40 + [7], max_tokens=8).first[0] for i in range(10))
    assert firsts["p0"] == 5 and firsts["p1"] == 5  # booking alternates distinct prompts
    decodes = Counter(r.route([50 + i] * 40, max_tokens=8).decode[0] for i in range(10))
    assert decodes["d0"] == 5 and decodes["d1"] == 5
    # Broken variant: without booking every request of the burst would land on p0.
    frozen = core()
    picks = set()
    for i in range(10):
        picks.add(frozen.route([i] * 40, max_tokens=8).first[0])
        frozen.observe("p0", snap("p0"))
        frozen.observe("p1", snap("p1"))
        frozen.index.remove_replica(ReplicaId("p0"))
        frozen.index.remove_replica(ReplicaId("p1"))
    assert picks == {"p0"}


def test_shared_prefix_fans_out_once_its_replica_is_loaded():
    r = core()
    prompt = SHARED + [5]
    first = r.route(prompt, max_tokens=4).first[0]
    r.observe(first, snap(first, active=60))  # now busy decoding
    assert r.route(prompt, max_tokens=4).first[0] != first


def test_decode_prefers_free_blocks():
    r = core()
    r.observe("d0", snap("d0", free=10))
    r.observe("d1", snap("d1", free=80))
    assert r.route([1, 2, 3], max_tokens=8).decode[0] == "d1"


def test_round_robin_cycles_and_ignores_prefixes():
    r = core("round_robin", colocated=["c0", "c1", "c2"])
    cached = hash_full_blocks(SHARED, block_size=BLOCK, root=root_block_hash(model_id="tiny"))
    r.observe("c2", snap("c2"), [KVCacheEvent(stored=tuple(cached))])
    assert [r.route(SHARED, max_tokens=1).first[0] for _ in range(4)] == ["c0", "c1", "c2", "c0"]
    assert r.route(SHARED, max_tokens=1).decode == ()


def test_unhealthy_replicas_are_skipped_until_a_poll_succeeds():
    r = core()
    r.mark_unhealthy("p0")
    assert r.route([1] * 9, max_tokens=2).first == ("p1",)
    assert r.route([1] * 9, max_tokens=2, exclude=("p1",)).first == ()
    r.observe("p0", snap("p0"))
    assert "p0" in r.route([2] * 9, max_tokens=2).first


def test_serving_shells_import_ray_only_inside_functions():
    """Router, service, engine loop, transports and the app load without Ray (unit tests, the
    benchmark's pure part); only ``deploy.deployments``, ``openai_api.serve_app`` and ``deployer`` may need
    Ray Serve at import."""
    import ast
    from pathlib import Path

    import rayfleet.serving

    root = Path(rayfleet.serving.__file__).parent
    offenders = []
    for name in ("spec", "kv/transfer", "engine/async_engine", "engine/loading", "deploy/replica_client",
                 "routing/router", "deploy/inference_service", "deploy/serving_metrics", "openai_api/app",
                 "openai_api/in_process", "deployer"):
        for node in ast.parse((root / f"{name}.py").read_text()).body:
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            offenders += [f"{name}: {m}" for m in mods if m.split(".")[0] == "ray"]
    assert not offenders
