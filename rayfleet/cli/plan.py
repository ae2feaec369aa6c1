"""``rayfleet plan``: rank parallel plans for a model on a fleet and show where the ranks go.

    rayfleet plan examples/models/mixtral-8x7b.yaml --fleet H100:64 --top 5 --layout
    rayfleet plan examples/models/llama3-8b.yaml --fleet H100:100000        # the planner picks the size
    rayfleet plan deepseek-v3 --fleet H100:10000 --max-accelerators 2048 --objective throughput
    rayfleet plan deepseek-v3 --nodes 128 --accelerator H100 --racks 8
    rayfleet plan model.yaml --fleet H100:64,P800:64          # mixed fleet
    rayfleet plan deepseek-v3 --fleet H100:2048 --plan tp=1,pp=16,ep=64,vpp=1,recompute=selective

The ``runs`` column says whether ``rayfleet train`` runs a plan today (``yes``, or ``no:`` and the
kinds it does not run, from ``rayfleet/placement/capabilities.py``); ``--runnable`` searches only
those plans, the space a job's own ``plan: auto`` searches.

``--plan`` prices one given plan (fields of ``ParallelPlan``: tp, pp, dp, cp, ep, etp, mbs, vpp,
recompute, zero, adam, acts, dualpipe, ...; ``dp`` defaults to the fleet over tp*cp*pp) instead
of searching; it reports the same table, or why the plan cannot run.

The fleet is what is free: the plan takes as many accelerators as its objective wants --
``fastest`` (default: the fastest step that keeps ``--min-scaling-efficiency`` of the best
tokens/s per accelerator) or ``throughput`` (most tokens/s per accelerator) -- within
``--max-accelerators`` and ``--min-mfu``; ``--exact N`` plans for exactly N. The fleet is
synthetic (``--fleet TYPE:ACCELERATORS[,...]`` or ``--nodes/--accelerator/...``); the model is a
YAML file (see ``examples/models``) or a preset name. Pure: no cluster needed.
"""

from __future__ import annotations

import argparse
import json

from rayfleet.errors import SpecError

__all__ = ["register", "handle_plan"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` command to the ``rayfleet`` CLI."""
    p = subparsers.add_parser("plan", help="rank parallel plans (TP/PP/DP/EP/CP) for a model on a fleet",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model YAML (examples/models/*.yaml) or a preset name (e.g. mixtral-8x7b)")
    p.add_argument("--fleet", default=None, help="accelerators, e.g. 'H100:128' or 'H100:64,P800:64'")
    p.add_argument("--nodes", type=int, default=None, help="servers (instead of --fleet)")
    p.add_argument("--accelerator", default="H100", help="type or mix 'H100:2,P800:2' (with --nodes)")
    p.add_argument("--accelerators-per-node", type=int, default=None)
    p.add_argument("--racks", type=int, default=None, help="racks (default: 16 servers per rack)")
    p.add_argument("--racks-per-block", type=int, default=4)
    p.add_argument("--top", type=int, default=5, help="plans to show")
    p.add_argument("--objective", choices=("fastest", "throughput"), default="fastest",
                   help="fastest step, or most tokens/s per accelerator")
    p.add_argument("--max-accelerators", type=int, default=None, help="take at most this many")
    p.add_argument("--exact", type=int, default=None, help="take exactly this many (fixed-size job)")
    p.add_argument("--min-mfu", type=float, default=0.0, help="skip plans below this MFU (0-1)")
    p.add_argument("--bf16-moments", action="store_true",
                   help="also consider BF16 Adam moments (DeepSeek-V3's recipe; 4 bytes a parameter less)")
    p.add_argument("--fp8-activations", action="store_true",
                   help="FP8 models: also consider caching Linear/SwiGLU inputs in FP8 (DeepSeek-V3's recipe)")
    p.add_argument("--dualpipe", action="store_true",
                   help="also consider DeepSeek's DualPipe schedule (DualPipeV layout) for pipelines")
    p.add_argument("--runnable", action="store_true",
                   help="only plans `rayfleet train` runs today (those the runs column marks yes)")
    p.add_argument("--min-scaling-efficiency", type=float, default=0.8,
                   help="with 'fastest': keep at least this share of the best tokens/s per accelerator (0-1)")
    p.add_argument("--plan", default=None, metavar="FIELD=VALUE,...",
                   help="price this plan instead of searching, e.g. 'tp=1,pp=16,ep=64,recompute=selective'")
    p.add_argument("--layout", action="store_true", help="also print plan 1's rank -> accelerator layout")
    p.add_argument("--json", action="store_true", help="the ranked and rejected plans as one JSON object")
    p.set_defaults(func=handle_plan)


def plans_json(result, *, fleet: str) -> dict:
    """``rayfleet plan --json``: the search result as plain JSON (plans' fields, predicted costs)."""
    from dataclasses import asdict

    return {"fleet": fleet, "num_shapes": result.num_shapes,
            "ranked": [{"rank": r.rank, "plan": r.plan.describe(), "fields": asdict(r.plan),
                        "step_time_s": r.step_time_s, "tokens_per_s": r.cost.tokens_per_s, "mfu": r.cost.mfu,
                        "peak_memory_gib": r.peak_memory_gib} for r in result.ranked],
            "rejected": [asdict(r) for r in result.rejected],
            "job_size": None if getattr(result, "job_size", None) is None else asdict(result.job_size)}


def _print_plans(result, model, *, fleet: str, as_json: bool) -> None:
    from rayfleet.placement.plan_tables import format_plans

    print(json.dumps(plans_json(result, fleet=fleet), indent=2, default=str) if as_json
          else format_plans(result, model, fleet=fleet))


def _topology(args: argparse.Namespace):
    from rayfleet.placement.fleet_capacity import parse_fleet
    from rayfleet.platform.topology import build_topology

    if args.fleet and args.nodes:
        raise SpecError("--fleet", args.fleet, "given together with --nodes", "use one way to describe the fleet")
    if args.nodes:
        racks = args.racks or max(1, -(-args.nodes // 16))
        return build_topology(num_nodes=args.nodes, accelerator=args.accelerator,
                              accelerators_per_node=args.accelerators_per_node, num_racks=racks,
                              racks_per_block=args.racks_per_block)
    return parse_fleet(args.fleet or "H100:64", num_racks=args.racks)


def handle_plan(args: argparse.Namespace) -> int:
    """Print the ranked plans (and optionally the best plan's layout); 1 when none is feasible."""
    from rayfleet.placement import search
    from rayfleet.placement.fleet_capacity import fleet_capacity_of
    from rayfleet.placement.layout import build_layout
    from rayfleet.placement.model_spec import load_model_spec
    from rayfleet.placement.plan_tables import format_layout
    from rayfleet.placement.planner import search_plans
    from rayfleet.placement.search_space import JobGoal, SearchSpace

    if args.top < 1:
        raise SpecError("--top", args.top, "must be at least 1", "pass --top 1 or more")
    model = load_model_spec(args.model)
    if args.plan is not None:
        return _price_given_plan(model, args)
    if args.exact is not None:
        goal = JobGoal.exactly(args.exact)
    else:
        goal = JobGoal(objective=args.objective, max_accelerators=args.max_accelerators, min_mfu=args.min_mfu,
                       min_scaling_efficiency=args.min_scaling_efficiency)
    space = SearchSpace(optimizer_dtypes=("fp32", "bf16") if args.bf16_moments else ("fp32",),
                        activation_dtypes=("bf16", "fp8") if args.fp8_activations else ("bf16",),
                        dualpipe=args.dualpipe)
    if args.runnable:
        from rayfleet.placement.capabilities import runnable_space

        space = runnable_space(space)
    if args.fleet and not args.nodes and not args.layout:
        # a fleet string needs no topology to plan on (12,500 node records at 100,000 GPUs)
        capacity = fleet_capacity_of(args.fleet, num_racks=args.racks)
        result = search_plans(model, capacity, top_k=args.top, goal=goal, space=space)
        fleet = ", ".join(f"{n:,} x {t}" for t, n in sorted(capacity.counts.items()))
        _print_plans(result, model, fleet=fleet, as_json=args.json)
        return 0 if result.ranked else 1
    topology = _topology(args)
    result = search(model, topology, top_k=args.top, goal=goal, space=space)
    fleet = ", ".join(f"{n} x {t}" for t, n in sorted(topology.accelerator_types().items()))
    _print_plans(result, model, fleet=f"{fleet} on {len(topology.nodes)} nodes", as_json=args.json)
    if not result.ranked:
        return 1
    if args.layout and not args.json:
        layout = build_layout(result.ranked[0].plan, topology)
        print()
        print(f"layout of plan 1 ({result.ranked[0].plan.describe()}):")
        print(format_layout(layout, topology))
    return 0


# --plan names: the ParallelPlan field, or a short alias the plan table prints
_ALIASES = {"mbs": "micro_batch_size", "zero": "zero_stage", "adam": "optimizer_dtype", "acts": "activation_dtype"}


def parse_plan_text(text: str, *, num_accelerators: int):
    """``"tp=1,pp=16,ep=64"`` -> a :class:`ParallelPlan`; ``dp`` defaults to
    ``num_accelerators / (tp * cp * pp)``. Raises :class:`SpecError` naming the item, why it is
    wrong and the fix."""
    from dataclasses import fields

    from rayfleet.placement.plan import ParallelPlan

    kinds = {f.name: type(getattr(ParallelPlan(), f.name)) for f in fields(ParallelPlan)}
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        name = _ALIASES.get(key.strip(), key.strip())
        if not sep or name not in kinds:
            raise SpecError("--plan", item, "is not FIELD=VALUE with a ParallelPlan field",
                            f"use fields among {', '.join(sorted(set(kinds) | set(_ALIASES)))}")
        kind, raw = kinds[name], raw.strip()
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                values[name] = raw.lower() in ("true", "1", "yes")
            elif kind is int:
                values[name] = int(raw)
            elif kind is str:
                values[name] = raw
            else:  # tuples (stage_starts, layer_tp, ...): colon-separated
                values[name] = tuple(int(x) for x in raw.split(":"))
        except ValueError:
            raise SpecError("--plan", item, f"{name} takes a {'bool' if kind is bool else 'number' if kind is int else 'colon-separated list'}",
                            f"write e.g. {name}={'true' if kind is bool else '2' if kind is int else '0:16:32'}") from None
    if "dp" not in values:
        width = values.get("tp", 1) * values.get("cp", 1) * values.get("pp", 1)
        if num_accelerators % width:
            raise SpecError("--plan", text, f"tp*cp*pp = {width} does not divide the fleet's {num_accelerators} "
                            "accelerators, so dp cannot be derived", "give dp=N, or a fleet that tp*cp*pp divides")
        values["dp"] = num_accelerators // width
    return ParallelPlan(**values)


def _price_given_plan(model, args: argparse.Namespace) -> int:
    """Price ``--plan`` on the fleet's accelerator type: the ranked-plan table with one row, or
    the reason it cannot run (invalid degrees, or memory). 0 when it fits, 1 when not."""
    from rayfleet.placement.cost_model import GIB, evaluate_plan
    from rayfleet.placement.fleet_capacity import fleet_capacity_of
    from rayfleet.placement.plan import even_stage_starts, validate_plan
    from rayfleet.placement.search_results import PlanSearchResult, RankedPlan, Rejection

    capacity = fleet_capacity_of(args.fleet or f"{args.accelerator}:{(args.nodes or 8) * 8}", num_racks=args.racks)
    types = [t for t, n in capacity.counts.items() if n]
    if len(types) != 1:
        raise SpecError("--fleet", args.fleet, "--plan prices one accelerator type", "give a fleet of one type")
    accel = capacity.accelerators[types[0]]
    plan = parse_plan_text(args.plan, num_accelerators=capacity.counts[types[0]])
    head = f"given plan {plan.describe()} on {plan.world_size:,} x {accel.name}"
    if plan.world_size > capacity.counts[types[0]] and not args.json:
        print(f"{head}: note: larger than the fleet's {capacity.counts[types[0]]:,}")
    # stages unset: checked on any split, then balanced by the cost model (as the search does)
    probe = plan.but(stage_starts=even_stage_starts(model.num_layers, plan.pp)) \
        if plan.stage_starts is None and plan.pp <= model.num_layers else plan
    validate_plan(probe, model, scaleup_domain_size=accel.scaleup_domain_size)  # raises SpecError with the fix
    cost = evaluate_plan(model, plan, accel)
    fits = cost.memory.total <= cost.usable_memory_bytes
    ranked = (RankedPlan(1, cost.plan, cost),) if fits else ()
    rejected = () if fits else (Rejection(plan.describe(), f"memory: needs {cost.memory.total / GIB:.1f} GiB on stage "
                                          f"{cost.memory.stage} > {cost.usable_memory_bytes / GIB:.1f} GiB usable on "
                                          f"{accel.name}. Fix: more recompute, a higher zero stage, more pp/ep, "
                                          "or a smaller micro-batch"),)
    _print_plans(PlanSearchResult(ranked, rejected, 1, 0), model, fleet=head, as_json=args.json)
    if not fits and not args.json:  # still show what it would cost, so a user can compare with the search
        print(f"  priced anyway: step {cost.step_time_s:.3f} s, MFU {100 * cost.mfu:.1f}%, "
              f"bottleneck {cost.step.bottleneck}")
    return 0 if fits else 1
