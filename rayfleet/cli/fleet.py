"""``rayfleet up|down|status|topology|cordon|uncordon|self-check``: the fleet itself.

These are the built-in commands: ``rayfleet --help`` lists them in full, so this module imports
nothing heavy at the top; each handler imports the launcher, the SDK or the tables it needs.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayfleet.sdk import Fleet

__all__ = ["register"]


def _cmd_up(args: argparse.Namespace) -> int:
    from rayfleet.platform.launcher import LocalFleet
    from rayfleet.platform.status_table import render_topology
    from rayfleet.platform.topology import build_topology, parse_accelerator_mix

    num_nodes = args.nodes
    if num_nodes is None:
        mix = parse_accelerator_mix(args.accelerator, num_nodes=None if "," in args.accelerator or ":" in args.accelerator else 2)
        num_nodes = sum(n for _, n in mix)
    topology = build_topology(num_nodes=num_nodes, accelerator=args.accelerator,
                              accelerators_per_node=args.accelerators_per_node, num_racks=args.racks,
                              racks_per_block=args.racks_per_block)
    print(render_topology(topology))
    start = time.monotonic()
    fleet = LocalFleet.up(topology, num_cpus_per_node=args.cpus_per_node, object_store_mib=args.object_store_mib)
    print(f"\nstarted {len(fleet.nodes)} nodes in {time.monotonic() - start:.1f}s; "
          f"address {fleet.address}, dashboard {fleet.dashboard_url}")
    from rayfleet.sdk import connect

    sdk = connect(fleet.address)
    _wait_for_agents(sdk, num_nodes=len(topology.nodes), timeout_s=60)
    sdk.print_status()
    print(f"\nsubmit jobs with: RAY_AUTH_MODE=token ray job submit --address {fleet.dashboard_url} -- python -m rayfleet status")
    return 0


def _wait_for_agents(sdk: Fleet, *, num_nodes: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = sdk.status().nodes
        if len(rows) >= num_nodes and all(r.health == "healthy" for r in rows):
            return
        time.sleep(0.5)


def _cmd_down(args: argparse.Namespace) -> int:
    from rayfleet.platform.launcher import LocalFleet

    fleet = LocalFleet.load()
    names = [n.name for n in fleet.nodes]
    fleet.down()
    print(f"stopped {len(names)} nodes: {', '.join(names)}")
    return 0


def _connect(args: argparse.Namespace) -> Fleet:
    from rayfleet.sdk import connect

    return connect(getattr(args, "address", None))


def _cmd_status(args: argparse.Namespace) -> int:
    from rayfleet.platform.status_table import render_status

    status = _connect(args).status()
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(status), default=str, indent=2))
    else:
        print(render_status(status, show_events=not args.no_events))
    return 0


def _cmd_topology(args: argparse.Namespace) -> int:
    from rayfleet.platform.status_table import render_topology

    topology = _connect(args).topology()
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(topology), default=str, indent=2))
    else:
        print(render_topology(topology))
    return 0


def _cmd_cordon(args: argparse.Namespace) -> int:
    reserved = _connect(args).cordon(args.node, args.reason)
    print(f"cordoned {args.node} ({reserved} free accelerators reserved); reason: {args.reason}")
    return 0


def _cmd_uncordon(args: argparse.Namespace) -> int:
    _connect(args).uncordon(args.node)
    print(f"uncordoned {args.node}")
    return 0


def _cmd_self_check(args: argparse.Namespace) -> int:
    result = _connect(args).self_check(args.node, inject_fault=args.inject)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the fleet commands (``up`` ... ``self-check``) to the ``rayfleet`` CLI."""
    up = subparsers.add_parser("up", help="start a local multi-node fleet (one raylet per server)")
    up.add_argument("--nodes", type=int, default=None, help="number of servers (default: 2, or the sum of a mix)")
    up.add_argument("--accelerator", default="H100", help="type, or a mix like 'H100:2,P800:2'")
    up.add_argument("--accelerators-per-node", type=int, default=None,
                    help="accelerators per server (default: the catalogue's, e.g. 8)")
    up.add_argument("--racks", type=int, default=1)
    up.add_argument("--racks-per-block", type=int, default=4)
    up.add_argument("--cpus-per-node", type=float, default=2, help="logical CPUs each node declares")
    up.add_argument("--object-store-mib", type=int, default=384)
    up.set_defaults(func=_cmd_up)

    down = subparsers.add_parser("down", help="stop the local fleet started by `rayfleet up` (only its processes)")
    down.set_defaults(func=_cmd_down)

    for name, func, help_ in (("status", _cmd_status, "nodes, accelerators, health and events"),
                              ("topology", _cmd_topology, "racks, blocks, scale-up domains")):
        p = subparsers.add_parser(name, help=help_)
        p.add_argument("--address", default=None, help="host:port of the cluster (default: the local fleet)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "status":
            p.add_argument("--no-events", action="store_true")
        p.set_defaults(func=func)

    cordon = subparsers.add_parser("cordon", help="stop new work from landing on a node")
    cordon.add_argument("node")
    cordon.add_argument("--reason", default="cordoned by operator")
    cordon.add_argument("--address", default=None)
    cordon.set_defaults(func=_cmd_cordon)
    uncordon = subparsers.add_parser("uncordon", help="let work land on a node again")
    uncordon.add_argument("node")
    uncordon.add_argument("--address", default=None)
    uncordon.set_defaults(func=_cmd_uncordon)
    check = subparsers.add_parser("self-check", help="run a node's deterministic GEMM self-check")
    check.add_argument("node")
    check.add_argument("--inject", choices=["sdc"], default=None, help="inject silent data corruption first")
    check.add_argument("--address", default=None)
    check.set_defaults(func=_cmd_self_check)
