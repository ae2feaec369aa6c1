"""Scheduler: decode first, token budget, max_num_seqs, chunked prefill, preemption, abort, stops."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.request import FinishReason
from rayfleet.serving.engine.scheduler import SchedulerConfig


def test_decodes_are_scheduled_before_prefill_chunks_within_the_budget(
        make_request, make_scheduler, run_step):
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=8, max_num_seqs=8)
    for i in range(3):
        s.add_request(make_request(f"d{i}", [i + 1] * 3, max_tokens=10))
    run_step(s)  # 9 prompt tokens > budget 8: d0, d1 prefill whole, d2 gets a 2-token chunk
    run_step(s)
    s.add_request(make_request("long", list(range(40)), max_tokens=2))
    out, _ = run_step(s)
    kinds = [(c.request_id, len(c.token_ids)) for c in out.chunks]
    # Three decodes first (one token each), then the long prompt gets the remaining 5 tokens.
    assert kinds == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 5)]
    assert out.num_batched_tokens == 8
    for _ in range(20):
        out, _ = run_step(s)
        assert out.num_batched_tokens <= 8
        decoding = [c for c in out.chunks if len(c.token_ids) == 1]
        assert out.chunks[:len(decoding)] == tuple(decoding)  # decodes lead every batch


def test_max_num_seqs_caps_running_requests(make_request, make_scheduler, run_step):
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", [1, 2, 3]))
    out, _ = run_step(s)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"] and len(s.waiting) == 2


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step(
        make_request, make_scheduler, run_step):
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=64, max_model_len=64,
                       enable_chunked_prefill=False)
    s.add_request(make_request("a", [1] * 60))
    s.add_request(make_request("b", [2] * 10))
    out, _ = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 60)]
    with pytest.raises(SpecError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False)


def test_preemption_recomputes_and_leaks_no_blocks(make_request, make_scheduler, run_step):
    # 6 blocks of 4 tokens; two requests of 8 prompt + 12 output tokens cannot both finish.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=32, prefix_caching=False)
    s.add_request(make_request("a", [1] * 8, max_tokens=12))
    s.add_request(make_request("b", [2] * 8, max_tokens=12))
    lengths = {"a": 0, "b": 0}
    preempted = set()
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        out, outputs = run_step(s)
        preempted.update(out.preempted_request_ids)
        for o in outputs:
            lengths[o.request_id] += len(o.new_token_ids)
    assert preempted == {"b"}  # the later request yields to the earlier one
    assert lengths == {"a": 12, "b": 12}
    assert s.kv.pool.num_free_blocks == 6 and not s.kv.req_to_blocks


def test_abort_frees_blocks_and_reports_once(make_request, make_scheduler, run_step):
    s = make_scheduler(num_blocks=8, max_num_seqs=1)
    s.add_request(make_request("a", [1] * 9, max_tokens=50))
    s.add_request(make_request("w", [1] * 9, max_tokens=50))
    run_step(s)
    assert [r.request_id for r in s.running] == ["a"] and [r.request_id for r in s.waiting] == ["w"]
    s.abort_requests(["a", "w", "unknown"])
    assert s.kv.pool.num_free_blocks == 8
    out, outputs = run_step(s)
    assert out.is_empty and set(out.finished_request_ids) == {"a", "w"}
    assert {(o.request_id, o.finish_reason) for o in outputs} == {("a", FinishReason.ABORT),
                                                                  ("w", FinishReason.ABORT)}
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize(("params", "token", "reason", "stop_reason", "num_out"), [
    ({}, 257, FinishReason.STOP, None, 1),  # EOS
    ({"ignore_eos": True}, 257, FinishReason.LENGTH, None, 3),
    ({"stop_token_ids": (65,)}, 65, FinishReason.STOP, 65, 1),
    ({"stop": ("AA",)}, 65, FinishReason.STOP, "AA", 2),  # "A" then "AA" on decoded text
    ({}, 66, FinishReason.LENGTH, None, 3),
])
def test_stop_conditions(params, token, reason, stop_reason, num_out,
                       make_request, make_scheduler, run_step):
    s = make_scheduler(num_blocks=8)
    s.add_request(make_request("a", [1, 2], max_tokens=3, **params))
    outputs = []
    while s.has_unfinished_requests():
        outputs += run_step(s, next_token=token)[1]
    assert len(outputs) == num_out
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (reason, stop_reason)
    assert s.kv.pool.num_free_blocks == 8


def test_bad_requests_are_spec_errors(make_request, make_scheduler):
    s = make_scheduler(num_blocks=4)  # max_model_len 16
    s.add_request(make_request("a", [1]))
    with pytest.raises(SpecError, match="request_id"):
        s.add_request(make_request("a", [1]))
    with pytest.raises(SpecError, match="max_model_len"):
        s.add_request(make_request("b", [1] * 16))
    with pytest.raises(SpecError, match="empty"):
        s.add_request(make_request("c", []))


def test_blocked_head_of_line_request_is_not_counted_as_a_prefix_query_each_step(
        make_request, make_scheduler, run_step):
    # Regression: a head-of-line request retried for several steps was counted as a query
    # each time.
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    s.add_request(make_request("big", [1] * 12, max_tokens=4))
    s.add_request(make_request("next", [2] * 8, max_tokens=1))
    for _ in range(3):
        run_step(s)
    assert [r.request_id for r in s.waiting] == ["next"]  # blocked by "big" for 3 steps
    assert s.kv.stats().prefix_query_tokens == 12
