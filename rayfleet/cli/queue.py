"""``rayfleet queue ...``: create, list, show, delete and apply (from YAML) the fleet's hierarchical queues.

    rayfleet queue create research --parent training --quota H100=64 --borrow-limit H100=32 --priority 1
    rayfleet queue list
    rayfleet queue show research
    rayfleet queue delete research
    rayfleet queue apply queues.yaml      # declare many at once (examples/queues.yaml)

Arguments become a :class:`~rayfleet.platform.queues.QueueSpec` here (pure, unit-tested without
Ray); the controller re-validates the whole tree (parents exist, children's guarantees backed
by the parent) before storing it. Quota and preemption rules: docs/queues.md.
"""

from __future__ import annotations

import argparse
import json

from rayfleet.errors import SpecError
from rayfleet.platform.queues import Queue, parse_queue_spec

__all__ = ["register", "parse_counts", "queue_spec_from_args", "render_queues"]


def parse_counts(flag: str, text: str | None) -> dict[str, int] | None:
    """``'H100=64,P800=8'`` -> ``{'H100': 64, 'P800': 8}``; ``None`` stays ``None``."""
    if text is None:
        return None
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, count = part.partition("=")
        if not sep or not count.strip().lstrip("-").isdigit():
            raise SpecError(flag, text, f"{part!r} is not TYPE=COUNT", f"write e.g. {flag} H100=64,P800=8")
        out[kind.strip()] = int(count)
    return out


def queue_spec_from_args(args: argparse.Namespace) -> Queue:
    """Validate ``queue create`` arguments into a queue (SpecError names the flag and the fix)."""
    spec = {"name": args.name, "parent": args.parent, "quota": parse_counts("--quota", args.quota) or {},
            "borrow_limit": parse_counts("--borrow-limit", args.borrow_limit), "priority": args.priority}
    return parse_queue_spec(spec)


def render_queues(queues: list[dict]) -> str:
    from rayfleet.platform.status_table import format_table

    def counts(value: dict | None, none: str) -> str:
        return none if value is None else (", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-")

    children: dict[str | None, list[dict]] = {}
    for q in queues:
        children.setdefault(q["parent"], []).append(q)
    rows: list[tuple] = []

    def walk(parent: str | None, depth: int) -> None:
        for q in sorted(children.get(parent, []), key=lambda q: q["name"]):
            rows.append(("  " * depth + q["name"], counts(q["quota"], "-"), counts(q["borrow_limit"], "unlimited"),
                         q["priority"]))
            walk(q["name"], depth + 1)

    walk(None, 0)
    return format_table(("queue", "guaranteed quota", "borrow limit", "priority"), rows) if rows else "no queues"


def _fleet(args: argparse.Namespace):
    from rayfleet.sdk import connect

    return connect(args.address)


def _cmd_create(args: argparse.Namespace) -> int:
    queue = queue_spec_from_args(args)  # fail before connecting
    _fleet(args).create_queue(queue.name, parent=queue.parent, quota=dict(queue.quota),
                              borrow_limit=None if queue.borrow_limit is None else dict(queue.borrow_limit),
                              priority=queue.priority)
    print(f"queue {queue.name} created")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    queues = [q.to_json() for q in _fleet(args).queues()]
    print(json.dumps(queues, indent=2) if args.json else render_queues(queues))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    fleet = _fleet(args)
    match = [q for q in fleet.queues() if q.name == args.name]
    if not match:
        raise SpecError("queue", args.name, "no such queue", "see `rayfleet queue list`")
    events = fleet.events(limit=10, node=args.name)
    if args.json:
        print(json.dumps({**match[0].to_json(), "events": [{"kind": e.kind, "cause": e.cause} for e in events]},
                         indent=2))
        return 0
    print(json.dumps(match[0].to_json(), indent=2))
    for event in events:
        print(f"  {event.kind}: {event.cause}")
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    import yaml

    from rayfleet.platform.queues import parse_queue_file

    try:
        with open(args.file) as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise SpecError("queues file", args.file, "no such file", "pass the path of a queues YAML (see examples/queues.yaml)") from None
    except yaml.YAMLError as err:
        raise SpecError("queues file", args.file, f"is not valid YAML ({err})", "fix the YAML syntax") from None
    queues = parse_queue_file(data, source=args.file)  # fail before connecting
    result = _fleet(args).apply_queues([q.to_json() for q in queues])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key in ("created", "updated", "unchanged"):
            if result[key]:
                print(f"{key}: {', '.join(result[key])}")
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    _fleet(args).delete_queue(args.name)
    print(f"queue {args.name} deleted")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rayfleet queue {create,list,show,delete,apply}``."""
    queue = subparsers.add_parser("queue", help="hierarchical queues: quota, borrow limit, priority",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = queue.add_subparsers(dest="queue_command", required=True)
    create = sub.add_parser("create", help="create or replace a queue")
    create.add_argument("name")
    create.add_argument("--parent", default=None, help="parent queue (omit for a root)")
    create.add_argument("--quota", default=None, help="guaranteed accelerators, e.g. H100=64,P800=8")
    create.add_argument("--borrow-limit", default=None,
                        help="extra accelerators it may borrow from idle quota, e.g. H100=16 (default: unlimited)")
    create.add_argument("--priority", type=int, default=0, help="larger is admitted first")
    create.set_defaults(func=_cmd_create)
    listing = sub.add_parser("list", help="the queue tree")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_cmd_list)
    show = sub.add_parser("show", help="one queue and its recent events")
    show.add_argument("name")
    show.add_argument("--json", action="store_true", help="the queue and its events as one JSON object")
    show.set_defaults(func=_cmd_show)
    delete = sub.add_parser("delete", help="delete a queue without children or jobs")
    delete.add_argument("name")
    delete.set_defaults(func=_cmd_delete)
    apply = sub.add_parser("apply", help="create or update every queue of a YAML file, validated as one tree")
    apply.add_argument("file", help="YAML: `queues:` then one mapping per queue (name, parent, quota, borrow_limit, priority)")
    apply.add_argument("--json", action="store_true", help="the created/updated/unchanged names as JSON")
    apply.set_defaults(func=_cmd_apply)
    for p in (create, listing, show, delete, apply):
        p.add_argument("--address", default=None, help="host:port of the cluster (default: the local fleet)")
