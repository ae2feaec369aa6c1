"""The TTFT cost: seconds of queued + uncached prefill at each replica's measured rate, plus the
decode tokens continuous batching puts in the same steps (``routing.ttft_cost`` module doc)."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.router import RouterCore
from rayfleet.serving.routing.ttft_cost import PrefillRateEstimator, TTFTPolicy, prefill_policy

BLOCK = 16
PROMPT = hash_full_blocks(list(range(8 * BLOCK)), block_size=BLOCK, root=root_block_hash(model_id="tiny"))


def snap(rid: str, *, queued: int = 0, running: int = 0, **kw) -> ReplicaSnapshot:
    return ReplicaSnapshot(ReplicaId(rid), 1000, 1000, 0, num_queued_blocks=queued, num_running_requests=running, **kw)


def test_worked_example_queue_against_cached_prefix_in_seconds():
    # r0 caches 6 of 8 blocks behind 20 queued blocks: (320 + 32) tokens / 4000 tok/s = 88 ms;
    # r1 caches nothing and is idle: 128 / 4000 = 32 ms. r1 wins; with 4 queued blocks r0 costs
    # (64 + 32) / 4000 = 24 ms and wins, saving 6 blocks of prefill.
    index = PrefixIndex()
    index.add_blocks(ReplicaId("r0"), PROMPT[:6])
    policy = TTFTPolicy()
    rates = {"r0": 4000.0, "r1": 4000.0}
    busy = policy.choose_prefill([snap("r0", queued=20), snap("r1")], PROMPT, index, prefill_rate=rates)
    assert busy.replica_id == "r1"
    assert {s.replica_id: round(s.cost * 1e3, 6) for s in busy.ranked} == {"r1": 32.0, "r0": 88.0}
    light = policy.choose_prefill([snap("r0", queued=4), snap("r1")], PROMPT, index, prefill_rate=rates)
    assert light.replica_id == "r0" and light.ranked[0].cost == pytest.approx(0.024)
    assert "longest cached prefix" in light.reason
    # The block-unit cost also picks r1 at 20 queued blocks (2 + 0.5 * 20 = 12 > 8): the two
    # agree there; the TTFT cost's price of a queued block is one block of prefill, not a weight.
    assert RouterPolicy().choose_prefill([snap("r0", queued=20), snap("r1")], PROMPT, index).replica_id == "r1"


def test_measured_rate_prices_a_slow_replica_by_its_own_speed():
    index = PrefixIndex()
    index.add_blocks(ReplicaId("slow"), PROMPT[:4])
    snaps = [snap("slow"), snap("fast")]
    # slow: 64 tokens at 1000 tok/s = 64 ms; fast: 128 tokens at 8000 tok/s = 16 ms.
    assert TTFTPolicy().choose_prefill(snaps, PROMPT, index,
                                       prefill_rate={"slow": 1000.0, "fast": 8000.0}).replica_id == "fast"
    # Broken variant: one rate for all (no measurement) keeps the request on the cached, slow one.
    assert TTFTPolicy().choose_prefill(snaps, PROMPT, index).replica_id == "slow"


def test_decode_load_term_is_the_decode_tokens_sharing_the_prefill_steps():
    policy = TTFTPolicy(step_token_budget=64)
    idle, decoding = snap("a"), snap("b", running=32)
    # a: 128 tokens / 1000 = 0.128 s. b: 128 tokens over 64 - 32 = 32 tokens a step -> 4 steps,
    # each carrying 32 decode tokens: (128 + 128) / 1000 = 0.256 s.
    assert policy.predicted_ttft_s(idle, uncached_tokens=128, tokens_per_block=BLOCK, rate=1000.0) == 0.128
    assert policy.predicted_ttft_s(decoding, uncached_tokens=128, tokens_per_block=BLOCK, rate=1000.0) == 0.256
    # A fully cached prompt still waits one step behind the running decodes.
    assert policy.predicted_ttft_s(decoding, uncached_tokens=0, tokens_per_block=BLOCK, rate=1000.0) == 0.032
    index = PrefixIndex()
    index.add_blocks(ReplicaId("b"), PROMPT[:3])  # 3 cached blocks do not pay for 4 steps of decodes
    assert policy.choose_prefill([decoding, idle], PROMPT, index, prefill_rate={"a": 1e3, "b": 1e3}).replica_id == "a"
    with pytest.raises(SpecError, match="step_token_budget"):
        TTFTPolicy(step_token_budget=1)


def test_rate_estimator_learns_from_completions_and_pools_for_the_unknown():
    est = PrefillRateEstimator(prior_tokens_per_s=4000.0, memory_tokens=65536.0, prior_tokens=2048.0)
    assert est.rate("a") == 4000.0
    for _ in range(20):
        est.observe("a", 8192, 8192 / 10_000.0)  # a prefills at 10k tokens/s
    assert est.rate("a") == pytest.approx(10_000.0, rel=0.02)
    assert est.rate("new") == est.rate("a")  # unmeasured: the pool's pooled rate, not the prior
    est.observe("b", 16, 1.0)  # one tick-sized sample does not drag b to 16 tokens/s
    assert est.rate("b") > 1000.0
    est.observe("c", 0, 1.0)  # nothing prefilled: ignored
    assert "c" not in est._sums
    with pytest.raises(SpecError):
        PrefillRateEstimator(prior_tokens_per_s=0)


def test_router_core_learns_rates_from_reported_totals_and_uses_them():
    core = RouterCore(roles={"colocated": ["r0", "r1"]}, block_size=BLOCK, model_id="tiny")
    assert isinstance(core.policy, TTFTPolicy)  # the default cost
    for t in range(1, 6):
        core.observe("r0", snap("r0", num_prefill_tokens_total=t * 40_000, prefill_seconds_total=t * 10.0))
        core.observe("r1", snap("r1", num_prefill_tokens_total=t * 40_000, prefill_seconds_total=t * 1.0))
    assert core.prefill_rates.rate("r0") == pytest.approx(4000.0, rel=0.05)
    assert core.prefill_rates.rate("r1") == pytest.approx(40_000.0, rel=0.05)
    core.index.add_blocks(ReplicaId("r0"), PROMPT[:7])
    # r0 caches 7 of 8 blocks but is 10x slower: 16 / 4000 = 4 ms vs 128 / 40000 = 3.2 ms.
    assert core.route(list(range(8 * BLOCK)), max_tokens=4, block_hashes=PROMPT, now_s=0.0).first[0] == "r1"
    # A restarted replica (totals fell) is not a negative sample.
    core.observe("r1", snap("r1", num_prefill_tokens_total=10, prefill_seconds_total=0.001))
    assert core.prefill_rates.rate("r1") == pytest.approx(40_000.0, rel=0.05)


def test_policies_are_selectable_by_name():
    assert isinstance(prefill_policy(), TTFTPolicy)
    assert isinstance(prefill_policy("prefix_load", load_weight=0.25), RouterPolicy)
    with pytest.raises(SpecError, match="predicted_ttft"):
        prefill_policy("affinity")


def test_a_replica_reports_prefill_tokens_and_seconds_and_the_router_learns_its_rate(tiny_model):
    """The built-in engine counts the prompt tokens it computes (decode tokens excluded) and its
    async shell the step time they took; a router polling it learns a positive rate from them."""
    import asyncio

    from rayfleet.serving.engine.async_engine import AsyncEngine
    from rayfleet.serving.engine.engine_config import EngineConfig
    from rayfleet.serving.engine.llm_engine import LLMEngine
    from rayfleet.serving.engine.sampling import SamplingParams

    llm = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, vocab_limit=259,
                                             max_num_batched_tokens=8, enable_kv_events=True))  # 8: prompt in chunks
    engine = AsyncEngine(llm, name="colocated-0")
    core = RouterCore(roles={"colocated": ["colocated-0"]}, block_size=4, model_id="tiny")
    prompt = [256] + list(range(10, 29))

    async def scenario():
        first = await engine.poll_state()
        core.observe("colocated-0", first.snapshot, first.events)
        async for _ in engine.generate("r", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)):
            pass
        return await engine.poll_state()

    try:
        state = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert state.snapshot.num_prefill_tokens_total == len(prompt)  # 5 decode steps not counted
    assert state.snapshot.prefill_seconds_total > 0
    core.observe("colocated-0", state.snapshot, state.events)
    assert core.prefill_rates.rate("colocated-0") != core.prefill_rates.prior_tokens_per_s
    assert core.index.num_blocks_on(ReplicaId("colocated-0")) >= 5  # its BlockStored events landed


def test_serve_spec_selects_the_cost_by_name():
    from pydantic import ValidationError

    from rayfleet.serving.spec import RouterSpec

    assert RouterSpec().cost == "predicted_ttft"
    assert RouterSpec(cost="prefix_load").cost == "prefix_load"
    with pytest.raises((ValidationError, SpecError)):
        RouterSpec(cost="affinity")
