"""Expert load balancing benchmark: per-device max/mean expert load, naive placement vs EPLB.

    python benchmarks/eplb.py            # ~25 s on 2 idle cores (recording dominates)
    python benchmarks/eplb.py --quick    # fewer model windows

Traces are ``[windows, layers, experts]`` token counts:
- ``model``: recorded from our ``small`` preset (16 experts, top-2, 7 MoE layers; random init,
  seed 0, bf16) running forward passes over real text tokenized with the byte tokenizer. A
  batch is 16 rows of 128 tokens, each a random slice of Python's own documentation
  (``pydoc_data.topics``) or of standard-library source code, like concurrent requests; the
  share of code rows drifts from none in the first window to all in the last. One batch = one
  window; each MoE layer's ``last_tokens_per_expert`` is read after every batch. Placed on 16
  devices on 2 nodes with 32 slots (one redundant slot per device, a decode-style EP layout),
  global policy: our router is not group-limited, so the model has no expert groups.
- ``zipf``: 64 experts in 8 groups with Zipf(1.0) popularity over a random expert order and
  multinomial noise (16,384 routed copies per window); 16 devices on 2 nodes, 96 slots, under
  both the hierarchical and the global policy.
- ``zipf-drift``: the same, with log-popularity drifting as a random walk (5% of its spread
  per window), so hot experts cool down and others heat up.

For each trace and window ``t`` (after a warm-up of ``--history`` windows):
- naive: contiguous placement, no replicas (expert ``e`` on device ``e // (E / D)``);
- in-window: EPLB from window ``t``'s own load, evaluated on window ``t`` (the best case);
- next-window: EPLB from the p90 (``expert_demand``) of windows ``[t - history, t)``,
  evaluated on window ``t`` (what a running balancer sees); the same from the mean of those
  windows is the baseline for percentile sizing.
Each cell is the per-device max/mean load averaged over windows and layers ("next worst": the
worst window and layer of the percentile-sized balancer). Device load assumes each expert's tokens split evenly over its replicas, which
the least-loaded router (``route_to_replicas``) achieves to within one token per replica.
Goals: in-window <= 1.1 and next-window <= 1.25, from a naive ratio >= 2.

Writes ``benchmarks/results/eplb.json``; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Goal, Table, record_run  # noqa: E402  (benchmarks/common.py, beside this script)
from rayfleet.models import ByteTokenizer, build_model, preset  # noqa: E402
from rayfleet.serving.experts.eplb import (balance_ratio, contiguous_placement, device_load,  # noqa: E402
                                   expert_demand, rebalance_experts)

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_IN_WINDOW, GOAL_NEXT_WINDOW, GOAL_NAIVE = 1.1, 1.25, 2.0
CODE_FILES = ("argparse.py", "typing.py", "collections/__init__.py", "json/decoder.py",
              "dataclasses.py", "functools.py", "inspect.py", "asyncio/base_events.py")


def _stream_text() -> tuple[str, str]:
    """(prose, code): stdlib documentation topics and stdlib source files, all offline."""
    import pydoc_data.topics as topics  # stdlib: the text of Python's own reference manual

    prose = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    lib = Path(os.__file__).parent
    code = "\n\n".join((lib / name).read_text(encoding="utf-8") for name in CODE_FILES if (lib / name).exists())
    return prose, code


@torch.inference_mode()
def record_model_trace(*, num_windows: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[W, L, E]`` int64 tokens per expert, one forward pass of ``[batch, seq_len]`` per window.

    Each row of a batch is a random ``seq_len`` slice of prose or code (concurrent requests);
    the share of code rows drifts linearly from none in the first window to all in the last.
    """
    model = build_model(preset("small"), seed=0, dtype=torch.bfloat16).eval()
    tokenizer = ByteTokenizer()
    gen = torch.Generator().manual_seed(seed)
    prose, code = (torch.tensor(tokenizer.encode(text), dtype=torch.int64) for text in _stream_text())
    windows = []
    for w in range(num_windows):
        num_code = round(batch * w / max(1, num_windows - 1))
        rows = []
        for i in range(batch):
            ids = code if i < num_code else prose
            start = int(torch.randint(0, ids.numel() - seq_len, (), generator=gen))
            rows.append(ids[start:start + seq_len])
        model(torch.stack(rows))
        windows.append(torch.stack([m.last_tokens_per_expert.clone() for m in model.moe_layers()]))
    return torch.stack(windows)


def synthetic_trace(*, num_windows: int, num_layers: int, num_experts: int, tokens: int,
                    zipf: float, drift: float, seed: int) -> torch.Tensor:
    """``[W, L, E]`` multinomial counts from Zipf popularity whose log drifts by ``drift`` per window."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_layers)])
    log_pop = -zipf * torch.log1p(ranks.double())  # [L, E]
    spread = float(log_pop.std())
    windows = []
    for _ in range(num_windows):
        probs = torch.softmax(log_pop, dim=-1)
        windows.append(torch.stack([torch.bincount(torch.multinomial(p, tokens, True, generator=gen),
                                                   minlength=num_experts) for p in probs]))
        log_pop = log_pop + drift * spread * torch.randn(log_pop.shape, generator=gen, dtype=torch.float64)
    return torch.stack(windows)


def evaluate(trace: torch.Tensor, *, num_devices: int, num_nodes: int, num_groups: int,
             num_physical_experts: int, policy: str, history: int, percentile: float) -> dict:
    """Per-window device max/mean for naive, in-window, next-window (percentile and mean)."""
    num_windows, num_layers, num_experts = trace.shape
    naive = contiguous_placement(num_layers, num_experts)
    place = lambda demand: rebalance_experts(  # noqa: E731
        demand, num_physical_experts=num_physical_experts, num_groups=num_groups,
        num_nodes=num_nodes, num_devices=num_devices, policy=policy)
    ratio = lambda load, placement: balance_ratio(  # noqa: E731
        device_load(load, placement, num_devices=num_devices))
    rows = {"naive": [], "in_window": [], "next_window_p%g" % percentile: [], "next_window_mean": []}
    started = time.perf_counter()
    for t in range(history, num_windows):
        load, recent = trace[t], trace[t - history:t]
        rows["naive"].append(ratio(load, naive))
        rows["in_window"].append(ratio(load, place(load)))
        rows["next_window_p%g" % percentile].append(ratio(load, place(expert_demand(recent, percentile=percentile))))
        rows["next_window_mean"].append(ratio(load, place(recent.double().mean(0))))
    rebalance_s = (time.perf_counter() - started) / max(1, 3 * (num_windows - history))
    out = {name: {"mean": float(torch.stack(v).mean()), "worst_window_layer": float(torch.stack(v).max()),
                  "per_window_mean_over_layers": [float(x.mean()) for x in v]} for name, v in rows.items()}
    out["rebalance_ms_per_call"] = 1e3 * rebalance_s
    out["config"] = {"windows": num_windows, "layers": num_layers, "experts": num_experts,
                     "devices": num_devices, "nodes": num_nodes, "groups": num_groups,
                     "physical_experts": num_physical_experts, "policy": policy, "history": history,
                     "percentile": percentile}
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 model windows of 512 tokens (smoke run)")
    parser.add_argument("--history", type=int, default=4, help="windows the next-window balancer sees")
    parser.add_argument("--percentile", type=float, default=90.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "eplb.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    started = time.perf_counter()

    # Quick: the model's forward passes are the cost (~15 s of CPU per 2,048-token window here);
    # 5 windows of 512 tokens leave one window past the default 4-window history (a smoke run:
    # every trace and policy is evaluated, the figures mean nothing).
    num_windows, batch = (5, 4) if args.quick else (16, 16)
    t0 = time.perf_counter()
    model_trace = record_model_trace(num_windows=num_windows, batch=batch, seq_len=128)
    record_s = time.perf_counter() - t0
    print(f"recorded {num_windows} model windows of {batch * 128} tokens in {record_s:.1f} s", flush=True)
    common = dict(history=args.history, percentile=args.percentile)
    synthetic = {name: synthetic_trace(num_windows=24, num_layers=4, num_experts=64, tokens=16384,
                                       zipf=1.0, drift=drift, seed=seed)
                 for name, drift, seed in (("zipf", 0.0, 1), ("zipf-drift", 0.05, 2))}
    results = {"model": evaluate(model_trace, num_devices=16, num_nodes=2, num_groups=1,
                                 num_physical_experts=32, policy="global", **common)}
    for name, trace in synthetic.items():
        for policy in ("hierarchical", "global"):
            results[f"{name}/{policy}"] = evaluate(trace, num_devices=16, num_nodes=2, num_groups=8,
                                                   num_physical_experts=96, policy=policy, **common)
    results["model"]["record_s"] = record_s
    results["model"]["tokens_per_expert"] = model_trace.tolist()  # [windows, layers, experts]
    p_key = "next_window_p%g" % args.percentile
    summary = {
        "ran_on": {"machine": platform.machine(), "processor": platform.processor() or "unknown",
                   "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                   "device": "cpu (placement is computed on CPU; no accelerator involved)"},
        "date": datetime.now().isoformat(timespec="seconds"),
        "goals": {"in_window_max_over_mean": GOAL_IN_WINDOW, "next_window_max_over_mean": GOAL_NEXT_WINDOW,
                  "naive_at_least": GOAL_NAIVE},
        "traces": results,
        "wall_s": time.perf_counter() - started,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1))

    ok = lambda value, goal, le=True: "ok" if (value <= goal if le else value >= goal) else "MISS"  # noqa: E731
    rows = []
    for name, r in results.items():
        c = r["config"]
        rows.append([name, f"{c['experts']}e {c['groups']}g {c['nodes']}n {c['devices']}d {c['physical_experts']}s",
                     f"{r['naive']['mean']:.2f} {ok(r['naive']['mean'], GOAL_NAIVE, False)}",
                     f"{r['in_window']['mean']:.3f} {ok(r['in_window']['mean'], GOAL_IN_WINDOW)}",
                     f"{r[p_key]['mean']:.3f} {ok(r[p_key]['mean'], GOAL_NEXT_WINDOW)}",
                     f"{r['next_window_mean']['mean']:.3f}",
                     f"{r[p_key]['worst_window_layer']:.2f}", f"{r['rebalance_ms_per_call']:.1f}"])
    print(f"\nEPLB on {summary['ran_on']['machine']} CPU x{os.cpu_count()}, torch {torch.__version__}; "
          f"per-device max/mean load, mean over windows x layers; next-window balancer sees "
          f"{args.history} windows; wall {summary['wall_s']:.0f} s; wrote {args.json}")
    header = ["trace/policy", "experts groups nodes devices slots", "naive (>=2)", "in-window (<=1.1)",
              f"next p{args.percentile:g} (<=1.25)", "next mean", "next worst", "ms/rebalance"]
    print(_table(header, rows))
    goals = []
    for name, r in results.items():
        goals += [Goal(f"{name}: naive placement max/mean (the imbalance to fix)", ">=", GOAL_NAIVE, r["naive"]["mean"]),
                  Goal(f"{name}: in-window max/mean", "<=", GOAL_IN_WINDOW, r["in_window"]["mean"]),
                  Goal(f"{name}: next-window p{args.percentile:g} max/mean", "<=", GOAL_NEXT_WINDOW, r[p_key]["mean"])]
    figures = {name: {k: v for k, v in r.items() if k != "tokens_per_expert"} for name, r in results.items()}
    record_run(name="eplb", quick=args.quick, params={"history": args.history, "percentile": args.percentile,
                                                      "model_windows": num_windows, "batch": batch},
               figures=figures, goals=goals, tables={"balance": Table(header, rows)})


if __name__ == "__main__":
    main()
