"""Placement benchmark: planner wall time at fleet scale, and layout quality against Ray's
topology-blind PACK / SPREAD placement on a fragmented fleet.

    python benchmarks/placement.py [--json results.json] [--repeats 3] [--skip-brute-force]

Part 1 times ``search_plans`` (branch and bound) for a DeepSeek-V3-shaped model on 1,024,
10,000 and 100,000 H100s (global batch = 2 sequences per accelerator, so every size has
feasible plans) against the brute-force enumeration of the same cost model in the same run
(the baseline): speed-up and whether both return the same best plan. The goal is <= 1 s at
10,000 accelerators.

Part 2 places the same plans three ways on a fragmented 512-GPU fleet (64 servers, 8 racks,
2 blocks; other jobs hold 1-4 random accelerators on 75% of the servers, 3 servers cordoned):
rayfleet's layout, and simulations of Ray's PACK and SPREAD strategies (which know nothing of
racks or rails). It counts TP groups split across servers, EP groups that leave an NVLink domain, DP/PP
transfers that change rail between servers (DP counted as a hierarchical all-reduce runs it),
and the bytes per step that cross racks (the spine) and blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayfleet.placement import fleet_capacity, parse_fleet, preset  # noqa: E402
from rayfleet.placement.layout import build_layout  # noqa: E402
from rayfleet.placement.layout_quality import baseline_layout, layout_quality  # noqa: E402
from rayfleet.placement.plan import ParallelPlan, validate_plan  # noqa: E402
from rayfleet.placement.planner import brute_force_plans, search_plans  # noqa: E402
from rayfleet.platform.topology import AcceleratorSlot, build_topology  # noqa: E402


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def planner_scaling(repeats: int, brute: bool) -> list[dict]:
    results = []
    for n in (1024, 10_000, 100_000):
        model = preset("deepseek-v3", global_batch_sequences=2 * n)
        t0 = time.perf_counter()
        topology = parse_fleet(f"H100:{n}")
        capacity = fleet_capacity(topology)
        build_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fast = search_plans(model, capacity, top_k=5)
            times.append(time.perf_counter() - t0)
        best = fast.ranked[0]
        t0 = time.perf_counter()
        layout = build_layout(best.plan, topology)
        layout_s = time.perf_counter() - t0
        row = {"accelerators": n, "planner_s": statistics.median(times), "planner_runs_s": times,
               "topology_build_s": build_s, "layout_s": layout_s, "shapes": fast.num_shapes,
               "pruned": fast.num_pruned, "best_plan": best.plan.describe(), "best_step_s": best.step_time_s,
               "world_placed": layout.world_size}
        if brute:
            t0 = time.perf_counter()
            slow = brute_force_plans(model, capacity, top_k=5)
            row["brute_force_s"] = time.perf_counter() - t0
            row["same_best"] = slow.ranked[0].plan == best.plan
            row["brute_best_step_s"] = slow.ranked[0].step_time_s
        results.append(row)
        print(f"  {n:>7} accelerators: planner {row['planner_s']:.3f} s"
              + (f", brute force {row['brute_force_s']:.2f} s" if brute else ""), flush=True)
    return results


def fragmented_fleet(seed: int = 7):
    topology = build_topology(num_nodes=64, accelerator="H100", num_racks=8, racks_per_block=4)
    rng = random.Random(seed)
    held: list[AcceleratorSlot] = []
    for node in topology.nodes:
        if rng.random() < 0.75:
            held += [AcceleratorSlot(node.name, i) for i in rng.sample(range(8), rng.randint(1, 4))]
    cordoned = [n.name for n in rng.sample(list(topology.nodes), 3)]
    return topology, held, cordoned


def layout_comparison() -> list[dict]:
    topology, held, cordoned = fragmented_fleet()
    cases = [
        ("mixtral-8x7b", ParallelPlan(tp=2, pp=4, dp=32, ep=8, micro_batch_size=1)),
        ("llama3-70b", ParallelPlan(tp=4, pp=4, dp=8, micro_batch_size=1)),
    ]
    rows = []
    for model_name, plan in cases:
        model = preset(model_name, global_batch_sequences=512)
        validate_plan(plan, model, scaleup_domain_size=8)
        layouts = {
            "rayfleet": build_layout(plan, topology, held=held, cordoned=cordoned),
            "Ray PACK": baseline_layout(plan, topology, "PACK", held=held, cordoned=cordoned),
            "Ray SPREAD": baseline_layout(plan, topology, "SPREAD", held=held, cordoned=cordoned),
        }
        ours = None
        for name, layout in layouts.items():
            q = layout_quality(layout, topology, model)
            ours = ours or q
            rows.append({
                "model": model_name, "plan": plan.describe(), "placement": name, "tp_groups": q.tp_groups,
                "tp_groups_crossing_node": q.tp_groups_crossing_node, "ep_groups": q.ep_groups,
                "ep_groups_crossing_domain": q.ep_groups_crossing_domain,
                "dp_inter_node_transfers": q.dp_inter_node_transfers, "dp_cross_rail": q.dp_cross_rail_transfers,
                "pp_inter_node_transfers": q.pp_inter_node_transfers, "pp_cross_rail": q.pp_cross_rail_transfers,
                "spine_gb": q.spine_bytes / 1e9, "cross_block_gb": q.cross_block_bytes / 1e9,
                "spine_vs_rayfleet": q.spine_bytes / ours.spine_bytes if ours.spine_bytes else float("nan"),
            })
    return rows, len(held), cordoned


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write machine-readable results here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-brute-force", action="store_true")
    args = parser.parse_args()

    machine = {"python": platform.python_version(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
               "load_average_1m_at_start": os.getloadavg()[0]}
    print(f"placement benchmark on {platform.node()} ({machine['machine']}, {machine['cpu_count']} CPUs, "
          f"load {machine['load_average_1m_at_start']:.1f}), Python {machine['python']}; pure Python, no Ray")
    print("part 1: planner wall time (DeepSeek-V3 shapes, H100, top 5)")
    scaling = planner_scaling(args.repeats, brute=not args.skip_brute_force)
    print("part 2: layout quality on a fragmented fleet")
    quality, num_held, cordoned = layout_comparison()

    print()
    header = ["accelerators", "planner s", "brute force s", "speed-up", "same best", "layout s", "shapes",
              "pruned", "best plan"]
    rows = []
    for r in scaling:
        brute = r.get("brute_force_s")
        rows.append([f"{r['accelerators']:,}", f"{r['planner_s']:.3f}", f"{brute:.2f}" if brute else "-",
                     f"{brute / r['planner_s']:.1f}x" if brute else "-", str(r.get("same_best", "-")),
                     f"{r['layout_s']:.3f}", str(r["shapes"]), str(r["pruned"]), r["best_plan"]])
    print(_table(header, rows))
    at_10k = next(r for r in scaling if r["accelerators"] == 10_000)["planner_s"]
    print(f"goal <= 1 s at 10,000 accelerators: {'met' if at_10k <= 1.0 else 'NOT met'} ({at_10k:.3f} s)")
    print()
    print(f"fragmented fleet: 64 x 8 H100, 8 racks, 2 blocks; {num_held} accelerators held by other jobs, "
          f"cordoned {', '.join(cordoned)}; bytes per optimizer step")
    header = ["model / plan", "placement", "TP groups split", "EP off NVLink", "DP cross-rail", "PP cross-rail", "spine GB",
              "cross-block GB", "spine vs rayfleet"]
    rows = [[f"{q['model']} {q['plan']}", q["placement"], f"{q['tp_groups_crossing_node']}/{q['tp_groups']}",
             f"{q['ep_groups_crossing_domain']}/{q['ep_groups']}" if q["ep_groups"] else "-",
             f"{q['dp_cross_rail']}/{q['dp_inter_node_transfers']}", f"{q['pp_cross_rail']}/{q['pp_inter_node_transfers']}",
             f"{q['spine_gb']:.1f}", f"{q['cross_block_gb']:.1f}", f"{q['spine_vs_rayfleet']:.2f}x"] for q in quality]
    print(_table(header, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "planner_scaling": scaling,
                                               "layout_quality": quality}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
