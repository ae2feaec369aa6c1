"""Wide-EP serving replica: token equality, all-to-all cost, expert balance and DP queueing.

    python benchmarks/wide_ep.py            # 1-, 2- and 4-rank gangs, larger traces
    python benchmarks/wide_ep.py --quick    # one 2-rank gang, small traces

What runs: a wide-EP replica (``rayfleet.serving.engine.wide_ep_*``) on local gloo processes,
each rank an engine with its own scheduler and paged KV cache, MoE layers exchanging tokens
through training's EP dispatcher. The model is the tiny preset with 8 experts, no shared
expert and init std 0.1 (so routed experts decide the tokens), float64; one redundant
expert slot per rank. Per gang, on the same processes:
1. equality: the same greedy requests on the gang and on the single-process ``LLMEngine``;
   per MoE layer, the exchange's transfer time and off-rank bytes per step;
2. DP queueing: a stream of requests with mixed prompt lengths (one per rank per step), routed to ranks
   round-robin (no DP balancing) and by the DP balancer (lightest queue in tokens): p99 wait
   from submission to the step that produced the first token, per rank, in steps (the goal:
   independent of host load) and in seconds;
3. live EPLB in the engine: prompts from a few token ids ("topics", which the router sends to
   few experts) drifting from topic A to B; the front re-places experts live (weights move
   between ranks). Per window, device max/mean expert load: measured for live (slot counts
   of the real exchange), computed from the same windows' expert counts for EPLB off
   (contiguous, no replicas) and static (fitted on the first two windows).
Then the same policies on larger synthetic traces (pure, ``_wide_ep_traces``): drifting Zipf
demand (off, static, refit on the last window with even / balanced routing, live), a sudden
shift of the hot experts (windows until live is within 1.25x of the best placement), and
hard skew (Zipf 1.5, 64 experts in 8 groups, 16 devices on 4 nodes, 80 slots): hierarchical
vs its node-level bound vs global vs auto.

Writes ``--json`` and a ledger entry (``record_run``); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from pathlib import Path

import torch

from _wide_ep_traces import compare_policies, shift_recovery, zipf_trace
from common import Goal, Table, cpu_name, record_run  # benchmarks/common.py (this script's directory is on sys.path)
from rayfleet.serving.engine.dp_balance import DPBalancer
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.wide_ep_local import LocalGang
from rayfleet.serving.engine.wide_ep_rank import ModelRecipe
from rayfleet.serving.engine.wide_ep_replica import WideEPReplica
from rayfleet.serving.experts.eplb import balance_ratio, contiguous_placement, device_load, rebalance_experts
from rayfleet.serving.experts.live_eplb import LiveEPLBConfig, LiveEPLBPolicy, placement_balance

RESULTS = Path(__file__).resolve().parent / "results"
RECIPE = ModelRecipe("tiny", (("num_experts", 8), ("num_shared_experts", 0), ("init_std", 0.1)), dtype="float64")
CONFIG = EngineConfig(num_blocks=128, block_size=8, max_num_seqs=16, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WINDOW_STEPS = 4


def _prompts(n: int, seed: int, low: int = 3, high: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(low, high, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _p99(values: list[float]) -> float | None:
    return float(torch.tensor(values, dtype=torch.float64).quantile(0.99)) if values else None


def _equality(gang: LocalGang, num_ranks: int, prompts, reference) -> dict:
    front = WideEPReplica(gang, num_ranks=num_ranks, block_size=CONFIG.block_size)
    ids = [f"eq-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        front.submit(rid, prompt, GREEDY)
    started = time.perf_counter()
    tokens = front.run_until_done(ids)
    steps = front.num_steps
    return {"equal": [tokens[r] for r in ids] == reference, "steps": steps, "wall_s": time.perf_counter() - started,
            "a2a_ms_per_step": {layer: 1e3 * s / steps for layer, s in front.exchange_s.items()},
            "a2a_off_rank_kib_per_step": {layer: b / steps / 1024 for layer, b in front.exchange_bytes.items()},
            "empty_forwards": [f.empty_forwards for f in front.ranks]}


def _queueing(gang: LocalGang, num_ranks: int, policy: str, *, num_requests: int, tag: str) -> dict:
    front = WideEPReplica(gang, num_ranks=num_ranks, block_size=CONFIG.block_size,
                          dp=DPBalancer(num_ranks, block_size=CONFIG.block_size, policy=policy))
    lengths, tokens = torch.Generator().manual_seed(7), torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    # Mixed lengths: one long prompt in four (a long prefill holds its rank for several steps).
    # The same lengths for both policies, fresh token ids for each (the gang's prefix caches
    # must not serve the second run from the first one's blocks).
    prompts = [torch.randint(0, 256, (120 if i % 4 == 0 else int(torch.randint(4, 16, (), generator=lengths)),),
                             generator=tokens).tolist() for i in range(num_requests)]
    ids = [f"{tag}-{i}" for i in range(num_requests)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def arrive(step: int) -> None:  # one arrival per rank per step: the same load per rank at any gang size
        for i in range(num_ranks * step, min(num_ranks * (step + 1), num_requests)):
            front.submit(ids[i], prompts[i], params)

    front.run_until_done(ids, arrivals=arrive)
    return {"p99_wait_steps_per_rank": [_p99(f.waits_steps) for f in front.ranks],
            "p99_wait_steps": _p99([w for f in front.ranks for w in f.waits_steps]),
            "p99_wait_s_per_rank": [_p99(f.waits_s) for f in front.ranks],
            "p99_wait_s": _p99([w for f in front.ranks for w in f.waits_s]),
            "requests_per_rank": [f.num_requests for f in front.ranks],
            "busy_s_per_rank": [round(f.busy_s, 3) for f in front.ranks],
            "max_queue_depth_per_rank": [max(f.queue_depth, default=0) for f in front.ranks], "steps": front.num_steps}


def _live_eplb(gang: LocalGang, num_ranks: int, slots: int, *, num_requests: int, initial) -> dict:
    config = LiveEPLBConfig(num_devices=num_ranks, num_physical_experts=slots, policy="global",
                            window_steps=WINDOW_STEPS, history_windows=4, rebalance_every_windows=2)
    front = WideEPReplica(gang, num_ranks=num_ranks, block_size=CONFIG.block_size,
                          eplb=LiveEPLBPolicy(config, num_layers=2, num_experts=8, initial=initial))
    gen = torch.Generator().manual_seed(3)
    topics = (torch.tensor([5, 17, 33, 64]), torch.tensor([101, 150, 201, 250]))
    prompts = []
    for i in range(num_requests):  # drift: the share of topic B rises from 0 to 1
        topic = topics[int(torch.rand((), generator=gen) < i / max(1, num_requests - 1))]
        prompts.append(topic[torch.randint(0, 4, (int(torch.randint(8, 24, (), generator=gen)),), generator=gen)].tolist())
    ids = [f"eplb-{i}" for i in range(num_requests)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    front.run_until_done(ids, arrivals=lambda s: [front.submit(ids[i], prompts[i], params)
                                                  for i in range(2 * s, min(2 * s + 2, num_requests))])
    windows = [torch.stack(front.expert_load[w:w + WINDOW_STEPS]).sum(0)
               for w in range(0, len(front.expert_load) - WINDOW_STEPS + 1, WINDOW_STEPS)]
    measured = [torch.stack(front.device_load[w:w + WINDOW_STEPS]).sum(0).double()
                for w in range(0, len(front.device_load) - WINDOW_STEPS + 1, WINDOW_STEPS)]
    static = rebalance_experts(torch.stack(windows[:2]).double().mean(0), num_physical_experts=slots, num_groups=1,
                               num_nodes=1, num_devices=num_ranks, policy="global")
    off = contiguous_placement(2, 8)
    judged = range(2, len(windows))  # after the static placement's fitting windows
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"windows": len(windows), "moves": [list(m) for m in front.moves],
            "off": mean([placement_balance(windows[w], off, num_devices=num_ranks, routing="even") for w in judged]),
            "static": mean([placement_balance(windows[w], static, num_devices=num_ranks) for w in judged]),
            "live_measured": mean([float(balance_ratio(measured[w]).mean()) for w in judged])}


def run_gang(num_ranks: int, *, quick: bool, prompts, reference) -> dict:
    slots = 8 if num_ranks == 1 else 8 + num_ranks  # one redundant slot per rank
    initial = rebalance_experts(torch.ones(2, 8), num_physical_experts=slots, num_groups=1, num_nodes=1,
                                num_devices=num_ranks, policy="global")
    started = time.perf_counter()
    with LocalGang(num_ranks=num_ranks, recipe=RECIPE, engine_config=CONFIG, placement=initial) as gang:
        out = {"start_s": time.perf_counter() - started, "slots": slots}
        out["equality"] = _equality(gang, num_ranks, prompts, reference)
        if num_ranks > 1:
            n = (8 if quick else 24) * num_ranks
            out["dp"] = {p: _queueing(gang, num_ranks, p, num_requests=n, tag=f"dp-{p}")
                         for p in ("round_robin", "balanced")}
            out["eplb"] = _live_eplb(gang, num_ranks, slots, num_requests=40 if quick else 96, initial=initial)
    out["wall_s"] = time.perf_counter() - started
    return out


def traces(quick: bool) -> dict:
    windows, tokens = (10, 2048) if quick else (24, 8192)
    out = {}
    for drift in ((0.2,) if quick else (0.05, 0.2, 0.5)):
        trace = zipf_trace(num_windows=windows, num_layers=2, num_experts=64, tokens=tokens, zipf=1.0, drift=drift, seed=2)
        out[f"drift{drift:g}"] = compare_policies(trace, num_devices=16, num_physical=80, num_groups=8, num_nodes=2,
                                                  warmup=4, history=4)
    shifted = zipf_trace(num_windows=8, num_layers=2, num_experts=64, tokens=tokens, zipf=1.0, drift=0.0, seed=4,
                         shift_at=4)
    out["shift"] = shift_recovery(shifted, shift_at=4, num_devices=16, num_physical=80, history=4, period=2)
    skew = zipf_trace(num_windows=1, num_layers=4, num_experts=64, tokens=16384, zipf=1.5, drift=0.0, seed=1)[0]
    fleet = dict(num_physical_experts=80, num_groups=8, num_nodes=4, num_devices=16)
    hier = rebalance_experts(skew, policy="hierarchical", **fleet)
    glob = rebalance_experts(skew, policy="global", **fleet)
    auto = rebalance_experts(skew, policy="auto", **fleet)
    ratio = lambda p, routing: placement_balance(skew, p, num_devices=16, routing=routing)  # noqa: E731
    out["zipf1.5"] = {"hierarchical_even": ratio(hier, "even"), "hierarchical_balanced": ratio(hier, "balanced"),
                      "node_bound": float(balance_ratio(device_load(skew, hier, num_devices=4)).mean()),
                      "global_even": ratio(glob, "even"), "global_balanced": ratio(glob, "balanced"),
                      "auto_even": ratio(auto, "even"), "auto_balanced": ratio(auto, "balanced")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one 2-rank gang and small traces (< 60 s idle)")
    parser.add_argument("--ranks", type=int, nargs="*", default=None, help="gang sizes (default 1 2 4; quick: 2)")
    parser.add_argument("--json", type=Path, default=RESULTS / "wide_ep.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = args.ranks or ([2] if args.quick else [1, 2, 4])
    prompts = _prompts(6 if args.quick else 12, seed=0)
    reference = [list(r.output_token_ids) for r in LLMEngine(RECIPE.build(), CONFIG).generate(prompts, GREEDY)]
    gangs = {n: run_gang(n, quick=args.quick, prompts=prompts, reference=reference) for n in ranks}
    pure = traces(args.quick)
    summary = {"ran_on": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "device": "cpu, gloo (one process per rank, 1 thread each)"},
               "gangs": gangs, "traces": pure}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1, default=str))

    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    rows = []
    for n, g in gangs.items():
        eq = g["equality"]
        rows.append([f"{n}-rank tokens == single-process", "yes" if eq["equal"] else "NO",
                     f"start {g['start_s']:.0f} s, {eq['steps']} steps"])
        for layer, ms in eq["a2a_ms_per_step"].items():
            rows.append([f"{n}-rank MoE layer {layer} all-to-all", f"{ms:.2f} ms/step",
                         f"{eq['a2a_off_rank_kib_per_step'][layer]:.1f} KiB/step off-rank"])
        if "dp" in g:
            for policy, d in g["dp"].items():
                rows.append([f"{n}-rank p99 queue wait, {policy}", f"{f(d['p99_wait_steps'], 1)} steps",
                             "per rank " + " / ".join(f(x, 1) for x in d["p99_wait_steps_per_rank"])
                             + f" steps; {f(d['p99_wait_s'])} s; busy s {d['busy_s_per_rank']}"])
            e = g["eplb"]
            rows.append([f"{n}-rank engine max/mean, off / static / live", f"{f(e['off'])} / {f(e['static'])} / "
                         f"{f(e['live_measured'])}", f"{len(e['moves'])} live moves over {e['windows']} windows"])
    for name, t in pure.items():
        if name.startswith("drift"):
            rows.append([f"{name}: off/static/refit-last even/balanced/live",
                         " / ".join(f(t.get(k)) for k in ("off", "static", "refit_last_even", "refit_last_balanced",
                                                          "live")), f"in-window best {f(t['in_window'])}"])
    s = pure["shift"]
    rows.append(["shift: windows until live <= 1.25x best", str(s["windows_to_recover"]),
                 f"period {s['period_windows']} windows; ratios {s['ratio_to_best_after_shift']}"])
    z = pure["zipf1.5"]
    rows.append(["zipf1.5 hier even / balanced / node bound", f"{f(z['hierarchical_even'])} / "
                 f"{f(z['hierarchical_balanced'])} / {f(z['node_bound'])}",
                 f"global {f(z['global_balanced'])}, auto {f(z['auto_balanced'])}"])
    header = ["figure", "value", "detail"]
    print(f"\nwide EP on {cpu_name()} x{os.cpu_count()}, torch {torch.__version__}, gloo; wrote {args.json}")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(3)]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))

    goals = [Goal(f"{n}-rank greedy tokens equal single-process (1 = yes)", ">=", 1, float(g["equality"]["equal"]))
             for n, g in gangs.items()]
    for n, g in gangs.items():
        if "dp" in g:
            goals.append(Goal(f"{n}-rank p99 queue wait in steps: balanced < round-robin", "<", 1.0,
                              g["dp"]["balanced"]["p99_wait_steps"] / max(g["dp"]["round_robin"]["p99_wait_steps"], 1e-9)))
    for name, t in pure.items():
        if name.startswith("drift"):
            goals.append(Goal(f"{name}: live / refit-last (even split, the previous balancer)", "<", 1.0,
                              t["live"] / t["refit_last_even"]))
    goals += [Goal("shift: windows until live within 1.25x of best (two periods)", "<=", 2 * s["period_windows"],
                   s["windows_to_recover"] if s["windows_to_recover"] is not None else float("inf")),
              Goal("zipf1.5: hierarchical (balanced routing) / node-level bound", "<=", 1.05,
                   z["hierarchical_balanced"] / z["node_bound"]),
              Goal("zipf1.5: auto / global (even split)", "<=", 1.0, z["auto_even"] / z["global_even"])]
    record_run(name="wide_ep", quick=args.quick, params={"ranks": ranks, "window_steps": WINDOW_STEPS},
               figures=summary, goals=goals, tables={"wide_ep": Table(header, rows)})


if __name__ == "__main__":
    main()
