"""Serving on the shared local fleet, over HTTP: a colocated and a disaggregated app of the
tiny model (float64, greedy), and the same two with the prefix cache off, deployed once for the
module. Each pool is one Serve deployment routed by rayfleet's request router (no router
deployment).

Checks: greedy tokens equal a single in-process engine's, streaming and not, with the prefix
cache (on a hit too) and without it; bad input gets 400/404 in both modes; a client that
disconnects mid-stream leaves no blocks held; a decode replica killed mid-stream is resumed
elsewhere with the same tokens; a killed prefill replica is routed around; /metrics and
/v1/models answer, and the same metrics reach Ray's Prometheus endpoint under vLLM's names;
the OpenAI client works; a repeated prompt goes to the prefill replica that cached it; a rolling
update (re-deploy with a changed engine setting) fails no request. One app is deployed through
``fleet.serve``.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from live_helpers import greedy_reference, free_port

from .conftest import wait_until

pytestmark = pytest.mark.cluster

MODEL = {"preset": "tiny", "seed": 5, "dtype": "float64", "overrides": {"max_seq_len": 1024, "init_std": 0.1}}
ENGINE = {"block_size": 8, "num_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 128}
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "rayfleet serves MoE models", "hi"]
MAX_TOKENS = 12


def _http(port: int, route_prefix: str = "/") -> dict:
    from rayfleet.serving.spec import HttpSpec

    http = {"port": port, "route_prefix": route_prefix}
    if "auth" in HttpSpec.model_fields:  # these tests speak to the app without API keys
        http["auth"] = "disabled"
    return http


@pytest.fixture(scope="module")
def apps(local_fleet):
    from ray import serve

    from rayfleet.serving.deployer import deploy

    port = free_port()
    common = {"model": MODEL, "engine": ENGINE, "http": _http(port), "request_timeout_s": 30}
    pool = {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"}
    colocated = deploy({**common, "name": "test-colo", "mode": "colocated", "colocated": pool,
                        "http": _http(port, "/colo")})
    disagg = deploy({**common, "name": "test-pd", "mode": "disaggregated",
                     "prefill": {**pool, "replicas": 2}, "decode": {**pool, "replicas": 2},
                     "kv_transfer": {"lease_s": 20}, "http": _http(port, "/pd")})
    no_cache = {**common, "engine": {**ENGINE, "enable_prefix_caching": False}}
    # Through the SDK entry point (``fleet.serve`` is ``deploy`` on the connected fleet), asking
    # for another port: Serve's one proxy keeps its port, and the URL must say so (regression:
    # the URL was built from the spec, and the deploy waited on a port nobody listened on).
    colocated_nc = local_fleet.sdk.serve({**no_cache, "name": "test-colo-nocache", "mode": "colocated",
                                          "colocated": pool, "http": _http(free_port(), "/colo-nc")})
    assert colocated_nc.url == colocated.url.removesuffix("/colo") + "/colo-nc", (colocated.url, colocated_nc.url)
    disagg_nc = deploy({**no_cache, "name": "test-pd-nocache", "mode": "disaggregated", "prefill": pool,
                        "decode": pool, "http": _http(port, "/pd-nc")})
    served = {"colocated": colocated, "disaggregated": disagg,
              "colocated-nocache": colocated_nc, "disaggregated-nocache": disagg_nc}
    try:
        yield served
    finally:
        for app in served.values():
            app.shutdown()
        serve.shutdown()


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens from one in-process engine with the same spec (the ground truth)."""
    return greedy_reference(MODEL, ENGINE, max_tokens=MAX_TOKENS)


def _complete(url: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS, **extra) -> tuple[list[int], dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}
    resp = requests.post(url + "/v1/completions", json=body, stream=stream, timeout=60)
    assert resp.status_code == 200, resp.text
    if not stream:
        data = resp.json()
        return data["choices"][0]["token_ids"], data
    tokens, last = [], {}
    for line in resp.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        last = json.loads(line.removeprefix(b"data: "))
        assert "error" not in last, last
        tokens += last["choices"][0]["token_ids"]
    return tokens, last


def _no_leaks(served, timeout_s: float = 20.0) -> None:
    def clean():
        usage = served.block_usage()
        return all(u and u["num_free_blocks"] == u["num_blocks"] and u["num_requests"] == 0
                   and u["num_reserved"] == 0 and u["num_leases"] == 0 for u in usage.values()) and usage
    wait_until(clean, timeout_s=timeout_s, interval_s=0.5, what=f"{served.name}: every KV block free")


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_greedy_tokens_equal_single_engine_streaming_or_not_with_or_without_prefix_cache(
        apps, reference, mode, caching):
    served = apps[mode if caching else f"{mode}-nocache"]
    for prompt in PROMPTS:
        expected = reference(prompt)
        plain, data = _complete(served.url, prompt, stream=False)
        streamed, last = _complete(served.url, prompt, stream=True)
        assert plain == expected and streamed == expected, (mode, caching, prompt)
        assert data["choices"][0]["finish_reason"] == "length" and last["choices"][0]["finish_reason"] == "length"
    # The first prompt is 2 full blocks long and was sent twice: with the cache a prefill
    # replica hit it (so the equality above covered a hit); without, nothing was reused.
    _, again = _complete(served.url, PROMPTS[0], stream=False)
    assert (again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) == caching
    _no_leaks(served)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_bad_input_gets_http_errors_and_leaks_nothing(apps, mode):
    served = apps[mode]
    url = served.url + "/v1/completions"
    assert requests.post(url, data=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    too_long = requests.post(url, json={"model": "tiny", "prompt": "x" * 1100})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert requests.post(url, json={"model": "tiny", "prompt": "a", "max_tokens": 0}).status_code == 400
    assert requests.post(url, json={"model": "tiny", "prompt": "a", "max_tokens": -3}).status_code == 400
    unknown = requests.post(url, json={"model": "gpt-9", "prompt": "a"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    _no_leaks(served)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(apps, mode):
    served = apps[mode]
    body = {"model": "tiny", "prompt": "disconnect me", "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = requests.post(served.url + "/v1/completions", json=body, stream=True, timeout=60)
    lines = resp.iter_lines()
    got = [line for _, line in zip(range(6), lines)]
    assert any(line.startswith(b"data: {") for line in got)
    resp.close()  # the client goes away long before 800 tokens
    _no_leaks(served)


def _replica_actor(app: str, deployment: str, replica_id: str = ""):
    """The Serve replica actor of ``deployment`` (a pool) with ``replica_id`` (any if empty)."""
    import ray

    # Exact prefix: "test-pd" is a substring of "test-pd-nocache", whose pools share names.
    prefix = f"SERVE_REPLICA::{app}#{deployment}#{replica_id}"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix):
            return ray.get_actor(actor["name"], namespace="serve")
    raise AssertionError(f"no replica actor for {app}/{deployment}")


def test_decode_replica_killed_mid_stream_resumes_with_same_tokens(apps, reference):
    import ray

    served = apps["disaggregated"]
    prompt, max_tokens = "resume after a decode failure", 400
    expected = reference(prompt, max_tokens)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    resp = requests.post(served.url + "/v1/completions", json=body, stream=True, timeout=120)
    tokens, killed = [], None
    for line in resp.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        event = json.loads(line.removeprefix(b"data: "))
        assert "error" not in event, event
        tokens += event["choices"][0]["token_ids"]
        if killed is None and len(tokens) >= 5:
            usage = served.block_usage()
            busy = [n for n, u in usage.items() if n.startswith("decode/") and u and u["num_requests"]]
            assert busy, usage
            killed = busy[0]
            ray.kill(_replica_actor("test-pd", "decode", killed.split("/", 1)[1]), no_restart=True)
    assert killed is not None
    assert tokens == expected  # greedy: the resumed continuation is the same text
    resumes = [line for line in requests.get(served.url + "/metrics").text.splitlines()
               if line.startswith("rayfleet:request_resumes_total")]
    assert resumes and float(resumes[0].rsplit(" ", 1)[1]) >= 1, resumes
    # Serve restarts the killed replica in the background; the next test waits for it.


def test_prefill_replica_killed_requests_still_served(apps, reference):
    import ray

    served = apps["disaggregated"]
    ray.kill(_replica_actor("test-pd", "prefill"), no_restart=True)
    for prompt in PROMPTS[:2]:
        tokens, _ = _complete(served.url, prompt, stream=False)
        assert tokens == reference(prompt)
    wait_until(lambda: all(s == "HEALTHY" for s in served.status()["deployments"].values()), timeout_s=90,
               interval_s=1, what="Serve to restart the killed replicas")
    _no_leaks(served, timeout_s=30)


def test_models_health_metrics_and_openai_client(apps, reference):
    served = apps["disaggregated"]
    models = requests.get(served.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    assert requests.get(served.url + "/health").status_code == 200
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.openai_base_url, api_key="unused")
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == reference(PROMPTS[1])
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    time.sleep(0.3)  # the router polls engine counters every 0.1 s
    text = requests.get(served.url + "/metrics").text
    for name in ("rayfleet:time_to_first_token_seconds_bucket", "rayfleet:inter_token_latency_seconds_bucket",
                 "rayfleet:e2e_request_latency_seconds_count", "rayfleet:request_queue_time_seconds_count",
                 "rayfleet:prefix_cache_queries_total", "rayfleet:prefix_cache_hits_total",
                 "rayfleet:kv_cache_usage_perc"):
        assert name in text, name


def test_each_pool_is_one_deployment_and_a_repeated_prefix_returns_to_its_replica(apps):
    served = apps["disaggregated"]
    assert set(served.status()["deployments"]) == {"ingress", "prefill", "decode"}  # no router deployment
    usage = served.block_usage()
    assert sum(n.startswith("prefill/") for n in usage) == 2 and sum(n.startswith("decode/") for n in usage) == 2
    prompt = "a shared system prompt that both prefill replicas could serve, " * 3
    _complete(served.url, prompt, stream=False)
    # Wait until the replicas have published their caches (record_routing_stats), then the
    # same prompt must hit: the request router sends it where its blocks are.
    time.sleep(1.5)
    for _ in range(3):
        _, data = _complete(served.url, prompt, stream=False)
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) // 8 * 8 - 8, data["usage"]
    _no_leaks(served)


def test_request_metrics_reach_rays_prometheus_endpoint_with_vllm_names(apps, local_fleet):
    import ray

    served = apps["colocated"]
    _complete(served.url, PROMPTS[1], stream=False)
    ports = {n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]}

    def scraped():
        text = ""
        for port in ports:
            try:
                text += requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except requests.RequestException:
                pass
        wanted = ("ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_request_success_total",
                  "ray_vllm_kv_cache_usage_perc")
        return all(w in text for w in wanted) and text
    text = wait_until(scraped, timeout_s=60, interval_s=2, what="Ray's metrics agents to export the serving metrics")
    success = [line for line in text.splitlines() if line.startswith("ray_vllm_request_success_total")]
    assert any('finished_reason="length"' in line and 'model_name="tiny"' in line for line in success), success


def test_rolling_update_keeps_serving_with_the_same_tokens(apps, reference):
    """Re-deploying an app under its name with a changed engine setting makes Serve replace its
    replicas (a rolling update) while a client keeps sending: no request fails, every answer is
    the single engine's, and the new replica runs the new setting. Last in the module: it changes
    the app it updates."""
    import threading

    from rayfleet.serving.deployer import deploy

    served = apps["colocated-nocache"]
    before = set(served.block_usage())
    expected = reference(PROMPTS[1])
    results: list = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                results.append(_complete(served.url, PROMPTS[1], stream=bool(len(results) % 2))[0])
            except Exception as exc:  # noqa: BLE001 - a failed request is the finding
                results.append(repr(exc))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(results) >= 2, timeout_s=60, interval_s=0.2, what="requests before the update")
        spec = served.spec.model_dump(mode="json")
        spec["engine"]["enable_prefix_caching"] = True
        deploy(spec)
        wait_until(lambda: (now := set(served.block_usage())) and not now & before, timeout_s=300, interval_s=1.0,
                   what="the replica replaced by the rolling update")
        during = len(results)
        wait_until(lambda: len(results) >= during + 2, timeout_s=60, interval_s=0.2, what="requests after the update")
    finally:
        stop.set()
        thread.join(timeout=90)
    assert all(r == expected for r in results), [r for r in results if r != expected][:3]
    # the new replica runs the new setting: a repeated prompt now hits its prefix cache
    _complete(served.url, PROMPTS[0], stream=False)
    _, data = _complete(served.url, PROMPTS[0], stream=False)
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, data["usage"]
