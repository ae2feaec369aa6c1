"""A colocated vLLM pool (2 replicas) deployed the declarative way: ``rayfleet serve X.yaml
--serve-config`` piped into ``serve deploy``; called with the ``openai`` client; placed on the
fleet's A100 node by label; routed by rayfleet's prefix+load policy as the pool's Serve
RequestRouter (the colocated default); vLLM's metrics read from Ray's Prometheus endpoints."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from .conftest import API_KEY, METRICS_EXPORT_S, key_file, long_prompt, replica_ids, wait_until

APP = "vllm-pool"
MODEL = "tiny-moe"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})


def _models_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(_get(url + "/v1/models", API_KEY), timeout=5) as resp:
            return resp.status == 200 and MODEL.encode() in resp.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def pool_app(vllm_fleet, tiny_model_dir, tmp_path_factory):
    from ray import serve

    port = _free_port()
    spec = {"name": APP, "model": {"hf": str(tiny_model_dir), "name": MODEL, "dtype": "float32"},
            "engine": {"kind": "vllm", "block_size": 32, "max_model_len": 512, "max_num_seqs": 8,
                       "max_num_batched_tokens": 512},
            "mode": "colocated", "colocated": {"replicas": 2, "accelerators_per_replica": 1, "accelerator_type": "A100"},
            "vllm": {"device": "cpu", "kv_cache_gib": 1},  # request_router: rayfleet (the default)
            "http": {"port": port, "api_keys": {"file": key_file(tmp_path_factory.mktemp("pool-key"))}}}
    work = tmp_path_factory.mktemp("pool")
    (work / "pool.yaml").write_text(yaml.safe_dump(spec))
    config = subprocess.run([sys.executable, "-m", "rayfleet", "serve", str(work / "pool.yaml"), "--serve-config"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    assert "rayfleet.serving.vllm.app:app_builder" in config
    (work / "serve_config.yaml").write_text(config)
    serve_cli = Path(sys.executable).with_name("serve")
    deployed = subprocess.run([str(serve_cli), "deploy", str(work / "serve_config.yaml"), "--address",
                               vllm_fleet.dashboard_url], capture_output=True, text=True, timeout=180, env=os.environ)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    from rayfleet.serving.vllm.app import wait_until_running

    problem = wait_until_running(APP, time.monotonic() + 900, poll_s=2)
    assert problem is None, problem
    wait_until(lambda: _models_ready(url), timeout_s=60, interval_s=1, what="the vLLM pool's ingress")
    yield url
    serve.delete(APP, _blocking=True)


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=300, max_retries=0)


def test_the_vllm_app_is_behind_rayfleets_api_keys(pool_app):
    """Serve LLM's ingress runs as ``RayfleetOpenAiIngress`` (from the config ``serve deploy``
    took): no key or a wrong key is a 401 in OpenAI's error shape, the key file's key passes;
    completions are guarded as well as the model list."""
    import json
    import urllib.error

    import openai

    for key in (None, "rf-wrong"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(_get(pool_app + "/v1/models", key), timeout=30)
        assert refused.value.code == 401
        assert json.loads(refused.value.read())["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(pool_app).with_options(api_key="rf-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert _models_ready(pool_app)


def test_pool_replicas_sit_on_the_labelled_nodes_and_reserve_accelerators(pool_app, vllm_fleet):
    import ray
    from ray.util.state import list_actors

    replicas = [a for a in list_actors(address=vllm_fleet.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
                if (a.name or "").startswith(f"SERVE_REPLICA::{APP}#") and "Ingress" not in a.name]
    assert len(replicas) == 2, [a.name for a in replicas]
    assert {a.node_id for a in replicas} == {vllm_fleet.node_of_type["A100"]}
    # Each replica's placement group holds one of the node's 4 (fake) A100s.
    a100 = next(n for n in ray.nodes() if n["NodeID"] == vllm_fleet.node_of_type["A100"])
    assert a100["Resources"].get("GPU") == 4
    used = ray.cluster_resources().get("GPU", 0) - ray.available_resources().get("GPU", 0)
    assert used >= 2


def test_openai_client_chat_completions_and_streaming(pool_app, vllm_fleet):
    client = _client(pool_app)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the fleet serves"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8

    prompts = [long_prompt(seed, 100) for seed in range(3)]
    texts = []
    for prompt in prompts:
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert first.usage.completion_tokens == 10 and first.choices[0].text == again.choices[0].text
        texts.append(first.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == texts[0]
    vllm_fleet.results["colocated"] = dict(zip(prompts, texts))  # the PD app must say the same


def _prompt_tokens_by_replica(uids: set[str]) -> dict[str, float]:
    from rayfleet.serving.vllm.prometheus_scrape import named, scrape_vllm_metrics

    out: dict[str, float] = {}
    for s in scrape_vllm_metrics():
        if named(s.name, "prompt_tokens") and s.labels.get("ReplicaId") in uids:
            out[s.labels["ReplicaId"]] = out.get(s.labels["ReplicaId"], 0.0) + s.value
    return out


def _settled_prompt_tokens(uids: set[str], *, reads: int = 3, done=lambda counters: True,
                           timeout_s: float = 120.0) -> dict[str, float]:
    """The counters once ``reads`` scrapes in a row, each 1.5 of the fleet's export intervals after
    the last, agree (and ``done(counters)`` holds): Ray's agent has then exported everything
    earlier requests counted (a stale baseline once added 202 tokens to a replica). Three reads
    span three exports: with exports every 2 s a single agreeing pair, 3 s apart, leaves little
    room for an export that slips on a loaded machine."""
    history: list[dict[str, float]] = []

    def settled() -> dict[str, float] | None:
        history.append(_prompt_tokens_by_replica(uids))
        last = history[-reads:]
        return last[-1] if len(last) == reads and all(c == last[-1] for c in last) and done(last[-1]) else None

    return wait_until(settled, timeout_s=timeout_s, interval_s=1.5 * METRICS_EXPORT_S,
                      what="vLLM's counters to settle")


def test_prefix_aware_router_keeps_each_tenant_on_one_replica(pool_app, vllm_fleet):
    """Two tenants, each with its own long system prefix, alternate; a prefix-aware router sends
    every request of a tenant to the replica that holds its prefix, so each replica's prompt
    token count grows by whole tenants' totals: one tenant each, or both on one replica (on an
    idle pool the TTFT cost is the same on both replicas for a new prefix, and the tie goes to
    the replica caching fewer blocks, which may still be the first tenant's). A random router
    keeps both tenants whole with probability (2/2^4)^2 = 1/64."""
    client = _client(pool_app)
    uids = replica_ids(vllm_fleet.dashboard_url, APP, "RayfleetLLMServer")
    assert len(uids) == 2
    before = _settled_prompt_tokens(uids)
    totals = {"a": 0, "b": 0}
    for i in range(4):
        for tenant, prefix in (("a", long_prompt(11, 90)), ("b", long_prompt(12, 50))):
            reply = client.completions.create(model=MODEL, prompt=f"{prefix} question {i}", max_tokens=2,
                                              temperature=0)
            totals[tenant] += reply.usage.prompt_tokens

    # Settled again, and grown by at least what was sent: every replica's export is in.
    after = _settled_prompt_tokens(uids, reads=2, timeout_s=60,
                                   done=lambda now: sum(now.values()) - sum(before.values()) >= sum(totals.values()))
    delta = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in after}
    whole = (sorted(totals.values()), [sum(totals.values())])
    assert sorted(v for v in delta.values() if v) in whole, (delta, totals, _stats_seen())


def _stats_seen(calls: int = 6) -> list:
    """What the replicas publish (for a failure message): hash kind, KV-event counters, load."""
    from ray import serve

    (name,) = [d for d in serve.status().applications[APP].deployments if "Server" in d]
    handle = serve.get_deployment_handle(name, APP)
    keep = ("block_hash_kind", "kv_events", "hash_seq", "num_queued_blocks", "num_active_blocks")
    return [{k: s.get(k) for k in keep} for s in
            (handle.record_routing_stats.remote().result(timeout_s=60) for _ in range(calls))]


def test_replicas_publish_rayfleets_routing_stats(pool_app):
    """The pool runs RayfleetLLMServer: each replica's routing stats carry its load, in the schema
    rayfleet's router reads, and what its engine cached from vLLM's KV events (the tenant test
    above sent long prompts to both): token-block hashes (``block_hash_kind``), fed by event
    batches without gaps, not the text-block estimate."""
    from ray import serve

    from rayfleet.serving.routing.router import ROUTING_STATS_KEYS

    status = serve.status().applications[APP]
    (name,) = [d for d in status.deployments if "Server" in d]
    assert name.startswith("RayfleetLLMServer"), name
    handle = serve.get_deployment_handle(name, APP)
    stats = [handle.record_routing_stats.remote().result(timeout_s=60) for _ in range(8)]
    assert all(set(ROUTING_STATS_KEYS) <= set(s) for s in stats)
    assert all(s["block_hash_kind"] == "tokens" for s in stats), stats[0]
    assert all(s["kv_events"]["gaps"] == s["kv_events"]["errors"] == 0 for s in stats)
    assert any(s["kv_events"]["batches"] > 0 and s["kv_events"]["cached_blocks"] > 0 for s in stats)
    assert any(s["hash_seq"] > 0 for s in stats)  # the hash log the router mirrors, fed by the events


def test_vllm_metrics_reach_rays_prometheus_with_vllms_names(pool_app, vllm_fleet):
    from rayfleet.serving.vllm.prometheus_scrape import metric_sum, named, scrape_vllm_metrics

    samples = scrape_vllm_metrics()
    names = {s.name for s in samples}
    for wanted in ("num_requests_running", "prompt_tokens", "prefix_cache_hits", "kv_cache_usage_perc"):
        assert any(named(n, wanted) for n in names), (wanted, sorted(names)[:40])
    uids = replica_ids(vllm_fleet.dashboard_url, APP, "RayfleetLLMServer")
    assert {s.labels.get("ReplicaId") for s in samples} >= uids and len(uids) == 2  # one series set per replica
    # The repeated tenant prefixes above were served from the prefix cache.
    assert metric_sum(samples, "prefix_cache_hits") > 0
