"""Adaptive long-context prefill (``long_context``, ``split_prefill``): a prompt split over
replicas gives the single-replica prefill's KV and first token, and the whole generation is the
single engine's; the span planner's worked example; the broken variant (a span that does not
see the earlier spans' KV) differs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayfleet.models import build_model, preset
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.routing.long_prefill import LongPrefillPolicy, key_cost_for, span_costs
from rayfleet.serving.routing.span_prefill import SpanPrefill, split_prefill_in_process
from rayfleet.serving.openai_api.in_process import build_local
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.engine.sampling import SamplingParams

BS = 16
MODEL = {"preset": "tiny", "seed": 5, "dtype": "float64", "overrides": {"max_seq_len": 512, "init_std": 0.1}}


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny", **MODEL["overrides"]), seed=5, dtype=torch.float64).eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _single_replica_prefill(model, prompt):
    engine = LLMEngine(model, EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=64))
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0), prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.pop_prefill_result("r")


def _valid(kv: torch.Tensor, n: int) -> torch.Tensor:
    return kv.reshape(kv.shape[0], -1, *kv.shape[3:])[:, :n]


@pytest.mark.parametrize("bounds", [[0, 160, 300], [0, 128, 224, 300], [0, 16, 32, 48, 300]])
def test_split_prefill_equals_single_replica_prefill(model, bounds):
    prompt = _prompt(300)
    single = _single_replica_prefill(model, prompt)
    k, v, logits = split_prefill_in_process(model, prompt, bounds, block_size=BS)
    assert k.shape == single.k.shape
    torch.testing.assert_close(_valid(k, 300), _valid(single.k, 300), rtol=0, atol=1e-12)
    torch.testing.assert_close(_valid(v, 300), _valid(single.v, 300), rtol=0, atol=1e-12)
    assert int(logits.argmax()) == single.first_token_id


def test_broken_variant_without_earlier_kv_differs(model):
    """A span that skips importing the earlier span's KV (what a missing transfer would do)."""
    prompt = _prompt(300)
    single = _single_replica_prefill(model, prompt)
    first = SpanPrefill(model, prompt, start=0, end=160, block_size=BS)
    last = SpanPrefill(model, prompt, start=160, end=300, block_size=BS)
    for _ in range(model.config.num_layers):
        first.run_layer()
        last.run_layer()  # no import_kv
    assert not torch.allclose(_valid(last.cache.k, 300)[:, 160:], _valid(single.k, 300)[:, 160:])


def _snap(name: str, queued_blocks: int = 0) -> ReplicaSnapshot:
    return ReplicaSnapshot(ReplicaId(name), 1024, 1024, 0, num_queued_blocks=queued_blocks, max_num_seqs=16)


def test_span_planner_worked_example():
    policy = LongPrefillPolicy(threshold_tokens=1024)
    even = policy.plan(4096, [_snap("a"), _snap("b")], block_size=BS)
    assert [(s.replica_id, s.start, s.end) for s in even.spans] == [("a", 0, 2048), ("b", 2048, 4096)]
    # Attention makes later spans dearer: the first one grows, and costs come out near equal.
    skewed = LongPrefillPolicy(threshold_tokens=1024, key_cost=1 / 4096).plan(4096, [_snap("a"), _snap("b")],
                                                                               block_size=BS)
    cut = skewed.spans[0].end
    assert cut > 2048 and cut % BS == 0
    costs = span_costs([0, cut, 4096], key_cost=1 / 4096)
    assert abs(costs[0] - costs[1]) <= BS * 3
    # b has 1024 tokens queued: a (no backlog) comes first and takes more.
    loaded = policy.plan(4096, [_snap("b", queued_blocks=1024 // BS), _snap("a")], block_size=BS)
    assert [(s.replica_id, s.start, s.end) for s in loaded.spans] == [("a", 0, 2560), ("b", 2560, 4096)]


def test_span_planner_declines_short_cached_and_single_replica_prompts():
    policy = LongPrefillPolicy(threshold_tokens=1024, min_span_tokens=256)
    assert policy.plan(1000, [_snap("a"), _snap("b")], block_size=BS) is None
    assert policy.plan(4096, [_snap("a"), _snap("b")], block_size=BS, num_uncached_tokens=512) is None
    assert policy.plan(4096, [_snap("a")], block_size=BS) is None
    # A replica so busy that its span would be tiny is left out rather than given 16 tokens.
    plan = policy.plan(2048, [_snap("a"), _snap("b"), _snap("c", queued_blocks=4000)], block_size=BS)
    assert {s.replica_id for s in plan.spans} == {"a", "b"}
    # Spans always tile the prompt in block-aligned pieces.
    plan = LongPrefillPolicy(threshold_tokens=64, min_span_tokens=16, key_cost=key_cost_for(preset("small"))).plan(
        3000, [_snap(n, q) for n, q in (("a", 3), ("b", 0), ("c", 9), ("d", 1))], block_size=BS)
    bounds = [plan.spans[0].start] + [s.end for s in plan.spans]
    assert bounds[0] == 0 and bounds[-1] == 3000 and all(b % BS == 0 for b in bounds[:-1])
    assert all(a.end == b.start for a, b in zip(plan.spans, plan.spans[1:]))


def _spec(mode: str, **long_context):
    pools = ({"colocated": {"replicas": 2}} if mode == "colocated"
             else {"prefill": {"replicas": 3}, "decode": {"replicas": 1}})
    return {"model": MODEL, "mode": mode, **pools, "engine": {"block_size": BS, "num_blocks": 64,
                                                             "max_num_batched_tokens": 64},
            "kv_transfer": {"transport": "local"}, "router": {"poll_interval_s": 0.02},
            "long_context": {"split_threshold_tokens": 128, "min_span_tokens": 32, **long_context}}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_served_long_prompt_is_split_and_generates_the_single_engine_tokens(mode):
    local = build_local(_spec(mode))
    prompts = [_prompt(300, seed=1), _prompt(40, seed=2)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    reference_engine = LLMEngine(build_model(preset("tiny", **MODEL["overrides"]), seed=5, dtype=torch.float64),
                                 local.spec.engine_config())
    reference = [list(r.output_token_ids) for r in reference_engine.generate(prompts, greedy)]
    reference.append(list(reference_engine.generate([prompts[0]], seeded)[0].output_token_ids))

    async def run():
        outs = []
        for prompt, params in ((prompts[0], greedy), (prompts[1], greedy), (prompts[0], seeded)):
            tokens = []
            async for delta in local.service.stream(prompt, params):
                tokens += delta.token_ids
            outs.append(tokens)
        await asyncio.sleep(0.05)
        return outs, await local.service.block_usage()

    try:
        outs, usage = asyncio.run(run())
    finally:
        local.shutdown()
    assert outs == reference
    workers = {n: c.spans for n, c in local.clients.items()}
    assert sum(w.num_layers_run > 0 for w in workers.values()) >= 2  # the long prompt was split
    assert all(not w.jobs and not any(w.handoffs.values()) for w in workers.values())
    for name, u in usage.items():
        assert u.num_free_blocks == u.num_blocks and not u.num_requests and not u.num_leases, (name, u)


class _SplitProbe:
    """Test-side ingress (``_local_testing_mode``): an InferenceService whose router plans spans
    over replicas of Serve deployments reached by pinned calls (as the deployed ingress does)."""

    def __init__(self, pools, long_prefill) -> None:
        self.pools, self.long_prefill, self.service = pools, long_prefill, None

    async def _ready(self):
        from rayfleet.serving.deploy.inference_service import InferenceService
        from rayfleet.serving.deploy.pool_client import PoolClient
        from rayfleet.serving.routing.policy import RouterPolicy
        from rayfleet.serving.routing.router import RouteHint, Router, RouterCore

        if self.service is None:
            clients, roles = {}, {}
            for name, handle in self.pools.items():
                pool = PoolClient(name, handle, block_size=BS, model_id="tiny")
                replica, _ = await pool.call("block_usage", route=RouteHint())
                clients[replica] = pool.pinned(replica)
                roles.setdefault(name.split("-")[0], []).append(replica)
            core = RouterCore(roles=roles, policy=RouterPolicy(), block_size=BS, model_id="tiny", num_blocks_hint=64,
                              long_prefill=self.long_prefill)
            self.service = InferenceService(router=Router(clients, core, poll_interval_s=0.05),
                                            mode="disaggregated", clients=clients)
        return self.service

    async def complete(self, prompt: list[int]) -> list[int]:
        tokens = []
        async for delta in (await self._ready()).stream(prompt, SamplingParams(max_tokens=6, temperature=0,
                                                                               ignore_eos=True)):
            tokens += delta.token_ids
        return tokens

    async def num_spans(self, prompt: list[int]) -> int:
        return len((await (await self._ready()).router.route(prompt, 6)).spans)


def test_split_prefill_through_serve_handles_matches_single_engine():
    from ray import serve

    from rayfleet.serving.deploy.deployments import EngineReplica
    from rayfleet.serving.spec import ServeSpec

    spec = ServeSpec.parse(_spec("disaggregated"))
    config = spec.engine_config(model_id="tiny")
    prompt = _prompt(300, seed=4)
    reference = LLMEngine(build_model(preset("tiny", **MODEL["overrides"]), seed=5, dtype=torch.float64),
                          config).generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    model = {"checkpoint": None, **MODEL}
    pools = {n: serve.deployment(EngineReplica).options(name=n).bind(
        role=n.split("-")[0], model=model, config=config, transport="local", lease_s=5)
        for names in spec.replica_names().values() for n in names}
    probe = serve.run(serve.deployment(_SplitProbe).bind(pools, spec.long_prefill_policy()), name="probe-split",
                      _local_testing_mode=True)
    assert probe.num_spans.remote(prompt).result() >= 2  # the router splits this prompt
    assert probe.complete.remote(prompt).result() == list(reference[0].output_token_ids)
