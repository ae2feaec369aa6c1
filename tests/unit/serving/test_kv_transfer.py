"""KV handoff: lease logic (pure), the in-process transport, and the engine-level prefill ->
transfer -> decode path, which must reproduce a single engine's tokens exactly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.kv_connector import HandoffId, KVPayload, KVTransferError
from rayfleet.serving.kv.transfer import LeaseTable, LocalTransport, make_transport
from rayfleet.serving.engine.request import FinishReason
from rayfleet.serving.engine.sampling import SamplingParams

PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 1], [5, 6, 7], [200, 201, 202, 203, 204, 205, 206, 207]]
GREEDY = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model():
    """init_std 0.1, not the preset's 0.02: at 0.02 the random tiny model's next token hardly
    depends on earlier tokens, so lost or garbled KV would go unnoticed (see the broken variant)."""
    from rayfleet.models import build_model, preset

    return build_model(preset("tiny", max_seq_len=256, init_std=0.1), seed=3, dtype=torch.float64).eval()


def engine(model, **overrides) -> LLMEngine:
    config = {"block_size": 4, "num_blocks": 32, "max_num_batched_tokens": 64, "vocab_limit": 259, **overrides}
    return LLMEngine(model, EngineConfig(**config))


def test_lease_table_worked_example():
    leases = LeaseTable(ttl_s=10)
    a, b = HandoffId("a"), HandoffId("b")
    leases.grant(a, now=0)
    leases.grant(b, now=5)
    assert leases.expire(now=9.9) == []
    assert leases.expire(now=12) == [a]
    assert a not in leases and b in leases and leases.is_live(b, now=13)
    assert leases.release(b) is True and leases.release(b) is False
    assert len(leases) == 0
    with pytest.raises(SpecError, match="lease_s"):
        LeaseTable(ttl_s=0)


def test_local_transport_fetch_release_and_expiry():
    owner = LocalTransport(owner="p0", lease_s=5)
    payload = KVPayload.from_tensors(prompt_token_ids=[1, 2], first_token_id=3, k=torch.ones(2, 1, 4, 1, 2),
                                     v=torch.zeros(2, 1, 4, 1, 2))
    kept, dropped = owner.put(payload, now=0), owner.put(payload, now=1)
    assert asyncio.run(owner.fetch(kept)).first_token_id == 3
    assert owner.release(kept.handoff_id) and owner.num_leases == 1
    with pytest.raises(KVTransferError, match="gone"):
        asyncio.run(owner.fetch(kept))
    assert owner.expire(now=5.5) == [] and owner.expire(now=6.0) == [dropped.handoff_id] and owner.num_leases == 0
    with pytest.raises(KVTransferError):
        asyncio.run(owner.fetch(dropped))
    with pytest.raises(SpecError, match="transport"):
        make_transport("carrier-pigeon", owner="x", lease_s=1)


def test_payload_round_trips_bfloat16_bits():
    k = torch.randn(2, 3, 4, 1, 2).to(torch.bfloat16)
    payload = KVPayload.from_tensors(prompt_token_ids=[1], first_token_id=2, k=k, v=k, generator_state=None)
    k2, _ = payload.tensors()
    assert k2.dtype == torch.bfloat16 and torch.equal(k2, k)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefill_then_decode_on_another_engine_equals_one_engine(tiny_model, prefix_caching):
    reference = [list(r.output_token_ids) for r in engine(tiny_model).generate(PROMPTS, GREEDY)]
    prefill = engine(tiny_model, enable_prefix_caching=prefix_caching)
    decode = engine(tiny_model, enable_prefix_caching=prefix_caching)
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", prompt, GREEDY, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    assert prefill.block_pool.num_free_blocks == 32  # prefill keeps nothing: KV was copied out
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        result = prefill.pop_prefill_result(f"r{i}")
        assert result.finish_reason is None and result.k.shape[1] == -(-len(prompt) // 4)
        assert decode.reserve_prefilled(f"r{i}", prompt, result.first_token_id, GREEDY) is not None
        decode.commit_prefilled(f"r{i}", result.k, result.v)
        tokens[f"r{i}"] = [result.first_token_id]
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert decode.block_pool.num_free_blocks == 32


def test_decode_with_wrong_kv_is_detected_not_silently_used(tiny_model):
    """Broken variant: committing garbage KV (zeros) changes the tokens, so the equality test
    above would catch a transfer that loses data; a shape mismatch is refused outright."""
    prompt = PROMPTS[0]
    (ref,) = engine(tiny_model).generate([prompt], GREEDY)
    prefill = engine(tiny_model)
    prefill.add_request("r", prompt, GREEDY, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    result = prefill.pop_prefill_result("r")
    decode = engine(tiny_model)
    decode.reserve_prefilled("r", prompt, result.first_token_id, GREEDY)
    with pytest.raises(SpecError, match="kv"):
        decode.commit_prefilled("r", result.k[:, :1], result.v[:, :1])
    decode.commit_prefilled("r", torch.zeros_like(result.k), torch.zeros_like(result.v))
    out = []
    while decode.has_unfinished_requests():
        for o in decode.step():
            out += o.new_token_ids
    assert [result.first_token_id] + out != list(ref.output_token_ids)


def test_seeded_sampling_survives_the_split(tiny_model):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    (ref,) = engine(tiny_model).generate([PROMPTS[0]], params)
    prefill, decode = engine(tiny_model), engine(tiny_model)
    prefill.add_request("s", PROMPTS[0], params, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    result = prefill.pop_prefill_result("s")
    decode.reserve_prefilled("s", PROMPTS[0], result.first_token_id, params)
    decode.commit_prefilled("s", result.k, result.v, generator_state=result.generator_state)
    out = [result.first_token_id]
    while decode.has_unfinished_requests():
        for o in decode.step():
            out += o.new_token_ids
    assert out == list(ref.output_token_ids)


def test_first_token_that_ends_the_request_needs_no_decode(tiny_model):
    prefill = engine(tiny_model)
    prefill.add_request("one", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    assert prefill.pop_prefill_result("one").finish_reason is FinishReason.LENGTH


def test_reservation_refused_when_full_and_abort_frees_it(tiny_model):
    decode = engine(tiny_model, num_blocks=4, max_model_len=16)
    assert decode.reserve_prefilled("big", list(range(1, 15)), 7, GREEDY) is not None  # 15 tokens: 4 blocks
    assert decode.reserve_prefilled("next", [1, 2], 3, GREEDY) is None
    decode.abort("big")
    decode.step()
    assert decode.block_pool.num_free_blocks == 4 and not decode.scheduler.requests
    assert decode.reserve_prefilled("next", [1, 2], 3, GREEDY) is not None


def test_handoff_never_picked_up_is_freed_when_the_lease_expires(tiny_model):
    now = [0.0]

    async def scenario():
        prefill = AsyncEngine(engine(tiny_model), name="p0", transport=LocalTransport(owner="p0", lease_s=10),
                              clock=lambda: now[0])
        reply = await prefill.prefill("lost", PROMPTS[0], GREEDY)
        assert reply.handle is not None and (await prefill.block_usage()).num_leases == 1
        now[0] = 11.0  # nobody fetched it; the loop's expiry sweep runs at least once a second
        await asyncio.sleep(1.2)
        usage = await prefill.block_usage()
        prefill.shutdown()
        return reply, usage

    reply, usage = asyncio.run(scenario())
    assert usage.num_leases == 0 and usage.num_free_blocks == usage.num_blocks
    with pytest.raises(KVTransferError):
        asyncio.run(LocalTransport(owner="d0", lease_s=1).fetch(reply.handle))
