"""Failure isolation in the engine (issue 15): a request that fails in sampling, the forward
pass or the update fails alone, with its blocks freed, while the others finish as if it had
never been there; a wedged loop fails ``check_health``; a full queue refuses more."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.scheduler import EngineOverloadedError
from rayfleet.serving.errors import ReplicaOverloadedError, RequestFailedError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = [256, 10, 20, 30, 40, 50]


def _engine(tiny_model, **config) -> LLMEngine:
    return LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=64, vocab_limit=259, **config))


def _corrupt(params: SamplingParams, **fields) -> SamplingParams:
    """A request whose parameters slipped past validation (fault injection on a real request)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    start = time.monotonic()
    tokens = []
    async for chunk in engine.generate(rid, prompt, params):
        tokens += chunk.token_ids
    return tokens, time.monotonic() - start


def _assert_free(engine: LLMEngine) -> None:
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()


def test_nan_temperature_request_fails_alone_while_a_concurrent_request_finishes_in_normal_time(tiny_model):
    """Regression: a NaN temperature made ``torch.multinomial`` raise inside the engine loop,
    which crashed and restarted on every poll; every request on the replica stalled until the
    bad one timed out (120 s)."""
    llm = _engine(tiny_model)
    engine = AsyncEngine(llm, name="colocated-0")

    async def scenario():
        solo, solo_s = await _collect(engine, "solo", PROMPT, GREEDY)
        bad = _corrupt(SamplingParams(max_tokens=24, temperature=1.0), temperature=float("nan"))
        normal = asyncio.create_task(_collect(engine, "normal", PROMPT, GREEDY))
        with pytest.raises(RequestFailedError, match="nan-request"):
            await _collect(engine, "nan-request", [256, 7, 8, 9], bad)
        tokens, took_s = await normal
        engine.check_health()
        usage = await engine.block_usage()
        return solo, solo_s, tokens, took_s, usage

    solo, solo_s, tokens, took_s, usage = asyncio.run(scenario())
    assert tokens == solo and len(tokens) == 24
    # Normal time: the broken loop stalled it until the bad request's 120 s timeout. The slack
    # absorbs a shared 2-core machine under load.
    assert took_s < 3 * solo_s + 5.0, (took_s, solo_s)
    assert usage.num_free_blocks == usage.num_blocks and usage.num_requests == 0
    engine.shutdown()


def test_a_subnormal_temperature_is_greedy_not_a_nan_distribution(tiny_model):
    """Regression: temperature 1e-45 passed validation and divided logits into inf/NaN."""
    llm = _engine(tiny_model)
    (greedy,) = llm.generate([PROMPT], GREEDY)
    (tiny,) = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=1e-45, ignore_eos=True))
    assert tiny.output_token_ids == greedy.output_token_ids


def test_a_request_whose_forward_fails_fails_alone_and_the_batch_goes_on(tiny_model):
    llm = _engine(tiny_model)
    (reference,) = llm.generate([PROMPT], GREEDY)
    llm.add_request("good", PROMPT, GREEDY)
    llm.add_request("bad", [256, 1, 2, 3], GREEDY)
    llm.scheduler.requests["bad"].all_token_ids[1] = 10**6  # an id the embedding cannot index
    outputs: dict[str, list] = {"good": [], "bad": []}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id].append(out)
    assert [t for o in outputs["good"] for t in o.new_token_ids] == list(reference.output_token_ids)
    (last_bad,) = outputs["bad"]
    assert last_bad.finished and last_bad.finish_reason.value == "abort" and last_bad.error
    assert "10000" not in last_bad.error  # no internal exception text in what leaves the engine
    _assert_free(llm)


def test_a_request_whose_update_fails_fails_alone(tiny_model):
    llm = _engine(tiny_model)
    (reference,) = llm.generate([PROMPT], GREEDY)
    llm.add_request("good", PROMPT, GREEDY)
    llm.add_request("bad", [256, 1, 2, 3], _corrupt(SamplingParams(max_tokens=24, temperature=0), stop=(None,)))
    outputs: dict[str, list] = {"good": [], "bad": []}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id].append(out)
    assert [t for o in outputs["good"] for t in o.new_token_ids] == list(reference.output_token_ids)
    assert outputs["bad"][-1].error and outputs["bad"][-1].finished
    _assert_free(llm)


def test_a_wedged_step_fails_the_health_check(tiny_model):
    llm = _engine(tiny_model)
    engine = AsyncEngine(llm, name="colocated-0", after_step=lambda: time.sleep(0.6), max_step_s=0.2)

    async def scenario():
        task = asyncio.create_task(_collect(engine, "slow", PROMPT, SamplingParams(max_tokens=1, temperature=0)))
        await asyncio.sleep(0.4)
        with pytest.raises(RuntimeError, match="wedged"):
            engine.check_health()
        await task
        engine.check_health()  # the step ended: healthy again

    asyncio.run(scenario())
    engine.shutdown()


def test_a_full_waiting_queue_refuses_more_requests(tiny_model):
    llm = _engine(tiny_model, max_num_waiting=2)
    llm.add_request("a", PROMPT, GREEDY)
    llm.add_request("b", PROMPT, GREEDY)
    with pytest.raises(EngineOverloadedError, match="max_queued_requests") as info:
        llm.add_request("c", PROMPT, GREEDY)
    assert isinstance(info.value, ReplicaOverloadedError)
    llm.step()  # admits a and b: room again
    llm.add_request("c", PROMPT, GREEDY)


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", 2.5), ("top_p", float("nan")), ("seed", 2**70),
                                         ("presence_penalty", 3.0), ("logprobs", 21)])
def test_non_finite_and_out_of_range_sampling_values_are_refused(field, value):
    from rayfleet.errors import SpecError

    with pytest.raises(SpecError, match=field):
        SamplingParams(**{field: value})
    torch.Generator().manual_seed(2**64 - 1)  # the seed range SamplingParams allows fits torch


def test_a_dead_engine_loop_fails_health_and_fast_instead_of_restarting(tiny_model):
    """Regression: a crashed loop was restarted by every call (router polls included) and
    crashed again, about 2,000 tracebacks a minute, while Serve saw a healthy replica."""
    from rayfleet.serving.errors import ReplicaUnavailableError
    from rayfleet.serving.kv.transfer import LocalTransport

    transport = LocalTransport(owner="colocated-0", lease_s=5)

    def expire_breaks(*, now):
        raise OSError("the KV lease table is gone")

    transport.expire = expire_breaks  # fault injection: the loop body fails outside any step
    engine = AsyncEngine(_engine(tiny_model), name="colocated-0", transport=transport)

    async def scenario():
        with pytest.raises(ReplicaUnavailableError):  # in flight when the loop died: told, not left waiting
            await _collect(engine, "first", PROMPT, SamplingParams(max_tokens=8, temperature=0))
        for _ in range(100):
            if engine._task.done():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="engine loop died"):
            engine.check_health()
        with pytest.raises(ReplicaUnavailableError, match="engine loop died"):
            await _collect(engine, "second", PROMPT, SamplingParams(max_tokens=2, temperature=0))
        assert engine._task.done()  # not restarted

    asyncio.run(scenario())
    engine.shutdown()
