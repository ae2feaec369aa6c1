"""Wide-EP serving on the shared local fleet: a disaggregated app whose decode pool is ONE replica
spanning 4 ranks (DP attention, experts split over the ranks, live EPLB) and whose prefill pool is
one 2-rank replica, over HTTP: prefilled KV goes from a prefill rank to a decode rank.

Checks: each gang's placement group holds the front and one H100 per rank, labelled; greedy
tokens of OpenAI requests (streamed and not, concurrent ones spread over the ranks by the DP
balancer) equal a single in-process engine's; under traffic that shifts between two token
topics the live EPLB moves expert weights between the ranks and no request fails; killing one
rank mid-stream loses no request (the gang re-forms, the stream goes on with the same tokens)
and leaves no KV block, reservation or lease behind.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests

from live_helpers import greedy_reference, free_port

from .conftest import wait_until

pytestmark = pytest.mark.cluster

MODEL = {"preset": "tiny", "seed": 7, "dtype": "float64",
         "overrides": {"max_seq_len": 1024, "init_std": 0.1, "num_experts": 8, "num_shared_experts": 0}}
ENGINE = {"block_size": 8, "num_blocks": 96, "max_num_seqs": 8, "max_num_batched_tokens": 96}
RANKS, PREFILL_RANKS = 4, 2
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def app(local_fleet):
    from ray import serve

    from rayfleet.serving.deployer import deploy

    pool = {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"}
    served = deploy({"name": "test-wide-ep", "model": MODEL, "engine": ENGINE, "mode": "disaggregated",
                     "prefill": {**pool, "ranks_per_replica": PREFILL_RANKS, "accelerators_per_replica": PREFILL_RANKS},
                     "decode": {**pool, "ranks_per_replica": RANKS, "accelerators_per_replica": RANKS},
                     # 8 experts + 4 redundant slots = 3 per rank; windows of 4 steps, re-placed every window
                     "expert_balancing": {"enabled": True, "num_redundant_experts": 4, "window_steps": 4,
                                          "history_windows": 2, "rebalance_every_windows": 1},
                     "http": {"port": free_port(), "route_prefix": "/wide", "auth": "disabled"},
                     "request_timeout_s": 60})
    try:
        yield served
    finally:
        served.shutdown()
        serve.shutdown()


@pytest.fixture(scope="module")
def reference():
    return greedy_reference(MODEL, ENGINE, max_tokens=MAX_TOKENS)


def _complete(url: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS, on_token=None) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    resp = requests.post(url + "/v1/completions", json=body, stream=stream, timeout=300)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["token_ids"]
    tokens = []
    for line in resp.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        event = json.loads(line.removeprefix(b"data: "))
        assert "error" not in event, event
        tokens += event["choices"][0]["token_ids"]
        if on_token is not None:
            on_token(tokens)
    return tokens


def _stats(served, role: str = "decode"):
    from ray import serve

    return serve.get_deployment_handle(role, app_name=served.name).wide_ep_stats.remote().result(timeout_s=60)


def _rank_actors(role: str = "decode") -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"wide-ep-{role}-rank-")]


def _concurrently(fn, args: list) -> list:
    results: list = [None] * len(args)
    errors: list = []

    def run(i: int) -> None:
        try:
            results[i] = fn(args[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised below with the others'
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _gang_groups(ranks: int) -> list[dict]:
    from ray.util import placement_group_table

    return [pg for pg in placement_group_table().values()
            if pg["state"] == "CREATED" and len(pg["bundles"]) == ranks + 1]


def test_each_gang_is_one_placement_group_of_labelled_h100_bundles(app, local_fleet):
    h100 = {n.ray_node_id for n in local_fleet.topology.nodes if n.accelerator_type == "H100"}
    for ranks, role in ((RANKS, "decode"), (PREFILL_RANKS, "prefill")):
        gangs = _gang_groups(ranks)
        assert len(gangs) == 1, gangs
        bundles = gangs[0]["bundles"]
        assert bundles[0] == {"CPU": 0.01} and all(bundles[i] == {"GPU": 1.0} for i in range(1, ranks + 1)), bundles
        assert set(gangs[0]["bundles_to_node_id"].values()) <= h100
        assert len(_rank_actors(role)) == ranks


def test_decode_gang_gives_single_engine_tokens_and_spreads_over_ranks(app, reference):
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "wide expert parallel", "hi", "rayfleet"]
    for prompt in prompts[:2]:
        assert _complete(app.url, prompt, stream=False) == reference(prompt)
        assert _complete(app.url, prompt, stream=True) == reference(prompt)
    many = [f"{p} #{i}" for i, p in enumerate(prompts * 2)]
    got = _concurrently(lambda p: _complete(app.url, p, stream=True, max_tokens=24), many)
    assert got == [reference(p, 24) for p in many]
    stats = _stats(app)
    assert stats.num_ranks == RANKS and sum(1 for n in stats.requests_per_rank if n) >= 2, stats
    prefill = _stats(app, "prefill")
    assert prefill.num_ranks == PREFILL_RANKS and all(prefill.requests_per_rank), prefill


def test_live_eplb_moves_expert_weights_under_shifting_traffic_without_failures(app, reference):
    before = len(_stats(app).moves)
    topics = ["aaaa eeee iiii oooo " * 3, "1234 5678 90 " * 4]  # byte ranges that route to different experts
    for topic in topics:
        prompts = [f"{topic}{i}" for i in range(4)]
        got = _concurrently(lambda p: _complete(app.url, p, stream=False, max_tokens=16), prompts)
        assert got == [reference(p, 16) for p in prompts]
    moves = _stats(app).moves[before:]
    assert moves and any(received > 0 for _, _, received, _ in moves), moves


def test_killing_a_rank_mid_stream_loses_no_request_and_leaks_nothing(app, reference):
    import ray

    prompt, max_tokens = "resume after a rank dies", 64
    expected = reference(prompt, max_tokens)
    killed: list[str] = []

    def kill_one(tokens: list[int]) -> None:
        if not killed and len(tokens) >= 5:
            victim = sorted(_rank_actors(), key=lambda a: a["name"])[2]
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
            killed.append(victim["name"])

    reforms = _stats(app).num_reforms
    group = _gang_groups(RANKS)[0]["placement_group_id"]
    others = ["keep serving", "while a rank dies"]
    results: dict = {}
    background = threading.Thread(target=lambda: results.update(got=_concurrently(
        lambda p: _complete(app.url, p, stream=True, max_tokens=40), others)))
    background.start()
    assert _complete(app.url, prompt, stream=True, max_tokens=max_tokens, on_token=kill_one) == expected
    background.join()
    assert results.get("got") == [reference(p, 40) for p in others]
    assert killed and killed[0] not in {a["name"] for a in _rank_actors()}
    stats = _stats(app)
    assert stats.num_reforms == reforms + 1 and stats.num_resumed >= 1, stats
    assert len(_rank_actors()) == RANKS
    assert [g["placement_group_id"] for g in _gang_groups(RANKS)] == [group]  # re-formed in place: no new group

    def clean():
        usage = app.block_usage()
        return all(u and u["num_free_blocks"] == u["num_blocks"] and u["num_requests"] == 0
                   and u["num_reserved"] == 0 and u["num_leases"] == 0 for u in usage.values()) and usage
    wait_until(clean, timeout_s=30, interval_s=0.5, what="every KV block of both pools free")
    assert _complete(app.url, "after the fault", stream=False) == reference("after the fault")
