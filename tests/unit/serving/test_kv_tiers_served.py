"""``kv_cache`` in a serve spec changes what the served app does (in process, no Ray): a prefix
evicted from the engine's pool comes back from the node's host tier with the same greedy tokens,
and without ``kv_cache`` it is recomputed. The deployed (Ray Serve) path is tested in
tests/cluster/test_serving_kv_tiers.py."""

from __future__ import annotations

import asyncio
import random

from rayfleet.serving.openai_api.in_process import build_local
from rayfleet.serving.engine.sampling import SamplingParams

MODEL = {"preset": "tiny", "seed": 4, "dtype": "float64", "overrides": {"max_seq_len": 512}}
# 24 blocks of 8 tokens: one 160-token prompt (20 blocks) at a time, so each new prompt evicts
# the previous one.
ENGINE = {"block_size": 8, "num_blocks": 24, "max_num_seqs": 1, "max_num_batched_tokens": 256}


def _spec(kv_cache: dict | None) -> dict:
    spec = {"model": MODEL, "engine": ENGINE, "mode": "colocated", "colocated": {"replicas": 1},
            "kv_transfer": {"transport": "local"}}
    if kv_cache is not None:
        spec["kv_cache"] = kv_cache
    return spec


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(160)]


def _serve(local, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def run():
        outs = []
        for prompt in prompts:
            tokens = []
            async for delta in local.service.stream(prompt, params):
                tokens += delta.token_ids
            outs.append(tokens)
        return outs

    return asyncio.run(run())


def test_spec_kv_cache_serves_an_evicted_prefix_from_host_memory():
    a, b = _prompt(1), _prompt(2)
    tiered = build_local(_spec({"host_blocks": 96}))
    plain = build_local(_spec(None))
    try:
        outs = _serve(tiered, [a, b, a])
        (connector,) = [e.engine.kv_tiers for e in tiered.engines.values()]
        stats = connector.stats()
        assert stats.written_back >= 19  # a's full blocks left the engine pool for host memory
        # and most came back for the second a (the engine kept a's first few: it evicts tails first)
        assert stats.loaded_from_host >= 12
        reference = _serve(plain, [a, b, a])
        assert outs == reference  # identical greedy tokens, tiers or not
        assert outs[0] == outs[2]
        # Broken variant: without kv_cache the app has no tiers at all (the field was once ignored).
        assert all(e.engine.kv_tiers is None for e in plain.engines.values())
    finally:
        tiered.shutdown()
        plain.shutdown()
