"""The serving benchmark's pure parts (no Ray; ``serving.py`` runs them and records them):
part 1, the router's decision time over 64 replica snapshots and a 100k-block prefix index, and
the trace replays of the routing policy (``rayfleet.serving.routing.trace_replay``) with their
goals and docs table."""

from __future__ import annotations

import random
import time
from pathlib import Path

from common import Goal, Table, pct, text_table  # benchmarks/common.py, beside this module


# -- part 1: router decision time ---------------------------------------------------------------

def router_decision_time(*, num_replicas: int = 64, num_blocks: int = 100_000, trials: int = 2000,
                         prompt_tokens: int = 8192) -> dict:
    from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
    from rayfleet.serving.routing.prefix_index import PrefixIndex
    from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
    from rayfleet.serving.routing.router import RouterCore
    from rayfleet.serving.routing.policy import RouterPolicy
    from rayfleet.serving.routing.ttft_cost import TTFTPolicy

    rng = random.Random(0)
    root = root_block_hash(model_id="bench")
    index = PrefixIndex()
    prefixes = []
    per_chain = prompt_tokens // 16  # 8k-token prompts: 512 blocks of 16 tokens
    while index.num_indexed_blocks < num_blocks:
        tokens = [rng.randrange(256) for _ in range(per_chain * 16)]
        chain = hash_full_blocks(tokens, block_size=16, root=root)
        for r in rng.sample(range(num_replicas), 2):
            index.add_blocks(ReplicaId(f"r{r}"), chain)
        prefixes.append(chain)
    snaps = [ReplicaSnapshot(ReplicaId(f"r{i}"), 4096, rng.randrange(0, 4096), rng.randrange(0, 3000),
                             rng.randrange(0, 200), rng.randrange(0, 32), 32) for i in range(num_replicas)]
    policy = TTFTPolicy()  # the default cost; the block-unit one (prefix_load) is timed beside it
    rates = {s.replica_id: 3000.0 + 100 * i for i, s in enumerate(snaps)}  # measured rates differ per replica
    prefix_aware, choose_cpu, rr = [], [], []
    import gc

    gc.collect()
    gc.disable()  # a collection of the 100k-entry index would be timed as a decision
    rr_core = RouterCore(roles={"colocated": [f"r{i}" for i in range(num_replicas)]}, mode="round_robin",
                         block_size=16, model_id="bench")
    # The full live path too: RouterCore.route (one prefix walk, booking, the recent-work ledger)
    # given the prompt's hashes (the ingress hashes a prompt once; hashing is timed apart).
    core = RouterCore(roles={"colocated": [f"r{i}" for i in range(num_replicas)]}, block_size=16,
                      model_id="bench", policy=policy)
    core.index = index
    core.snapshots = {s.replica_id: s for s in snaps}
    for rid, rate in rates.items():
        core.prefill_rates.observe(rid, 8192, 8192 / rate)
    old = RouterCore(roles={"colocated": [f"r{i}" for i in range(num_replicas)]}, block_size=16,
                     model_id="bench", policy=RouterPolicy())
    old.index = index
    old.snapshots = dict(core.snapshots)
    route, route_cpu, old_cpu, hashing, booking = [], [], [], [], []
    for trial in range(trials):
        chain = rng.choice(prefixes)
        cut = rng.randrange(1, per_chain)
        tokens = [rng.randrange(256) for _ in range(16 * (per_chain - cut))]
        t0 = time.perf_counter()
        tail = hash_full_blocks(tokens, block_size=16, root=chain[cut - 1])
        hashing.append(time.perf_counter() - t0)
        query = chain[:cut] + tail
        t0, c0 = time.perf_counter(), time.thread_time()
        policy.choose_prefill(snaps, query, index, prefill_rate=rates, tokens_per_block=16)
        prefix_aware.append(time.perf_counter() - t0)
        choose_cpu.append(time.thread_time() - c0)
        t0, c0 = time.perf_counter(), time.thread_time()
        core.route([0] * prompt_tokens, max_tokens=64, block_hashes=query, now_s=trial * 0.01)
        route.append(time.perf_counter() - t0)
        route_cpu.append(time.thread_time() - c0)  # wall p99 on a shared machine is the OS scheduler
        t0 = time.perf_counter()  # the live shell indexes the routed prompt after answering
        core.flush_bookings()
        booking.append(time.perf_counter() - t0)
        c0 = time.thread_time()
        old.route([0] * prompt_tokens, max_tokens=64, block_hashes=query, now_s=trial * 0.01)
        old_cpu.append(time.thread_time() - c0)
        old.flush_bookings()
        t0 = time.perf_counter()
        rr_core._round_robin("colocated", snaps)
        rr.append(time.perf_counter() - t0)
    gc.enable()
    return {"num_replicas": num_replicas, "indexed_blocks": index.num_indexed_blocks, "prompt_blocks": per_chain,
            "prefix_aware_p50_ms": pct(prefix_aware, 50) * 1e3, "prefix_aware_p99_ms": pct(prefix_aware, 99) * 1e3,
            "route_p50_ms": pct(route, 50) * 1e3, "route_p99_ms": pct(route, 99) * 1e3,
            "route_cpu_p99_ms": pct(route_cpu, 99) * 1e3, "route_cpu_p50_ms": pct(route_cpu, 50) * 1e3,
            "choose_cpu_p99_ms": pct(choose_cpu, 99) * 1e3,
            "prefix_load_route_cpu_p99_ms": pct(old_cpu, 99) * 1e3, "policy": policy.name,
            "hash_uncached_p50_ms": pct(hashing, 50) * 1e3, "index_update_p50_ms": pct(booking, 50) * 1e3,
            "round_robin_p99_ms": pct(rr, 99) * 1e3}


# -- trace replay of the routing policy (pure) ----------------------------------------------------

# The conversation traces of the router replay table (docs/serving.md), fixed before measuring:
# ``trace_replay.multi_turn_trace`` keyword arguments, replayed by ``--trace FILE --conversations``.
CONVERSATION_TRACES = (
    dict(num_conversations=400, turns=8, seed=3, turn_blocks=(1, 8), system_blocks=4),
    dict(num_conversations=400, turns=8, seed=11, turn_blocks=(1, 8), system_blocks=4),
    dict(num_conversations=300, turns=12, seed=9, turn_blocks=(1, 4), system_blocks=2),
    dict(num_conversations=1000, turns=6, seed=8, turn_blocks=(1, 8), system_blocks=4),
    dict(num_conversations=200, turns=10, seed=7, turn_blocks=(2, 10), system_blocks=4),
)


def conversation_label(kw: dict) -> str:
    return (f"C={kw['num_conversations']}, T={kw['turns']}, S={kw['seed']}, B={tuple(kw['turn_blocks'])}, "
            f"K={kw['system_blocks']}")


def routing_replay(trace_path: Path | None, *, replica_counts: tuple[int, ...] = (8, 16, 64),
                   limit: int | None = None, requests: list | None = None, label: str | None = None) -> dict:
    """Replay a Mooncake-format trace (or ``requests`` already built, named ``label``) through the
    router at each pool size (see ``rayfleet.serving.routing.trace_replay``). Cache rule, the same
    for every trace: each replica holds twice its fair share of the trace's distinct blocks (a pool
    with large caches), so the bound is reachable and what separates policies is where they send
    requests."""
    from rayfleet.serving.routing.policy import RouterPolicy
    from rayfleet.serving.routing.trace_replay import read_mooncake_trace, replay_routing
    from rayfleet.serving.routing.ttft_cost import TTFTPolicy

    name = label or str(trace_path)
    if requests is None:
        requests = read_mooncake_trace(trace_path, limit=limit)
    distinct = len({b for r in requests for b in r.block_ids})
    out = {}
    for n in replica_counts:
        cache = max(1, -(-2 * distinct // n))
        rows = {}
        # Running requests booked as the live router books them (issue 30). Baselines in the same
        # run: the block-unit cost (the default before), with the opt-in spread term, and unbooked
        # (the replay before issue 30, which hid what running requests do to it); round robin.
        for label, policy, booked in (("rayfleet", TTFTPolicy(), True), ("prefix_load", RouterPolicy(), True),
                                      ("spread_opt_in", RouterPolicy(spread_weight=3.0), True),
                                      ("prefix_load_unbooked", RouterPolicy(), False), ("round_robin", None, True)):
            r = replay_routing(requests, policy=policy, num_replicas=n, cache_blocks=cache, label=label,
                               book_running=booked, timer=time.perf_counter)
            rows[label] = {"hit_rate": r.hit_rate, "bound": r.bound, "share_of_bound": r.share_of_bound,
                           "load_max_mean": r.load_max_mean, "route_p50_ms": r.route_p50_ms,
                           "route_p99_ms": r.route_p99_ms, "cache_blocks": cache}
        out[str(n)] = {**rows["rayfleet"], "baselines": {k: v for k, v in rows.items() if k != "rayfleet"}}
    mean_prompt = sum(r.input_tokens for r in requests) / max(1, len(requests))
    return {"trace": name, "num_requests": len(requests), "mean_prompt_tokens": mean_prompt,
            "replicas": out}


def replay_record(replays: list[dict], router: dict) -> tuple[list, dict]:
    """The goals and the docs table of a replay run (``record_run``'s arguments)."""
    goals = [Goal("decision (lookup + scoring) p99 (thread CPU), 64 replicas, 8k-token prompts, ms", "<=", 1.0,
                  router["choose_cpu_p99_ms"]),
             Goal("route p99 (thread CPU), 64 replicas, 512-block prompts, ms", "<=", 1.0, router["route_cpu_p99_ms"]),
             Goal("route p99 (wall), 64 replicas, 512-block prompts, ms", "<=", 1.0, router["route_p99_ms"])]
    rows = []
    for rp in replays:
        counts = list(rp["replicas"])
        default = [rp["replicas"][n] for n in counts]
        base = lambda key: [rp["replicas"][n]["baselines"][key] for n in counts]  # noqa: E731
        for n, row in zip(counts, default):
            goals.append(Goal(f"{rp['trace']}, {n} replicas: share of bound (default TTFT cost, running booked)",
                              ">=", 0.95, row["share_of_bound"]))
            goals.append(Goal(f"{rp['trace']}, {n} replicas: load max/mean (default TTFT cost, running booked)",
                              "<=", 1.1, row["load_max_mean"]))
        cell = lambda rs, key, fmt: " / ".join(format(r[key], fmt) for r in rs)  # noqa: E731
        rows.append([f"{rp['trace']} ({rp['num_requests']:,} req., mean prompt {rp['mean_prompt_tokens'] / 1e3:.0f}k tokens)",
                     f"{cell(default, 'share_of_bound', '.3f')}, {cell(default, 'load_max_mean', '.2f')}",
                     f"{cell(base('prefix_load'), 'share_of_bound', '.3f')}, {cell(base('prefix_load'), 'load_max_mean', '.2f')}",
                     cell(base("spread_opt_in"), "share_of_bound", ".3f"),
                     f"{cell(base('prefix_load_unbooked'), 'share_of_bound', '.3f')}, "
                     f"{cell(base('prefix_load_unbooked'), 'load_max_mean', '.2f')}",
                     cell(base("round_robin"), "share_of_bound", ".2f")])
    counts = " / ".join(replays[0]["replicas"]) if replays else ""
    table = Table([f"trace (replicas {counts})", "rayfleet (TTFT cost): share of bound, load max/mean",
                   "prefix_load (block-unit cost): share, load", "prefix_load + spread term: share",
                   "prefix_load, running not booked (the replay before issue 30): share, load", "round robin share"],
                  rows, "running requests booked as the live router books them, state published every 0.1 s, "
                        "except where the column says not")
    return goals, {"router_replay": table}


def print_replay(replay: dict) -> None:
    header = ["replicas", "policy", "hit rate", "bound", "share", "load max/mean", "route p50 ms", "route p99 ms"]
    rows = []
    for n, r in replay["replicas"].items():
        for label, row in (("rayfleet", r), *r["baselines"].items()):
            rows.append([n, label, f"{row['hit_rate']:.3f}", f"{row['bound']:.3f}", f"{row['share_of_bound']:.3f}",
                         f"{row['load_max_mean']:.2f}", f"{row['route_p50_ms']:.3f}", f"{row['route_p99_ms']:.3f}"])
    print(f"trace replay: {replay['trace']} ({replay['num_requests']} requests; goals: share of bound >= 0.95, "
          f"load max/mean <= 1.1)")
    print(text_table(header, rows))
