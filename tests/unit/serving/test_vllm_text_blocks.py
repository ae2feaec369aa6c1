"""Text blocks: the prefix identity shared by rayfleet's router and the vLLM replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rayfleet.serving.vllm.text_blocks import ServedBlocks, request_text, text_block_hashes


def test_hashes_are_chained_full_blocks_and_stable():
    a = text_block_hashes("abcdefgh" * 4, block_chars=8)
    assert len(a) == 4 and len(set(a)) == 4  # equal chunks, different prefixes -> different hashes
    assert text_block_hashes("abcdefgh" * 4 + "xyz", block_chars=8) == a  # partial block: no hash
    assert text_block_hashes("abcdefgh" * 4, block_chars=8) == a  # deterministic (no process salt)
    b = text_block_hashes("abcdefgX" + "abcdefgh" * 3, block_chars=8)
    assert not set(a) & set(b)  # a different first block changes every later hash
    c = text_block_hashes("abcdefgh" * 2 + "ZZZZZZZZ" * 2, block_chars=8)
    assert c[:2] == a[:2] and c[2:] != a[2:]  # the shared prefix keeps its hashes
    with pytest.raises(ValueError):
        text_block_hashes("x", block_chars=0)


def test_request_text_of_completions_and_chat():
    assert request_text(SimpleNamespace(prompt="hello")) == "hello"
    assert request_text(SimpleNamespace(prompt=["first", "second"])) == "first"
    chat = SimpleNamespace(prompt=None, messages=[{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert request_text(chat) == "<system>be brief<user>hi"
    assert request_text(SimpleNamespace(input="embed me")) is None


def test_served_blocks_evict_least_recently_used():
    served = ServedBlocks(capacity=3)
    served.add([1, 2, 3])
    served.add([1])  # touched: now the most recent
    served.add([4])
    assert served.hashes() == frozenset({1, 3, 4}) and len(served) == 3
    with pytest.raises(ValueError):
        ServedBlocks(0)


def test_metric_names_and_sums_from_prometheus_text():
    from rayfleet.serving.vllm.prometheus_scrape import metric_sum, named, parse_samples

    text = """# HELP ray_vllm:prompt_tokens_total Prompt tokens
# TYPE ray_vllm:prompt_tokens_total counter
ray_vllm:prompt_tokens_total{ReplicaId="app#A#1",model_name="m"} 120.0
ray_vllm:prompt_tokens_total{ReplicaId="app#A#2",model_name="m"} 30.0
# HELP ray_serve_num_http_requests_total Requests
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{route="/"} 5.0
"""
    samples = parse_samples(text)
    assert len(samples) == 2  # Serve's own metric is not vLLM's
    assert metric_sum(samples, "prompt_tokens") == 150.0
    assert metric_sum(samples, "prompt_tokens", ReplicaId="app#A#2") == 30.0
    assert metric_sum(samples, "generation_tokens") == 0.0
    assert named("ray_vllm:prefix_cache_hits_total", "prefix_cache_hits")
    assert named("ray_vllm:nixl_bytes_transferred_sum", "nixl_bytes_transferred_sum")
    assert named("ray_vllm_prompt_tokens_total", "prompt_tokens")  # ':' sanitized away
    assert not named("ray_vllm:external_prefix_cache_hits_total", "prefix_cache_hits")
    assert named("ray_vllm:external_prefix_cache_hits_total", "external_prefix_cache_hits")
