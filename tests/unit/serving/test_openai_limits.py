"""The hardened edge of the OpenAI app (issue 15): API keys, body size, schema validation of the
probes that used to pass or crash, stop-string and context limits, the app's and the replicas'
bounded queues (429 with Retry-After), and a request failing in the engine failing alone."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.testclient import TestClient

from rayfleet.errors import SpecError
from rayfleet.serving.openai_api.in_process import build_local
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.errors import RequestFailedError
from rayfleet.serving.openai_api.app import encode_completion_prompt
from rayfleet.serving.openai_api.generation import ChoiceJob, run_choices, service_error
from rayfleet.serving.spec import ServeSpec

KEY = "limits-key"
MODEL = {"preset": "tiny", "seed": 2, "dtype": "float64", "overrides": {"max_seq_len": 256, "init_std": 0.1}}


def spec(**http) -> dict:
    return {"model": MODEL, "engine": {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 64},
            "kv_transfer": {"transport": "local"}, "router": {"poll_interval_s": 0.02}, "request_timeout_s": 20,
            "http": {"api_keys": {"env": ["RAYFLEET_LIMITS_KEY"]}, **http}}


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("RAYFLEET_LIMITS_KEY", KEY)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _assert_openai_error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_every_route_but_health_needs_the_key():
    """Regression: no authentication at all; /metrics and /v1/block_usage were open too."""
    local = build_local(spec())
    with TestClient(local.app()) as client:
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/block_usage"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")]:
            error = _assert_openai_error(client.request(method, path), 401)
            assert error["code"] == "invalid_api_key"
            _assert_openai_error(client.request(method, path, headers={"Authorization": "Bearer nope"}), 401)
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        health = client.get("/health")  # no key needed (200 once the router has polled a replica)
        assert health.status_code in (200, 503) and health.json()["status"] in ("ok", "starting")
        assert client.get("/metrics", headers=AUTH).status_code == 200
        _assert_openai_error(client.get("/nowhere", headers=AUTH), 404)
        _assert_openai_error(client.delete("/v1/models", headers=AUTH), 405)
    local.shutdown()


def test_no_configured_key_fails_closed_and_only_an_explicit_disable_opens_the_api(monkeypatch, tmp_path):
    monkeypatch.delenv("RAYFLEET_LIMITS_KEY")
    local = build_local(spec())
    with TestClient(local.app()) as client:
        error = _assert_openai_error(client.get("/v1/models", headers={"Authorization": "Bearer anything"}), 401)
        assert "http.auth: disabled" in error["message"]
    with TestClient(build_local_app(local, spec(auth="disabled"))) as client:
        assert client.get("/v1/models").status_code == 200
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfile-key-1\n\nfile-key-2\n")
    with TestClient(build_local_app(local, spec(api_keys={"env": [], "file": str(keys)}))) as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer file-key-2"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer file-key-3"}).status_code == 401
    with pytest.raises(SpecError, match="api_keys.file"):
        build_local_app(local, spec(api_keys={"file": str(tmp_path / "missing")}))
    with pytest.raises(SpecError, match="api_keys.env") as info:
        ServeSpec.parse(spec(api_keys={"env": ["sk-live-abc123"]}))
    assert "sk-live" not in str(info.value)  # the pasted key is not echoed into logs
    assert ServeSpec.parse({}).http.host == "127.0.0.1" and ServeSpec.parse({}).http.auth == "api_key"
    local.shutdown()


def build_local_app(local, spec_dict: dict):
    from rayfleet.serving.openai_api.app import build_openai_app

    return build_openai_app(local.service, model_name="tiny", http=ServeSpec.parse(spec_dict).http)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "temperature": float("inf")}, "temperature"),
    ({"prompt": "a", "temperature": 1e-45, "max_tokens": 2}, None),  # valid: greedy, not a NaN distribution
    ({"prompt": "a", "temperature": 2.01}, "temperature"),
    ({"prompt": "a", "seed": "abc"}, "seed"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "stream": "false"}, "stream"),
    ({"prompt": "a", "n": None, "max_tokens": 2}, None),  # n: null is the default, not an error
    ({"prompt": "a", "stop": ["x"] * 5}, "stop"),
    ({"prompt": "a", "stop": "y" * 1000}, "stop"),
    ({"prompt": "a", "max_tokens": 300}, "max_tokens"),
    ({"prompt": "a", "unknown_knob": 1}, "unknown_knob"),
    ({"prompt": "a", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [[1, 2], []], "max_tokens": 2}, "prompt"),
])
def test_probes_get_the_right_status_and_name_the_parameter(body, param):
    """Regression: NaN/inf/1e-45 temperatures passed, ``seed: "abc"`` and 2**70 were 500s,
    ``stream: "false"`` streamed, ``max_tokens: true`` meant 1, 100,000 stop strings were taken."""
    local = build_local(spec())
    with TestClient(local.app(), headers=AUTH) as client:
        resp = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        if param is None:
            assert resp.status_code == 200, resp.text
        else:
            assert _assert_openai_error(resp, 400)["param"] == param
        chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
        assert _assert_openai_error(client.post("/v1/chat/completions", json=chat), 400)["param"].startswith(
            "messages.0.content.0")
    local.shutdown()


def test_body_size_is_bounded_whether_declared_or_streamed():
    local = build_local(spec(limits={"max_body_bytes": 2048}))
    with TestClient(local.app(), headers=AUTH) as client:
        big = json.dumps({"prompt": "z" * 4096}).encode()
        _assert_openai_error(client.post("/v1/completions", content=big), 413)

        def chunks():  # no Content-Length: the server must count what it reads
            for i in range(0, len(big), 512):
                yield big[i:i + 512]
        _assert_openai_error(client.post("/v1/completions", content=chunks()), 413)
        ok = client.post("/v1/completions", json={"prompt": "small", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    local.shutdown()


class _AsgiCall:
    """One HTTP request driven straight through the ASGI app inside this event loop, so that a
    stream can be held open (Starlette's TestClient reads a whole response before returning)."""

    def __init__(self, app, path: str, body: dict, *, slow_reader: bool = False) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()
        self._disconnect = asyncio.Event()
        data = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "scheme": "http", "server": ("testserver", 80), "client": ("test", 1),
                 "http_version": "1.1", "headers": [(b"authorization", f"Bearer {KEY}".encode()),
                                                   (b"content-type", b"application/json"),
                                                   (b"content-length", str(len(data)).encode())]}
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await self._disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await self.messages.put(message)
            if slow_reader and message["type"] == "http.response.body":
                await self._disconnect.wait()  # a client that reads nothing more: the stream stays open

        self.task = asyncio.ensure_future(app(scope, receive, send))

    async def status(self) -> int:
        return (await self.messages.get())["status"]

    async def first_body(self) -> bytes:
        return (await self.messages.get())["body"]

    async def disconnect(self) -> None:
        self._disconnect.set()
        await asyncio.wait_for(self.task, timeout=10)

    async def result(self) -> tuple[int, dict, dict]:
        start = await self.messages.get()
        body = b""
        while True:
            msg = await self.messages.get()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        return start["status"], headers, json.loads(body)


HOLD = {"prompt": "hold", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}


def test_the_app_bounds_generations_in_flight_with_429_and_retry_after():
    local = build_local(spec(limits={"max_concurrent_requests": 2, "retry_after_s": 3}))
    app = local.app()

    async def scenario():
        too_many = await _AsgiCall(app, "/v1/completions", {"prompt": "a", "n": 3}).result()
        holders = [_AsgiCall(app, "/v1/completions", HOLD, slow_reader=True) for _ in range(2)]
        for h in holders:
            assert await h.status() == 200 and (await h.first_body()).startswith(b"data: {")
        refused = await _AsgiCall(app, "/v1/completions", {"prompt": "a", "max_tokens": 2}).result()
        for h in holders:
            await h.disconnect()
        admitted = await _AsgiCall(app, "/v1/completions", {"prompt": "a", "max_tokens": 2}).result()
        usage = await local.engines["colocated-0"].block_usage()
        return too_many, refused, admitted, usage

    too_many, refused, admitted, usage = asyncio.run(scenario())
    assert too_many[0] == 400 and too_many[2]["error"]["param"] == "n"
    status, headers, body = refused
    assert status == 429 and body["error"]["code"] == "overloaded" and headers["retry-after"] == "3"
    assert admitted[0] == 200  # the disconnected streams gave their places back
    assert usage.num_free_blocks == usage.num_blocks and usage.num_requests == 0  # and their blocks
    local.shutdown()


def test_a_replica_bounds_its_waiting_queue_with_429():
    body = spec()
    body["engine"] = {**body["engine"], "max_num_seqs": 1, "max_queued_requests": 1}
    local = build_local(body)
    app = local.app()

    async def scenario():
        running = _AsgiCall(app, "/v1/completions", HOLD, slow_reader=True)
        assert await running.status() == 200 and await running.first_body()
        waiting = _AsgiCall(app, "/v1/completions", {**HOLD, "max_tokens": 2})
        assert await waiting.status() == 200
        scheduler = local.engines["colocated-0"].engine.scheduler
        for _ in range(500):
            if scheduler.waiting:
                break
            await asyncio.sleep(0.01)
        refused = await _AsgiCall(app, "/v1/completions", {"prompt": "one too many", "max_tokens": 2}).result()
        await running.disconnect()
        queued_ran = await asyncio.wait_for(waiting.first_body(), timeout=20)
        await waiting.disconnect()
        return refused, queued_ran

    (status, headers, body), queued_ran = asyncio.run(scenario())
    assert status == 429 and body["error"]["code"] == "overloaded" and "retry-after" in headers
    assert queued_ran.startswith(b"data: {")  # the queued request ran once the first one left
    local.shutdown()


class _SlippedPastValidation(SamplingParams):
    """Fault injection: a temperature that a validation gap let through (survives ``replace``)."""

    def __post_init__(self) -> None:
        temperature = self.temperature
        object.__setattr__(self, "temperature", 1.0)
        super().__post_init__()
        object.__setattr__(self, "temperature", temperature)


def test_a_request_failing_in_the_engine_is_a_500_with_its_id_while_another_finishes():
    """Regression (issue 15): a bad request crashed the replica's loop; now it fails alone and the
    client gets a 500 naming its request id, not the exception text."""
    local = build_local(spec())
    prompt = encode_completion_prompt("fail alone")
    good = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    bad = _SlippedPastValidation(max_tokens=20, temperature=float("nan"))

    async def scenario():
        start = time.monotonic()
        normal = asyncio.create_task(run_choices(local.service, [ChoiceJob(0, 0, prompt, good, "normal")],
                                                 cache_salt=None))
        with pytest.raises(RequestFailedError) as info:
            await run_choices(local.service, [ChoiceJob(0, 0, prompt, bad, "broken")], cache_salt=None)
        (result,) = await normal
        return info.value, result, time.monotonic() - start

    error, result, took = asyncio.run(scenario())
    assert len(result.token_ids) == 20 and result.finish_reason == "length" and took < 20
    api = service_error(error, "cmpl-abc", retry_after_s=1)
    assert api.status == 500 and "cmpl-abc" in api.message and "nan" not in api.message.lower()
    local.engines["colocated-0"].check_health()
    local.shutdown()


def test_deploying_without_a_configured_key_makes_a_private_one_the_app_then_requires(tmp_path, monkeypatch):
    from rayfleet.serving.api_keys import ensure_client_key

    monkeypatch.delenv("RAYFLEET_LIMITS_KEY")
    http = ServeSpec.parse(spec()).http
    deployed, key = ensure_client_key(http, app_name="app1", key_dir=tmp_path / "keys")
    path = tmp_path / "keys" / "app1.key"
    assert deployed.api_keys.file == str(path) and key and key not in deployed.model_dump_json()
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text().strip() == key
    local = build_local(spec())
    app = build_openai_app_for(local, deployed)
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    monkeypatch.setenv("RAYFLEET_LIMITS_KEY", "configured")
    assert ensure_client_key(http, app_name="app2", key_dir=tmp_path / "keys") == (http, "configured")
    off = ServeSpec.parse(spec(auth="disabled")).http
    assert ensure_client_key(off, app_name="app3", key_dir=tmp_path / "keys") == (off, None)
    local.shutdown()


def build_openai_app_for(local, http):
    from rayfleet.serving.openai_api.app import build_openai_app

    return build_openai_app(local.service, model_name="tiny", http=http)


def test_a_lone_surrogate_escape_is_a_400_not_a_500():
    """Regression (found by the fuzz test): ``"\\ud800"`` is valid JSON but no UTF-8 text; encoding
    the prompt raised ``UnicodeEncodeError`` and the client got a 500."""
    local = build_local(spec())
    with TestClient(local.app(), headers=AUTH) as client:
        for path, body in [("/v1/completions", {"prompt": "\ud800"}),
                           ("/v1/completions", {"prompt": "ok", "stop": ["\udfff"]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud83d"}]})]:
            error = _assert_openai_error(client.post(path, content=json.dumps(body),
                                                     headers={"content-type": "application/json"}), 400)
            assert error["code"] == "invalid_unicode"
    local.shutdown()
