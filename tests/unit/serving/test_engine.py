"""LLMEngine on the real tiny MoE model: paged, batched, chunked, cached, preempted greedy
decoding equals a plain full-sequence greedy loop token for token; nothing leaks."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.request import FinishReason
from rayfleet.serving.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SHARED = [11, 22, 33, 44, 55, 66, 77, 88, 99]
PROMPTS = [SHARED + [1, 2, 3], SHARED + [4], [200, 201, 202, 203, 204], SHARED + [1, 2, 3, 5, 6]]


@pytest.fixture(scope="module")
def reference(tiny_model, greedy_reference):
    return [greedy_reference(tiny_model, p, GREEDY.max_tokens) for p in PROMPTS]


def engine(model, **config) -> LLMEngine:
    config = {"block_size": 4, "num_blocks": 32, "max_num_batched_tokens": 64, **config}
    return LLMEngine(model, EngineConfig(**config))


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [64, 7])  # 7: prompts split into chunks, mixed with decodes
def test_greedy_equals_full_sequence_loop(tiny_model, reference, prefix_caching, budget):
    eng = engine(tiny_model, enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget)
    for round_ in range(2):  # the second round hits the prefix cache (when enabled)
        results = eng.generate(PROMPTS, GREEDY)
        assert [list(r.output_token_ids) for r in results] == reference
        assert all(r.finish_reason is FinishReason.LENGTH for r in results)
        cached = sum(r.num_cached_tokens for r in results)
        assert (cached > 0) == (prefix_caching and (round_ == 1 or budget < 64)), cached
    assert eng.block_pool.num_free_blocks == 32 and not eng.kv_cache_manager.req_to_blocks


def test_prefix_hit_after_finished_request_skips_prefill(tiny_model, reference):
    eng = engine(tiny_model)
    eng.generate([PROMPTS[0]], GREEDY)
    (second,) = eng.generate([PROMPTS[3]], GREEDY)
    assert second.num_cached_tokens == 12  # the three full blocks shared with the first prompt
    assert list(second.output_token_ids) == reference[3]
    assert eng.stats().kv.prefix_hit_tokens == 12


def test_preemption_keeps_outputs_exact_and_leaks_nothing(tiny_model, reference):
    # 9 blocks of 4 tokens cannot hold all four requests (5 blocks each at the end): the
    # scheduler must preempt and recompute, and the tokens must not change.
    eng = engine(tiny_model, num_blocks=9, max_model_len=32)
    results = eng.generate(PROMPTS, GREEDY)
    assert eng.stats().num_preemptions > 0
    assert [list(r.output_token_ids) for r in results] == reference
    assert eng.block_pool.num_free_blocks == 9


def test_abort_mid_generation_frees_blocks(tiny_model):
    eng = engine(tiny_model)
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.add_request("b", PROMPTS[2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort("a")
    assert eng.block_pool.num_free_blocks + len(eng.kv_cache_manager.get_block_ids("b")) == 32
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert finals["a"].finish_reason is FinishReason.ABORT and finals["a"].new_token_ids == ()
    assert finals["b"].finish_reason is FinishReason.LENGTH
    assert eng.block_pool.num_free_blocks == 32


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_model):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine(tiny_model).generate([PROMPTS[0]], params)[0].output_token_ids
    crowd = engine(tiny_model, max_num_batched_tokens=5).generate(
        [PROMPTS[2], PROMPTS[0], PROMPTS[1]],
        [SamplingParams(max_tokens=4, temperature=1.0), params, SamplingParams(max_tokens=8, temperature=0.7)],
    )[1].output_token_ids
    assert alone == crowd
    other = engine(tiny_model).generate([PROMPTS[0]], SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True))[0].output_token_ids
    assert other != alone


def test_engine_config_errors(tiny_model):
    with pytest.raises(SpecError, match="max_model_len"):
        engine(tiny_model, num_blocks=4, max_model_len=64)
    eng = engine(tiny_model)
    with pytest.raises(SpecError, match="vocabulary"):
        eng.add_request("x", [1, 10_000])


def test_stats_report_active_blocks_and_queued_prompt_work(tiny_model):
    eng = engine(tiny_model, max_num_batched_tokens=6, max_num_seqs=1)
    eng.add_request("a", list(range(10)), GREEDY)  # 10 tokens, 6 per step
    eng.add_request("b", list(range(20, 25)), GREEDY)
    eng.step()
    stats = eng.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.num_active_blocks == 2  # a holds blocks for its first 6 tokens
    assert stats.num_queued_tokens == 4 + 5  # rest of a's prompt, all of b's
    snap = eng.replica_snapshot("r0")
    assert (snap.num_queued_blocks, snap.num_free_blocks, snap.num_running_requests) == (3, 30, 1)
