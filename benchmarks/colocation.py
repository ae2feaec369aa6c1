"""Colocation benchmark: one fleet shared by training and inference, simulated for a week.

    python benchmarks/colocation.py            # offered loads 60/80/95% (1,024 accelerators x 7 days),
                                               # then saturated: 8,192 accelerators x 7 days, and 1,024
    python benchmarks/colocation.py --quick    # offered loads at 1,024 x 1 day, saturated 1,024 x 1 day (one diurnal cycle)

Offered load (``--loads``) = (training work offered + inference's mean need at the target
utilization) / capacity. Below saturation policies differ in how fast jobs finish and how much
work they lose, not only in how full they keep the fleet; utilization counts only stepping
training jobs (a job paused for a snapshot or restart holds its accelerators, ``held``, without
using them) and Serve replicas its load needs.

Drives rayfleet's autoscaler policy (the same ``AutoscalerPolicy`` the fleet controller runs)
and two baselines on the same trace and seed (see ``rayfleet/platform/sim``):
- ``shared``  — lend elastic training's accelerators to Serve (whole DP replicas after a flash
  snapshot, topology-aware), give them back after a hysteresis window;
- ``static``  — a static split: Serve holds a partition sized for its diurnal peak;
- ``kueue``   — whole-job preemption with borrowing: training borrows Serve's idle quota and
  borrowing jobs are preempted whole when Serve reclaims it.

Workload: training arrivals and sizes from the Philly trace (traces/philly_jobs.csv; RAYFLEET_TRACE_DIR),
inference demand from a diurnal envelope (peak:trough ``--peak-to-trough``, unforecast bursts)
with request sizes from the Azure 2023 conversation trace. Costs (snapshot, restart, model load)
come from ``CostModel``; each is labeled calibrated-local or assumed and printed below.
Writes JSON and a PNG (utilization and inference demand over time) to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Goal, Table, record_run  # noqa: E402  (benchmarks/common.py, beside this script)
from rayfleet.platform.sim import POLICIES, SimConfig, run_policy  # noqa: E402
from rayfleet.platform.sim.costs import CostModel  # noqa: E402
from rayfleet.platform.status_table import format_table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def run_scale(config: SimConfig) -> dict[str, dict]:
    out = {}
    for mode in POLICIES:
        start = time.perf_counter()
        result = run_policy(mode, config).as_dict()
        result["wall_s"] = time.perf_counter() - start
        out[mode] = result
        print(f"  {config.num_accelerators:>5} accelerators, {config.days:g} days, {mode:<6}: "
              f"{result['wall_s']:.1f}s wall", flush=True)
    return out


def table(scale: int, results: dict[str, dict]) -> str:
    head, rows = saturated_rows(results)
    return f"{scale:,} accelerators\n" + format_table(head, rows)


def saturated_rows(results: dict[str, dict]) -> tuple[tuple[str, ...], list[tuple]]:
    static_util = results["static"]["utilization"]
    rows = []
    for mode, r in results.items():
        rows.append((
            mode, f"{r['utilization']:.1%}", f"{(r['utilization'] - static_util) * 100:+.1f}",
            f"{r['held_share']:.1%}", f"{r['slo_attainment']:.2%}", f"{r['training_lost_share']:.2%}",
            f"{_fmt(r['handover_lent_p50_s'], '.0f')}/{_fmt(r['handover_lent_p99_s'], '.0f')}",
            r["num_lent_handovers"], r["preemptions"], r["resizes"], _fmt(r["mean_jct_h"], ".2f"),
            _fmt(r["mean_queue_delay_h"], ".2f"), f"{r['useful_training_accel_h']:,.0f}",
            f"{r['jobs_completed']}/{r['jobs_arrived']}"))
    # JCT and queue delay include unfinished jobs at their age so far (same job set for every policy).
    head = ("policy", "util", "pts vs static", "held", "SLO attained", "train lost", "handover p50/p99 s",
            "lent replicas", "full-job preempt", "resizes", "mean JCT h*", "queue delay h*", "useful accel-h",
            "jobs done")
    return head, rows


def load_table(by_load: dict[float, dict[str, dict]]) -> str:
    return format_table(*load_rows(by_load))


def load_rows(by_load: dict[float, dict[str, dict]]) -> tuple[tuple[str, ...], list[tuple]]:
    rows = []
    for load, results in by_load.items():
        for mode, r in results.items():
            rows.append((f"{load:.0%}", mode, f"{r['utilization']:.1%}", f"{r['held_share']:.1%}",
                         _fmt(r["mean_jct_h"], ".2f"), _fmt(r["p95_jct_h"], ".1f"), f"{r['slo_attainment']:.2%}",
                         f"{r['lost_training_accel_h']:,.0f} ({r['training_lost_share']:.2%})", r["preemptions"],
                         r["resizes"], f"{r['jobs_completed']}/{r['jobs_arrived']}"))
    head = ("offered", "policy", "util", "held", "mean JCT h*", "p95 JCT h*", "SLO attained", "train lost accel-h",
            "full-job preempt", "resizes", "jobs done")
    return head, rows


def goals_of(label: str, results: dict[str, dict]) -> list[Goal]:
    """The goals the run prints, for the shared policy, judged on unrounded shares."""
    shared, static = results["shared"], results["static"]
    return [Goal(f"{label}: shared utilization", ">=", 0.90, shared["utilization"]),
            Goal(f"{label}: shared utilization - static's (points / 100)", ">=", 0.25,
                 shared["utilization"] - static["utilization"]),
            Goal(f"{label}: shared SLO attainment", ">=", 0.99, shared["slo_attainment"]),
            Goal(f"{label}: shared training lost share", "<=", 0.02, shared["training_lost_share"]),
            Goal(f"{label}: shared handover p50 s (modeled)", "<=", 30, shared["handover_lent_p50_s"]),
            Goal(f"{label}: shared handover p99 s (modeled)", "<=", 120, shared["handover_lent_p99_s"])]


def plot(results: dict[str, dict], path: Path, *, accel_per_serve_replica: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    styles = {"shared": ("-", 1.6), "static": ("-", 1.0), "kueue": (":", 1.2)}  # shared and kueue overlap often
    for mode, r in results.items():
        tl = r["timeline"]
        style, width = styles.get(mode, ("-", 1.0))
        top.plot(tl["t_h"], [u * 100 for u in tl["utilization"]], style, label=mode, linewidth=width)
        bottom.plot(tl["t_h"], tl["serve_held"], style, label=f"{mode}: Serve accelerators held", linewidth=width)
    tl = results["shared"]["timeline"]
    bottom.plot(tl["t_h"], [d * accel_per_serve_replica for d in tl["serve_demand"]], "k--", linewidth=1,
                label="inference demand (accelerators at 100% load)")
    top.set_ylabel("allocated-accelerator utilization %")
    top.legend(loc="lower right")
    bottom.set_ylabel("accelerators")
    bottom.set_xlabel("simulated hours")
    bottom.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,024-accelerator smoke scale only")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-to-trough", type=float, default=3.0)
    ap.add_argument("--inference-share", type=float, default=0.4,
                    help="share of the fleet Serve needs at its diurnal peak")
    ap.add_argument("--loads", default="0.6,0.8,0.95", help="offered loads (share of capacity) at 1,024 accelerators")
    ap.add_argument("--json", default=str(RESULTS / "colocation.json"), help="the PNG goes beside it")
    ap.add_argument("--scales", default=None, help="saturated runs' fleet sizes, e.g. 1024,8192 ('' for none)")
    ap.add_argument("--costs", choices=("calibrated", "defaults"), default="calibrated",
                    help="calibrated: handover costs measured live by benchmarks/handover.py (when written)")
    args = ap.parse_args()
    scales = [1024] if args.quick else [1024, 8192]
    if args.scales is not None:
        scales = [int(x) for x in args.scales.split(",") if x]
    if args.quick:
        args.days = min(args.days, 1.0)  # one diurnal cycle: the pipeline, not the figures
    costs, costs_source = CostModel.calibrated() if args.costs == "calibrated" else (CostModel(), "defaults")
    base = SimConfig(days=args.days, seed=args.seed, peak_to_trough=args.peak_to_trough,
                     inference_peak_share=args.inference_share, costs=costs)
    print(f"ran on: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()} "
          "(simulation: no accelerators used)")
    print(f"cost model (calibrated-local = measured on this project's local Ray fleet; see CostModel); "
          f"handover costs: {costs_source}")
    for f in fields(base.costs):
        print(f"  {f.name} = {getattr(base.costs, f.name)}")
    start = time.perf_counter()
    by_load = {}
    for load in (float(x) for x in args.loads.split(",") if x):
        print(f"offered load {load:.0%}:", flush=True)
        by_load[load] = run_scale(replace(base, num_accelerators=1024, offered_load=load))
    results = {}
    for scale in scales:
        results[scale] = run_scale(replace(base, num_accelerators=scale))
    wall = time.perf_counter() - start
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    png = Path(args.json).with_suffix(".png")
    shown = results[scales[-1]] if scales else by_load[max(by_load)]
    drew = plot(shown, png, accel_per_serve_replica=base.serve_replica_accelerators)
    payload = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(base).items()},
               "scales": {str(s): r for s, r in results.items()},
               "offered_loads_1024": {str(k): v for k, v in by_load.items()}, "wall_s": wall, "png": str(png) if drew else None}
    Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
    bound = args.inference_share * (1 - (1 + 1 / args.peak_to_trough) / 2)
    print(f"\nwrote {args.json}" + (f" and {png}" if drew else " (matplotlib missing: no PNG)") + f"; total {wall:.0f}s")
    print(f"note: with Serve at {args.inference_share:.0%} of the fleet at peak and peak:trough "
          f"{args.peak_to_trough:g}:1, a static split idles about {bound:.0%} of the fleet on average "
          "(the most sharing can win back on utilization, before bursts and fragmentation).")
    print("goals: util >= 90% and >= 25 pts above static; SLO >= 99%; training lost <= 2%; "
          "handover p50/p99 <= 30/120 s (modeled)\n")
    if by_load:
        print(f"offered load below saturation, 1,024 accelerators x {args.days:g} days (same trace and seed per load)")
        print(load_table(by_load))
        print()
    print(f"saturated (training offered {base.training_load_factor:g}x its quota):")
    for scale in scales:
        print(table(scale, results[scale]))
        print()
    print("* over every arrived job; unfinished ones count with their age so far (a lower bound)")
    goals, tables = [], {}
    if by_load:
        head, rows = load_rows(by_load)
        tables["offered_loads"] = Table(list(head), [list(r) for r in rows],
                                        note=f"1,024 accelerators x {args.days:g} days, same trace and seed per load")
        for load, r in by_load.items():
            goals += goals_of(f"offered {load:.0%}, 1,024 accelerators", r)
    for scale in scales:
        head, rows = saturated_rows(results[scale])
        tables[f"saturated_{scale}"] = Table(list(head), [list(r) for r in rows],
                                             note=f"{scale:,} accelerators x {args.days:g} days, saturated")
        goals += goals_of(f"saturated, {scale:,} accelerators", results[scale])
    drop = ("timeline",)
    record_run(name="colocation", quick=args.quick,
               params={"days": args.days, "seed": args.seed, "peak_to_trough": args.peak_to_trough,
                       "inference_share": args.inference_share, "loads": args.loads, "scales": scales,
                       "costs": costs_source},
               figures={"offered_loads_1024": {str(k): {m: {f: x for f, x in v.items() if f not in drop and not isinstance(x, list)}
                                                        for m, v in r.items()} for k, r in by_load.items()},
                        "scales": {str(k): {m: {f: x for f, x in v.items() if f not in drop and not isinstance(x, list)} for m, v in r.items()}
                                   for k, r in results.items()}},
               goals=goals, tables=tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
