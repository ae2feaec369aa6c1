"""A prefill/decode-split vLLM app started by ``rayfleet serve --detach`` (the CLI, hence the
same ``deploy()`` as ``fleet.serve()``; the session's ``pd_app``, reused by test_autoscale): KV
moves from the prefill engine to the decode engine over NIXL (UCX over host memory), proven by the
decode side's own connector counters, and the output equals a single engine's (transformers, and
the colocated pool's) for greedy requests."""

from __future__ import annotations

from .conftest import API_KEY, PD_APP as APP, PD_BLOCK as BLOCK, PD_MODEL as MODEL, long_prompt, replica_ids, wait_until


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=API_KEY, timeout=300, max_retries=0)


def _decode_counters(dashboard_url: str) -> dict[str, float]:
    """The decode replica's NIXL and external-prefix counters (Ray's Prometheus)."""
    from rayfleet.serving.vllm.prometheus_scrape import named, scrape_vllm_metrics

    decode, prefill = replica_ids(dashboard_url, APP, "Decode"), replica_ids(dashboard_url, APP, "Prefill")
    assert decode and prefill
    out = {"nixl_bytes": 0.0, "nixl_transfers": 0.0, "external_hits": 0.0, "prefill_prompt_tokens": 0.0}
    for s in scrape_vllm_metrics():
        replica = s.labels.get("ReplicaId", "")
        if replica in decode:
            if named(s.name, "nixl_bytes_transferred_sum"):
                out["nixl_bytes"] += s.value
            elif named(s.name, "nixl_bytes_transferred_count"):
                out["nixl_transfers"] += s.value
            elif named(s.name, "external_prefix_cache_hits"):
                out["external_hits"] += s.value
        elif replica in prefill and named(s.name, "prompt_tokens"):
            out["prefill_prompt_tokens"] += s.value
    return out


def test_decode_receives_the_prompts_kv_over_nixl(pd_app, vllm_fleet):
    """A prompt of several blocks: the decode engine must load its full blocks from the prefill
    engine (external prefix-cache hits, NIXL bytes), not recompute them."""
    url, spec = pd_app
    before = _decode_counters(vllm_fleet.dashboard_url)
    prompt = long_prompt(21, 200)  # a prompt no earlier test sent: nothing of it is cached anywhere
    reply = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8
    full_blocks_tokens = (reply.usage.prompt_tokens // BLOCK) * BLOCK
    assert full_blocks_tokens >= 4 * BLOCK

    def moved() -> dict[str, float] | None:
        now = _decode_counters(vllm_fleet.dashboard_url)
        delta = {k: now[k] - before[k] for k in now}
        # every counter read below, the prefill replica's too: Ray exports each replica's metrics on
        # its own clock (seen: the decode's had moved and the prefill's prompt_tokens not yet)
        return delta if (delta["external_hits"] >= full_blocks_tokens - BLOCK and delta["nixl_bytes"] > 0
                         and delta["prefill_prompt_tokens"] >= reply.usage.prompt_tokens) else None

    delta = wait_until(moved, timeout_s=60, interval_s=2, what="the decode replica's NIXL counters")
    # KV of one token of the tiny model in fp32: (K, V) x 2 layers x 2 KV heads x head_dim 32 x 4 bytes.
    assert spec.model.dtype == "float32"
    per_token = 2 * 2 * 2 * 32 * 4
    assert delta["nixl_bytes"] >= per_token * (full_blocks_tokens - BLOCK), delta
    assert delta["prefill_prompt_tokens"] >= reply.usage.prompt_tokens  # the prefill engine saw the prompt


def _hf_greedy_text(model_dir, prompt: str, max_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0)
    # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence (byte-level
    # BPE can stop mid-character); transformers renders it as U+FFFD. Seen live: equal tokens,
    # 'ingake$ix' vs 'ingake$ix\ufffd'.
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).rstrip("\ufffd")


def test_pd_output_equals_a_single_engine(pd_app, vllm_fleet, tiny_model_dir):
    """Greedy output through prefill -> NIXL -> decode equals transformers' greedy output (the
    outside oracle) and, when the colocated pool test ran first, the pool's output."""
    url, _ = pd_app
    client = _client(url)
    prompts = [long_prompt(seed, 100) for seed in range(2)]
    for prompt in prompts:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert reply.choices[0].text == _hf_greedy_text(tiny_model_dir, prompt, 10)
    colocated = vllm_fleet.results.get("colocated", {})
    for prompt, text in colocated.items():
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert reply.choices[0].text == text
