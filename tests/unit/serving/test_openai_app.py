"""The OpenAI app over in-process replicas (``build_local``; no Ray): exact greedy tokens in
every mode, HTTP errors for bad input, cancellation and replica failures, no leaked blocks.
Clients send the API key ``KEY`` (read by the app from ``RAYFLEET_API_KEY``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.openai_api.in_process import build_local
from rayfleet.serving.openai_api.app import encode_chat, encode_completion_prompt
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.spec import ServeSpec

MODEL = {"preset": "tiny", "seed": 2, "dtype": "float64", "overrides": {"max_seq_len": 256, "init_std": 0.1}}
ENGINE = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 64}
PROMPTS = ["shared system prompt: be brief. Q1", "shared system prompt: be brief. Q2", "x"]
KEY = "test-key-123"


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    monkeypatch.setenv("RAYFLEET_API_KEY", KEY)


def TestClient(app):  # noqa: N802 - Starlette's client, authorized
    from starlette.testclient import TestClient as _Client

    return _Client(app, headers={"Authorization": f"Bearer {KEY}"})


def spec(mode: str, *, caching: bool = True, replicas: int = 1, **extra) -> dict:
    pool = {"replicas": replicas}
    return {"model": MODEL, "mode": mode, "engine": {**ENGINE, "enable_prefix_caching": caching},
            "colocated": pool, "prefill": pool, "decode": pool, "kv_transfer": {"transport": "local"},
            "router": {"poll_interval_s": 0.02}, "request_timeout_s": 20, **extra}


@pytest.fixture(scope="module")
def reference():
    s = ServeSpec.parse(spec("colocated"))
    engine = load_engine(preset_name="tiny", seed=2, checkpoint=None, dtype="float64", overrides=MODEL["overrides"],
                         config=s.engine_config())
    cache = {}

    def run(prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            (r,) = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            cache[key] = list(r.output_token_ids)
        return cache[key]
    return run


def complete(client, prompt, *, stream: bool, chat: bool = False, max_tokens: int = 8):
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        resp = client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"], resp.json()
    tokens, events = [], []
    with client.stream("POST", path, json=body) as resp:
        for line in resp.iter_lines():
            if line and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                tokens += events[-1]["choices"][0].get("token_ids", []) if events[-1].get("choices") else []
    return tokens, events


def _count(metric) -> float:
    """A counter's value (a Prometheus child, or one wrapped beside a Ray metric)."""
    return getattr(metric, "prom", metric)._value.get()


def assert_no_leaks(local) -> None:
    async def usage():
        return {n: await e.block_usage() for n, e in local.engines.items()}
    for name, u in asyncio.run(usage()).items():
        assert u.num_free_blocks == u.num_blocks and u.num_requests == 0 and u.num_reserved == 0, (name, u)
        assert u.num_leases == 0, (name, u)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_tokens_equal_single_engine(reference, mode, caching):
    local = build_local(spec(mode, caching=caching))
    with TestClient(local.app()) as client:
        for prompt in PROMPTS:
            ids = encode_completion_prompt(prompt)
            plain, data = complete(client, prompt, stream=False)
            streamed, _ = complete(client, prompt, stream=True)
            assert plain == streamed == reference(ids), (mode, caching, prompt)
        chat, data = complete(client, "hello", stream=False, chat=True)
        assert chat == reference(encode_chat([{"role": "user", "content": "hello"}]))
        assert data["choices"][0]["message"]["role"] == "assistant"
        _, again = complete(client, PROMPTS[0], stream=False)
        assert (again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) == caching
        assert_no_leaks(local)
    local.shutdown()


def test_bad_input_statuses():
    local = build_local(spec("disaggregated"))
    with TestClient(local.app()) as client:
        r = client.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "y" * 300})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        for bad in (0, -1):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": [999]}).status_code == 400
        assert client.post("/v1/chat/completions", json={"model": "tiny", "messages": []}).status_code == 400
        assert client.post("/v1/completions", json={"prompt": "a", "n": 0}).status_code == 400
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
        assert client.get("/health").status_code == 200
        complete(client, "warm up", stream=True)
        import time
        time.sleep(0.1)  # one router poll
        text = client.get("/metrics").text
        for name in ("rayfleet:time_to_first_token_seconds_count", "rayfleet:inter_token_latency_seconds_count",
                     "rayfleet:e2e_request_latency_seconds_count", "rayfleet:request_queue_time_seconds_count",
                     'rayfleet:prefix_cache_queries_total{model_name="tiny",replica="prefill-0"}',
                     "rayfleet:prefix_cache_hits_total", "rayfleet:kv_cache_usage_perc"):
            assert name in text, name
        assert_no_leaks(local)
    local.shutdown()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_closing_a_stream_mid_way_aborts_and_frees_blocks(mode):
    local = build_local(spec(mode))

    async def scenario():
        stream = local.service.stream(encode_completion_prompt("cancel me"),
                                      SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        got = []
        async for delta in stream:
            got += delta.token_ids
            if len(got) >= 3:
                break
        await stream.aclose()  # what a client disconnect does to the response generator
        for _ in range(50):
            await asyncio.sleep(0.02)
            usage = {n: await e.block_usage() for n, e in local.engines.items()}
            if all(u.num_free_blocks == u.num_blocks and not u.num_requests and not u.num_leases
                   for u in usage.values()):
                return got, usage
        return got, usage

    got, usage = asyncio.run(scenario())
    assert len(got) >= 3
    assert all(u.num_free_blocks == u.num_blocks and not u.num_requests for u in usage.values()), usage
    local.shutdown()


def _collect(local, prompt_ids, max_tokens, *, during=None):
    async def scenario():
        tokens, fired = [], False
        async for delta in local.service.stream(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                           ignore_eos=True)):
            tokens += delta.token_ids
            if during and not fired and len(tokens) >= 4:
                during(local)
                fired = True
        return tokens
    return asyncio.run(scenario())


def test_decode_replica_dying_mid_stream_resumes_with_identical_tokens(reference):
    local = build_local(spec("disaggregated", replicas=2))
    prompt = encode_completion_prompt("resume me please")

    def kill_busy_decode(local):
        busy = [n for n, e in local.engines.items() if n.startswith("decode") and e.engine.scheduler.requests]
        assert len(busy) == 1
        local.clients[busy[0]].stop()

    tokens = _collect(local, prompt, 40, during=kill_busy_decode)
    assert tokens == reference(prompt, 40)
    assert _count(local.service.metrics.resumes) == 1
    local.shutdown()


def test_prefill_replica_dead_before_the_router_notices_is_retried_elsewhere(reference):
    local = build_local(spec("disaggregated", replicas=2))
    local.clients["prefill-0"].stop()  # equal snapshots before the first poll: prefill-0 ranks first
    prompt = encode_completion_prompt("retry my prefill")
    assert _collect(local, prompt, 6) == reference(prompt, 6)
    assert _count(local.service.metrics.prefill_retries) == 1
    local.shutdown()


def test_no_decode_replica_left_ends_the_stream_with_an_error_event():
    local = build_local(spec("disaggregated", replicas=1, max_resumes=1))

    def kill_decode(local):
        local.clients["decode-0"].stop()

    with TestClient(local.app()) as client:
        body = {"model": "tiny", "prompt": "doomed", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = []
        with client.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
                    if len(events) == 2:
                        kill_decode(local)
        assert "error" in events[-1] and events[-1]["error"]["type"] == "service_unavailable"
    local.shutdown()


def test_a_training_servable_serves_the_same_tokens_as_its_source_model(tmp_path, reference):
    import torch

    from rayfleet.models import build_model, preset
    from rayfleet.storage.model_registry import save_servable

    source = build_model(preset("tiny", **MODEL["overrides"]), seed=2, dtype=torch.float64)
    uri = save_servable(f"file://{tmp_path}/servable", config=source.config, state_dict=source.state_dict())
    local = build_local({**spec("disaggregated"), "model": {"checkpoint": uri, "name": "tiny", "dtype": "float64"}})
    prompt = encode_completion_prompt(PROMPTS[0])
    assert _collect(local, prompt, 8) == reference(prompt)
    local.shutdown()


def test_client_gone_right_after_the_first_token_releases_the_kv_lease_at_once():
    """Regression: a disaggregated stream closed between prefill and decode (the client took its
    first token and left) kept the prefill replica's KV lease until it expired (30 s)."""
    local = build_local(spec("disaggregated"))

    async def scenario():
        stream = local.service.stream(encode_completion_prompt("leave after one token"),
                                      SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        async for delta in stream:
            assert len(delta.token_ids) == 1  # the prefill replica's first token
            break
        await stream.aclose()
        for _ in range(50):
            usage = {n: await e.block_usage() for n, e in local.engines.items()}
            if not any(u.num_leases or u.num_requests or u.num_reserved for u in usage.values()):
                break
            await asyncio.sleep(0.02)
        return usage

    usage = asyncio.run(scenario())
    assert all(u.num_leases == 0 and u.num_free_blocks == u.num_blocks and not u.num_requests
               for u in usage.values()), usage
    local.shutdown()


def test_prefill_replica_that_never_answers_is_abandoned_at_the_deadline_and_retried_elsewhere(reference):
    """Regression (CI, Serve): a killed prefill replica that Serve was still restarting queued the
    call; the prefill deadline's ``TimeoutError`` escaped the retry loop and became a bare 500."""
    local = build_local(spec("disaggregated", replicas=2, request_timeout_s=2))
    hung = asyncio.Event()

    async def never_answers(request_id, prompt, params, cache_salt):
        hung.set()
        await asyncio.Event().wait()

    local.clients["prefill-0"].prefill = never_answers  # prefill-0 ranks first (equal snapshots)
    prompt = encode_completion_prompt("a silent prefill replica")
    assert _collect(local, prompt, 6) == reference(prompt, 6)
    assert hung.is_set() and _count(local.service.metrics.prefill_retries) == 1
    assert_no_leaks(local)
    local.shutdown()


def test_an_unexpected_failure_is_a_json_500_with_a_request_id_and_no_internal_text():
    """Regression: the 500 carried the exception's text (``KeyError: 'router state lost'``)."""
    local = build_local(spec("colocated"))

    async def broken_route(*args, **kwargs):
        raise KeyError("router state lost")

    local.service.router.route = broken_route
    with TestClient(local.app()) as client:
        resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert error["type"] == "internal_server_error" and "cmpl-" in error["message"], error
        assert "KeyError" not in error["message"] and "router state" not in error["message"], error
        _, events = complete(client, "x", stream=True, max_tokens=2)
        assert events and "error" in events[-1] and "KeyError" not in events[-1]["error"]["message"], events
    local.shutdown()


def test_router_polls_slowly_while_idle_and_at_once_when_a_request_arrives(reference):
    local = build_local(spec("colocated", router={"poll_interval_s": 0.02, "idle_poll_interval_s": 0.5}))
    router = local.router

    async def scenario():
        router._ensure_polling()
        await asyncio.sleep(1.2)  # idle: a poll every 0.5 s, not every 0.02 s
        idle_polls = router.num_polls
        prompt = encode_completion_prompt("wake the router")
        tokens = []
        async for delta in local.service.stream(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)):
            tokens += delta.token_ids
        busy_polls = router.num_polls - idle_polls
        return idle_polls, busy_polls, tokens, prompt

    idle_polls, busy_polls, tokens, prompt = asyncio.run(scenario())
    assert 2 <= idle_polls <= 4, idle_polls
    assert busy_polls >= 2, busy_polls  # woken by the route, then fast while the request runs
    assert tokens == reference(prompt, 30)
    local.shutdown()


def test_a_stalled_stream_is_charged_to_the_replica_that_had_it_and_resumed_elsewhere(reference):
    """Regression: a token timeout was charged to replica "?", so the same replica was picked
    again (up to 3 x request_timeout_s) and never reported."""
    local = build_local(spec("colocated", replicas=2, request_timeout_s=1.5))
    real = local.clients["colocated-0"].generate
    stalled = []

    async def stalls_after_two_chunks(request_id, prompt, params, cache_salt):
        n = 0
        async for chunk in real(request_id, prompt, params, cache_salt):
            yield chunk
            n += 1
            if n == 2:
                stalled.append(request_id)
                await asyncio.Event().wait()  # a wedged replica: no more tokens, no error

    local.clients["colocated-0"].generate = stalls_after_two_chunks  # ranks first (equal snapshots)
    reported = []
    report = local.router.report_failure

    async def record(replica):
        reported.append(replica)
        await report(replica)

    local.service.router.report_failure = record
    prompt = encode_completion_prompt("charge the right replica")
    assert _collect(local, prompt, 12) == reference(prompt, 12)
    assert stalled and reported == ["colocated-0"]
    assert _count(local.service.metrics.resumes) == 1
    assert_no_leaks(local)
    local.shutdown()
