"""Conformance with the official ``openai`` client against the in-process app (no Ray): stop
sequences excluded with ``stop_reason``, logprobs for completions and chat, ``n > 1``, batch
prompts, ``echo``, penalties and ``logit_bias`` honoured, parameters the server cannot honour
refused with a 400 naming them, complete streaming usage, ``GET /v1/models/{id}``, and the
error statuses as the client's typed exceptions."""

from __future__ import annotations

import math

import openai
import pytest
from starlette.testclient import TestClient

from rayfleet.serving.openai_api.in_process import build_local
from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.openai_api.app import encode_chat, encode_completion_prompt
from rayfleet.serving.spec import ServeSpec

KEY = "conformance-key"
MODEL = {"preset": "tiny", "seed": 2, "dtype": "float64", "overrides": {"max_seq_len": 256, "init_std": 0.1}}
SPEC = {"model": MODEL, "engine": {"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 64},
        "kv_transfer": {"transport": "local"}, "router": {"poll_interval_s": 0.02}, "request_timeout_s": 20,
        "http": {"api_keys": {"env": ["RAYFLEET_CONFORMANCE_KEY"]}}}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served():
    mp = pytest.MonkeyPatch()
    mp.setenv("RAYFLEET_CONFORMANCE_KEY", KEY)
    local = build_local(SPEC)
    http = TestClient(local.app())
    with http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
        yield local, client, http
    local.shutdown()
    mp.undo()


@pytest.fixture(scope="module")
def reference():
    s = ServeSpec.parse(SPEC)
    engine = load_engine(preset_name="tiny", seed=2, checkpoint=None, dtype="float64", overrides=MODEL["overrides"],
                         config=s.engine_config())

    def run(prompt_ids: list[int], max_tokens: int, **params) -> list[int]:
        (r,) = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                            **params))
        return list(r.output_token_ids)
    return run


def _text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def _ascii_stop_from(ids: list[int]) -> tuple[str, int]:
    """A one-character stop string the greedy output contains (at its first position), and where."""
    for i, t in enumerate(ids):
        if 32 <= t < 127:
            return chr(t), i
    pytest.skip("the reference output has no printable ASCII token")


def test_stop_sequence_is_excluded_and_named_in_stop_reason(served, reference):
    _, client, _ = served
    prompt = "stop me somewhere"
    ref = reference(encode_completion_prompt(prompt), 24)
    stop, at = _ascii_stop_from(ref)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=[stop], **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == _text(ref[:at]) and stop not in choice.text
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=stop, stream=True,
                                         **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_match_the_model_and_list_the_top_tokens(served, reference):
    _, client, _ = served
    out = client.completions.create(model="tiny", prompt="logprobs please", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and math.isfinite(value)
        assert len(top) in (3, 4) and top[token] == value  # greedy: the sampled token is the best one
        assert value == max(top.values())
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_top_logprobs(served):
    _, client, _ = served
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_n_choices_and_batch_prompts_in_openai_order(served, reference):
    _, client, _ = served
    prompts = ["first prompt", "second one"]
    out = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        expected = reference(encode_completion_prompt(prompts[c.index // 2]), 5)
        assert c.model_extra["token_ids"] == expected
    assert out.usage.prompt_tokens == sum(len(encode_completion_prompt(p)) for p in prompts)
    assert out.usage.completion_tokens == 20 and out.usage.total_tokens == out.usage.prompt_tokens + 20
    sampled = client.completions.create(model="tiny", prompt="sample", n=3, max_tokens=12, temperature=1.0, seed=5)
    again = client.completions.create(model="tiny", prompt="sample", n=3, max_tokens=12, temperature=1.0, seed=5)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seed + i per choice
    assert len({c.text for c in sampled.choices}) > 1


def test_token_id_prompts_and_echo(served, reference):
    _, client, _ = served
    ids = encode_completion_prompt("echo this")
    out = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=4, echo=True, **GREEDY)
    assert len(out.choices) == 2
    assert out.choices[0].text == "echo this" + _text(reference(ids, 4))


def test_penalties_and_logit_bias_change_the_output_as_asked(served, reference):
    _, client, _ = served
    prompt = "penalties"
    ids = encode_completion_prompt(prompt)
    base = reference(ids, 16)
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logit_bias={"65": 100},
                                       **GREEDY)
    assert forced.choices[0].text == "AAAA"
    banned = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                       logit_bias={str(base[0]): -100}, extra_body={"ignore_eos": True,
                                                                                    "return_token_ids": True},
                                       temperature=0)
    assert banned.choices[0].model_extra["token_ids"][0] != base[0]
    penalized = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, frequency_penalty=2.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True}, temperature=0)
    got = penalized.choices[0].model_extra["token_ids"]
    assert got == reference(ids, 16, frequency_penalty=2.0)
    assert max(got.count(t) for t in set(got)) <= max(base.count(t) for t in set(base))


@pytest.mark.parametrize("kwargs,param", [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
])
def test_completion_parameters_the_server_cannot_honour_are_refused_by_name(served, kwargs, param):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, **kwargs)
    assert info.value.body["param"] == param


@pytest.mark.parametrize("kwargs,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_parameters_the_server_cannot_honour_are_refused_by_name(served, kwargs, param):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       **kwargs)
    assert info.value.body["param"] == param


def test_streaming_usage_is_complete_and_chat_streams_the_same_text(served, reference):
    _, client, _ = served
    messages = [{"role": "user", "content": "stream with usage"}]
    ids = encode_chat(messages)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 7, len(ids) + 7)
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == _text(reference(ids, 7))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_models_and_model_by_id(served):
    _, client, _ = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_error_statuses_reach_the_client_as_its_typed_exceptions(served):
    local, client, http = served
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http,
                      max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=10_000)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", temperature=2.5)
    assert info.value.body["param"] == "temperature"


def test_finish_reason_length_and_stop(served, reference):
    _, client, _ = served
    out = client.completions.create(model="tiny", prompt="how long", max_tokens=3, **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.choices[0].model_extra["stop_reason"] is None
    ids = encode_completion_prompt("how long")
    first = reference(ids, 1)[0]
    out = client.completions.create(model="tiny", prompt="how long", max_tokens=3, temperature=0,
                                    extra_body={"stop_token_ids": [first], "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == first
