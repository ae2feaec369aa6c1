"""KV cache tiers benchmark: Mooncake trace replay, token hit rate and TTFT, engine-only vs tiered.

    python benchmarks/kv_tiers.py            # ~2-3 min on 2 cores
    python benchmarks/kv_tiers.py --quick    # fewer requests, < 1 min

Trace: ``traces/mooncake_synthetic.jsonl`` (``--trace`` or ``RAYFLEET_TRACE_DIR`` for another;
kvcache-ai/Mooncake, FAST'25 release, synthetic_trace.jsonl; Apache-2.0): 3,993 requests, each a list of ``hash_ids``, one per 512-token
block, equal ids meaning equal prefix content. Prompts are built from the ids: block id ``i`` is
512 tokens whose first four encode ``i`` and the rest a fixed pattern, so equal ids give equal
tokens and the engine's own chained block hashes (``block_hash``) see exactly the trace's reuse.
Requests are replayed one after another in trace order (hit rate does not depend on timing).

Part 1 (hit rate, whole trace): each trace block becomes one KV block of 16 tokens (512 / 32:
token counts scale by 1/32 everywhere, so token hit rates are unchanged up to the rounding of
each prompt's partial last block, and the replay is 32x cheaper). The real ``Scheduler``, ``KVCacheManager``,
``BlockPool``, ``KVTierConnector``, host pool and disk tier (checksummed files in a temp dir),
with capacities engine:host:disk = N:4N:64N blocks (the sizing rule below). Only the model is left out: 3,993 prompts of
up to 191k tokens cannot be prefilled on a CPU, and the hit rate does not depend on the numbers
in the KV. A stand-in forward writes each token's id and position into its KV slot (a KV tensor
of 1 layer x 1 head x 1 dim), and every prompt's KV is read back through its block table after
its prefill and checked against the tokens: blocks that came from host memory or disk must hold
exactly the KV of their prefix (reported as "KV mismatches", must be 0). Token hit rate = prompt
tokens served from cache / prompt tokens; the infinite-cache bound is the same count with a
cache that never evicts (a block hits if its id was seen before, along a prefix, capped one
token short of the prompt like the engine). Goal: tiered >= 90% of the bound.

Part 2 (TTFT, real prefill): the real ``LLMEngine`` running the tiny MoE model (float32, one
CPU thread) with and without tiers, on a scaled-down sample: ``--ttft-requests`` requests, in
trace order, of the first conversations (requests sharing their first block id) that have at
least two requests (``session_sample``; a plain prefix of the trace has almost no reuse among
its first requests), each trace block scaled from 512 to 16 tokens (block_size 16; a 40k-token
prompt becomes 1,255 tokens) and prompts capped at 1,024 tokens, pools of N:4N:64N blocks with N
= 96 (1,536 tokens, so the engine alone holds about two prompts). Each request runs alone;
TTFT = time from ``add_request`` to its first token (loads from host/disk included); the two
engines run in lockstep, request by request, so load from other processes hits both alike. The first
tokens of both runs must agree.

Writes ``benchmarks/results/kv_tiers.json``; prints a table last. Everything runs on this
machine's CPU: compare rows within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import Goal, Table, record_run, trace_file  # noqa: E402  (benchmarks/common.py, beside this script)
from rayfleet.models import PagedKVCache, build_model, preset  # noqa: E402
from rayfleet.serving.engine.block_hash import root_block_hash  # noqa: E402
from rayfleet.serving.engine.block_pool import BlockPool  # noqa: E402
from rayfleet.serving.engine.engine_config import EngineConfig  # noqa: E402
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from rayfleet.serving.kv.tier_connector import KVTierConnector  # noqa: E402
from rayfleet.serving.kv.tiers import NodeKVTiers  # noqa: E402
from rayfleet.serving.engine.request import Request, RequestId  # noqa: E402
from rayfleet.serving.engine.sampling import SamplingParams  # noqa: E402
from rayfleet.serving.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402

TRACE_NAME = "mooncake_synthetic.jsonl"
RESULTS = ROOT / "benchmarks" / "results"
TRACE_BLOCK = 512
SCALE = 32  # tokens per trace block: 512 -> 16 (see module doc)
# The sizing rule, the same for every trace: the tiers keep an HGX H100 server's proportions.
# KV gets about half of 640 GB HBM (N), host memory about 1.5 of its 2 TB (~4.7N), NVMe about
# 24 of its 30 TB (~75N); rounded down to N:4N:64N. (Until 2026-11 the benchmark used 16N of
# disk, a quarter of what such a server has, and stopped at 0.86 of the bound on a long
# multi-turn conversation trace.)
HOST_RATIO, DISK_RATIO = 4, 64


def load_trace(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def block_tokens(block_id: int, size: int) -> np.ndarray:
    """``size`` tokens standing for trace block ``block_id`` (ids < 256: byte tokens)."""
    tokens = (np.arange(size, dtype=np.int64) * 37 + 11) % 251
    tokens[:4] = [(block_id >> s) & 0xFF for s in (0, 8, 16, 24)]
    return tokens


def build_prompt(row: dict, *, scale: int = 1, cap: int | None = None) -> list[int]:
    """The prompt of one trace row: its blocks' tokens, cut to ``input_length`` (both / scale)."""
    size = TRACE_BLOCK // scale
    length = -(-row["input_length"] // scale)
    tokens = np.concatenate([block_tokens(i, size) for i in row["hash_ids"]])[:length]
    return tokens[:cap].tolist() if cap else tokens.tolist()


def infinite_bound(rows: list[dict], *, scale: int = 1, cap: int | None = None) -> float:
    """Token hit rate of a cache that never evicts (same one-token-short cap as the engine)."""
    size = TRACE_BLOCK // scale
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        n = len(build_prompt(row, scale=scale, cap=cap)) if cap else -(-row["input_length"] // scale)
        blocks = row["hash_ids"][:-(-n // size)]
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        hit += min(k, (n - 1) // size) * size
        total += n
        seen.update(blocks)
    return hit / total


def session_sample(rows: list[dict], n: int) -> list[dict]:
    """``n`` requests, in trace order, of the conversations (requests sharing their first block
    id) that have at least two requests, taken in order of first appearance: a small sample that
    keeps the trace's reuse pattern among the requests it keeps."""
    by_first: dict[int, list[dict]] = {}
    for row in rows:
        by_first.setdefault(row["hash_ids"][0], []).append(row)
    keep: set[int] = set()
    count = 0
    for first, group in by_first.items():
        if len(group) >= 2 and count < n:
            keep.add(first)
            count += len(group)
    return [row for row in rows if row["hash_ids"][0] in keep][:n]


# -- part 1: hit rate over the whole trace ------------------------------------------------------


def replay_hit_rate(rows: list[dict], *, engine_blocks: int, tiered: bool, disk_dir: str, scale: int) -> dict:
    block_size = TRACE_BLOCK // scale
    pool = BlockPool(engine_blocks)
    manager = KVCacheManager(pool, block_size=block_size, enable_prefix_caching=True)
    max_len = engine_blocks * block_size
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max_len, max_model_len=max_len),
                      manager)
    # KV of 1 layer x 1 head x 1 dim: k = token id, v = position (see module doc).
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=engine_blocks, block_size=block_size, num_kv_heads=1,
                                  head_dim=1, dtype=torch.float32)
    node = connector = None
    if tiered:
        node = NodeKVTiers("bench", host_blocks=HOST_RATIO * engine_blocks, disk_uri=disk_dir, disk_blocks=DISK_RATIO * engine_blocks)
        connector = KVTierConnector(node)
        connector.attach(block_pool=pool, kv_cache=cache, block_size=block_size)
    root = root_block_hash(model_id="mooncake")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    k_flat, v_flat = cache.k.view(-1), cache.v.view(-1)
    mismatches = 0
    start = time.perf_counter()
    for n, row in enumerate(rows):
        prompt = build_prompt(row, scale=scale)
        request = Request(request_id=RequestId(f"r{n}"), prompt_token_ids=prompt, sampling_params=params,
                          block_size=block_size, root_hash=root, arrival_index=n)
        sched.add_request(request)
        while sched.has_unfinished_requests():
            if connector is not None and sched.waiting:
                connector.before_schedule(sched.waiting, admit_window=1, num_reserved_blocks=0)
            out = sched.schedule()
            for chunk in out.chunks:  # the stand-in forward: write each token's KV slot
                pos = torch.arange(chunk.start_position, chunk.start_position + len(chunk.token_ids))
                table = torch.tensor(chunk.block_ids, dtype=torch.long)
                slots = table[pos // block_size] * block_size + pos % block_size
                k_flat[slots] = torch.tensor(chunk.token_ids, dtype=torch.float32)
                v_flat[slots] = pos.to(torch.float32)
                if chunk.sample:  # prefill done: the whole prompt's KV must be right
                    pos = torch.arange(len(prompt))
                    table = torch.tensor(chunk.block_ids, dtype=torch.long)
                    slots = table[pos // block_size] * block_size + pos % block_size
                    ok = (torch.equal(k_flat[slots], torch.tensor(prompt, dtype=torch.float32))
                          and torch.equal(v_flat[slots], pos.to(torch.float32)))
                    mismatches += not ok
            sched.update_from_output(out, {c.request_id: 0 for c in out.chunks if c.sample})
    result = {"engine_blocks": engine_blocks, "tiered": tiered,
              "hit_rate": manager.prefix_hit_tokens / manager.prefix_query_tokens,
              "hit_tokens": manager.prefix_hit_tokens, "prompt_tokens": manager.prefix_query_tokens,
              "kv_mismatches": mismatches, "seconds": time.perf_counter() - start}
    if connector is not None:
        s, t = connector.stats(), node.stats()
        result.update(host_blocks=HOST_RATIO * engine_blocks, disk_blocks=DISK_RATIO * engine_blocks,
                      loaded_from_host=s.loaded_from_host, loaded_from_disk=s.loaded_from_disk,
                      written_back=s.written_back, writes_to_disk=t.writes_to_disk, disk_corrupt=t.num_corrupt)
        node.shutdown()
    return result


# -- part 2: TTFT with real prefill -------------------------------------------------------------


def measure_ttft(rows: list[dict], *, disk_dir: str, engine_blocks: int = 96, scale: int = 32,
                 cap: int = 1024) -> dict[str, dict]:
    """Engine-only and tiered engines of the same model, driven in lockstep (request n on one,
    then on the other) so that load from other processes on a shared machine hits both alike."""
    block_size = TRACE_BLOCK // scale
    node = NodeKVTiers("bench", host_blocks=HOST_RATIO * engine_blocks, disk_uri=disk_dir, disk_blocks=DISK_RATIO * engine_blocks)
    config = EngineConfig(block_size=block_size, num_blocks=engine_blocks, max_num_seqs=1,
                          max_num_batched_tokens=2048, model_id="mooncake")
    model = build_model(preset("tiny"), seed=0, dtype=torch.float32)
    engines = {"engine_only": LLMEngine(model, config), "tiered": LLMEngine(model, config, kv_tiers=KVTierConnector(node))}
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    first_tokens: dict[str, list[int]] = {name: [] for name in engines}
    for n, row in enumerate(rows):
        prompt = build_prompt(row, scale=scale, cap=cap)
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.add_request(f"r{n}", prompt, params)
            outs = []
            while not outs:
                outs = [o for o in engine.step() if o.new_token_ids]
            ttfts[name].append(time.perf_counter() - t0)
            first_tokens[name].append(outs[0].new_token_ids[0])
    results = {}
    for name, engine in engines.items():
        t = ttfts[name]
        results[name] = {"ttft_mean_s": statistics.mean(t), "ttft_p50_s": statistics.median(t),
                         "ttft_p90_s": float(np.percentile(t, 90)),
                         "hit_rate": engine.kv_cache_manager.stats().prefix_hit_rate,
                         "first_tokens": first_tokens[name]}
    s = engines["tiered"].kv_tiers.stats()
    results["tiered"].update(loaded_from_host=s.loaded_from_host, loaded_from_disk=s.loaded_from_disk)
    node.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first 1,000 requests, 60 TTFT requests")
    parser.add_argument("--engine-blocks", type=int, default=1280, help="N: engine pool of part 1 (host 4N, disk 64N)")
    parser.add_argument("--ttft-requests", type=int, default=None)
    parser.add_argument("--trace", type=Path, default=None,
                        help=f"Mooncake-format JSONL (default: {TRACE_NAME} in $RAYFLEET_TRACE_DIR or traces/)")
    parser.add_argument("--json", type=Path, default=RESULTS / "kv_tiers.json", help="where the results go")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trace = trace_file(TRACE_NAME, args.trace)
    rows = load_trace(trace, 1000 if args.quick else None)
    n_ttft = args.ttft_requests or (60 if args.quick else 150)
    print(f"trace: {trace}, {len(rows)} requests; engine:host:disk = {args.engine_blocks}:"
          f"{HOST_RATIO * args.engine_blocks}:{DISK_RATIO * args.engine_blocks} blocks (one per trace block)", flush=True)
    with tempfile.TemporaryDirectory(prefix="rayfleet-kv-bench-") as tmp:
        bound = infinite_bound(rows, scale=SCALE)
        engine_only = replay_hit_rate(rows, engine_blocks=args.engine_blocks, tiered=False, disk_dir=tmp, scale=SCALE)
        print(f"  engine-only replay: {engine_only['seconds']:.1f} s", flush=True)
        tiered = replay_hit_rate(rows, engine_blocks=args.engine_blocks, tiered=True, disk_dir=os.path.join(tmp, "p1"),
                                 scale=SCALE)
        print(f"  tiered replay: {tiered['seconds']:.1f} s", flush=True)
        sample = session_sample(load_trace(trace, None), n_ttft)
        ttft_bound = infinite_bound(sample, scale=32, cap=1024)
        ttft = measure_ttft(sample, disk_dir=os.path.join(tmp, "p2"))
        base, tier = ttft["engine_only"], ttft["tiered"]
    assert base["first_tokens"] == tier["first_tokens"], "tiers changed a first token"
    assert engine_only["kv_mismatches"] == 0 and tiered["kv_mismatches"] == 0, "wrong KV served"
    result = {"when": datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "trace": trace.name,
              "requests": len(rows), "infinite_bound": bound, "engine_only": engine_only, "tiered": tiered,
              "tiered_hit_rate": tiered["hit_rate"], "bound": bound,
              "sizing_rule": f"engine:host:disk = N:{HOST_RATIO}N:{DISK_RATIO}N, N = {args.engine_blocks}",
              "ttft_requests": n_ttft, "ttft_bound": ttft_bound,
              "ttft_engine_only": {k: v for k, v in base.items() if k != "first_tokens"},
              "ttft_tiered": {k: v for k, v in tier.items() if k != "first_tokens"}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}\n")
    print(f"ran on: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads 1; "
          f"part 2 = tiny MoE float32, trace blocks 512 -> 16 tokens, prompts <= 1024 tokens")
    print(f"part 1: {len(rows)} requests, {engine_only['prompt_tokens']:,} prompt tokens; KV mismatches "
          f"{engine_only['kv_mismatches']} / {tiered['kv_mismatches']}; tier loads host {tiered['loaded_from_host']:,}"
          f" disk {tiered['loaded_from_disk']:,} blocks\n")
    print(f"{'configuration':<34}{'token hit rate':>15}{'/ bound':>9}")
    for name, rate in (("engine only (N)", engine_only["hit_rate"]), ("tiered (N + 4N host + 64N disk)", tiered["hit_rate"]),
                       ("infinite cache (bound)", bound)):
        print(f"{name:<34}{rate:>15.3f}{rate / bound:>9.2f}")
    print(f"\nTTFT, {n_ttft} requests, real prefill{'':<6}{'hit rate':>9}{'mean ms':>9}{'p50 ms':>8}{'p90 ms':>8}")
    for name, r in (("engine only", base), ("tiered", tier)):
        print(f"{name:<42}{r['hit_rate']:>9.3f}{r['ttft_mean_s'] * 1e3:>9.1f}{r['ttft_p50_s'] * 1e3:>8.1f}"
              f"{r['ttft_p90_s'] * 1e3:>8.1f}")
    print(f"{'infinite cache (bound)':<42}{ttft_bound:>9.3f}")
    print(f"TTFT speed-up (mean): {base['ttft_mean_s'] / tier['ttft_mean_s']:.2f}x")
    hits = [[name, f"{rate:.3f}", f"{rate / bound:.2f}"] for name, rate in (
        ("engine only (N)", engine_only["hit_rate"]), ("tiered (N + 4N host + 64N disk)", tiered["hit_rate"]),
        ("infinite cache (bound)", bound))]
    ttft_rows = [[name, f"{r['hit_rate']:.3f}", f"{r['ttft_mean_s'] * 1e3:.1f}", f"{r['ttft_p50_s'] * 1e3:.1f}",
                  f"{r['ttft_p90_s'] * 1e3:.1f}"] for name, r in (("engine only", base), ("tiered", tier))]
    record_run(name="kv_tiers", quick=args.quick,
               params={"trace": trace.name, "requests": len(rows), "engine_blocks": args.engine_blocks,
                       "ttft_requests": n_ttft},
               figures={k: v for k, v in result.items() if k not in ("when", "machine", "cpu_count")},
               goals=[Goal("tiered token hit rate / infinite-cache bound", ">=", 0.9, tiered["hit_rate"] / bound)],
               tables={"hit_rate": Table(["configuration", "token hit rate", "/ bound"], hits,
                                         note=result["sizing_rule"]),
                       "ttft": Table(["TTFT, real prefill", "hit rate", "mean ms", "p50 ms", "p90 ms"], ttft_rows)})


if __name__ == "__main__":
    main()
