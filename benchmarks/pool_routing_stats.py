"""What a pool replica's routing stats cost: the hash log against the full set every time.

What it measures, for one replica holding ``--cached`` blocks (16-byte hashes, as the engine's)
that stores and evicts ``--churn`` blocks per stats period (0.5 s), over ``--periods`` periods:

- publication bytes: the pickled stats dict Serve ships to every router instance (mean and max),
- observe ms: ``PoolRouterCore.observe`` applying one new publication (mean),

for ``hash log`` (``routing.hash_log``: epoch, seq, a log of at most 4096 hashes, the full set
every 10 s) and the baseline ``full set`` (every cached hash in every publication, what replicas
published before; the same core still reads that shape). Then the decision path of a 64-replica
prefill pool (~100k indexed blocks, 8k-token prompts = 512 blocks of 16 tokens, half of each a
shared 256-block prefix): ``rank`` alone (the prompt is indexed afterwards by
``flush_bookings``) against ``rank`` + ``flush_bookings`` (indexing on the decision path, as
before). Pure Python, no Ray. Prints a table; ``--json OUT`` writes the figures; ``--quick``:
20k cached blocks, 60 periods, 300 decisions.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import time
from pathlib import Path

from common import Table, cpu_name, record_run  # benchmarks/common.py (this script's directory is on sys.path)

from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint

SNAP = {"num_total_blocks": 120_000, "num_free_blocks": 20_000, "num_active_blocks": 0, "num_queued_blocks": 0,
        "num_running_requests": 0, "max_num_seqs": 256}
PERIOD_S = 0.5


def publications(*, num_cached: int, churn: int, periods: int, full_every_time: bool, seed: int = 0) -> dict:
    """Bytes per publication and observe time per publication for one publishing scheme."""
    rng = random.Random(seed)
    cached = [rng.randbytes(16) for _ in range(num_cached)]
    pub = HashLogPublisher()
    pub.apply([KVCacheEvent(stored=tuple(cached))])
    core = PoolRouterCore(role="prefill")
    sizes, observe_s = [], []
    for version in range(periods):
        if version:
            new = tuple(rng.randbytes(16) for _ in range(churn))
            old = tuple(cached[:churn])
            del cached[:churn]
            cached.extend(new)
            pub.apply([KVCacheEvent(stored=new), KVCacheEvent(removed=old)])
        hashes = {"block_hashes": tuple(pub.cached)} if full_every_time else pub.fields(version * PERIOD_S)
        stats = {"version": version, **SNAP, **hashes}
        sizes.append(len(pickle.dumps(stats)))
        start = time.perf_counter()
        core.observe("r", stats)
        observe_s.append(time.perf_counter() - start)
    assert core.index.num_blocks_on("r") == len(pub.cached)  # both schemes leave the exact set
    steady = observe_s[1:]  # the first publication builds the index from nothing in both
    return {"bytes_mean": statistics.mean(sizes[1:]), "bytes_max": max(sizes[1:]),
            "observe_ms_mean": 1e3 * statistics.mean(steady)}


def decisions(*, num_replicas: int, num_decisions: int, seed: int = 1) -> dict:
    """p50/p99 of ``rank`` alone and of ``rank`` + ``flush_bookings``, interleaved per decision."""
    rng = random.Random(seed)
    prefixes = [[rng.randbytes(16) for _ in range(256)] for _ in range(64)]
    cores = {"deferred": PoolRouterCore(role="prefill"), "inline": PoolRouterCore(role="prefill")}
    for i in range(num_replicas):
        held = tuple(h for p in prefixes[i::num_replicas] for h in p) + tuple(rng.randbytes(16) for _ in range(1300))
        for core in cores.values():
            core.observe(f"r{i}", {"version": 0, **SNAP, "block_hashes": held})
    names = [f"r{i}" for i in range(num_replicas)]
    times: dict[str, list[float]] = {k: [] for k in cores}
    for k in range(num_decisions):
        hint = RouteHint(block_hashes=tuple(rng.choice(prefixes) + [rng.randbytes(16) for _ in range(256)]),
                         num_prompt_blocks=512)
        for name, core in cores.items():
            start = time.perf_counter()
            core.rank(names, hint, now_s=k * 0.01)
            if name == "inline":
                core.flush_bookings()
            times[name].append(time.perf_counter() - start)
            if name == "deferred":
                core.flush_bookings()  # after the answer, as the request router does
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"p50_ms": 1e3 * ts[len(ts) // 2], "p99_ms": 1e3 * ts[int(len(ts) * 0.99)]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cached", type=int, default=100_000)
    parser.add_argument("--churn", type=int, default=32)
    parser.add_argument("--periods", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cached, periods, num_decisions = (20_000, 60, 300) if args.quick else (args.cached, args.periods, 2000)
    log = publications(num_cached=cached, churn=args.churn, periods=periods, full_every_time=False)
    full = publications(num_cached=cached, churn=args.churn, periods=periods, full_every_time=True)
    rank = decisions(num_replicas=64, num_decisions=num_decisions)
    results = {"cpu": cpu_name(), "cached_blocks": cached, "churn_per_period": args.churn, "periods": periods,
               "hash_log": log, "full_set": full, "decision": rank}
    print(f"one replica, {cached} cached blocks, {args.churn} stored + {args.churn} evicted per {PERIOD_S} s "
          f"period, {periods} periods ({cpu_name()})")
    print(f"{'publication':<22}{'bytes mean':>12}{'bytes max':>12}{'observe ms':>12}")
    for name, r in (("full set (baseline)", full), ("hash log", log)):
        print(f"{name:<22}{r['bytes_mean']:>12.0f}{r['bytes_max']:>12}{r['observe_ms_mean']:>12.3f}")
    print(f"decision path, 64 replicas, 512-block prompts, {num_decisions} decisions")
    print(f"{'path':<32}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'rank + index (baseline)':<32}{rank['inline']['p50_ms']:>10.3f}{rank['inline']['p99_ms']:>10.3f}")
    print(f"{'rank, index after':<32}{rank['deferred']['p50_ms']:>10.3f}{rank['deferred']['p99_ms']:>10.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    publication = Table(["publication", "bytes mean", "bytes max", "observe ms"],
                        [[name, f"{r['bytes_mean']:.0f}", str(r["bytes_max"]), f"{r['observe_ms_mean']:.3f}"]
                         for name, r in (("full set (baseline)", full), ("hash log", log))],
                        note=f"one replica, {cached:,} cached blocks, {args.churn} stored + {args.churn} evicted "
                             f"per {PERIOD_S} s period, {periods} periods")
    decision = Table(["path", "p50 ms", "p99 ms"],
                     [["rank + index (baseline)", f"{rank['inline']['p50_ms']:.3f}", f"{rank['inline']['p99_ms']:.3f}"],
                      ["rank, index after", f"{rank['deferred']['p50_ms']:.3f}", f"{rank['deferred']['p99_ms']:.3f}"]],
                     note=f"64 replicas, 512-block prompts, {num_decisions} decisions")
    # No goal is stated for this one: it compares with its baseline (the full set every period).
    record_run(name="pool_routing_stats", quick=args.quick,
               params={"cached_blocks": cached, "churn": args.churn, "periods": periods, "decisions": num_decisions},
               figures={k: v for k, v in results.items() if k != "cpu"},
               tables={"publication": publication, "decision": decision})


if __name__ == "__main__":
    main()
