"""Plain-text rendering of fleet topology and status (CLI, notebooks, logs).

Plain text rather than ``rich`` tables: the output goes to CI logs, ``ray job logs`` and
notebooks alike, where escape codes and box characters get mangled.
"""

from __future__ import annotations

import time
from typing import Sequence

from rayfleet.platform.inventory import FleetStatus
from rayfleet.platform.topology import FleetTopology

__all__ = ["format_table", "render_status", "render_topology", "render_admissions", "render_pool_grants"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_topology(topology: FleetTopology) -> str:
    rows = [(n.name, n.role, n.accelerator_type, n.num_accelerators, n.rack, n.block, n.nvlink_domain)
            for n in topology.nodes]
    types = ", ".join(f"{count}x {t}" for t, count in sorted(topology.accelerator_types().items()))
    head = (f"fleet: {len(topology.nodes)} nodes, {topology.num_accelerators} accelerators ({types}), "
            f"{len(topology.racks())} racks, {len(topology.blocks())} blocks, "
            f"{len(topology.nvlink_domains())} scale-up domains, {len(topology.rails())} rails")
    return head + "\n" + format_table(("node", "role", "type", "accel", "rack", "block", "nvlink-domain"), rows)


def _clip(text: str, width: int = 36) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def render_status(status: FleetStatus, *, show_events: bool = True) -> str:
    rows = []
    for row in status.nodes:
        topo, use = row.topology, row.usage
        beat = "-" if row.last_heartbeat_age_s is None else f"{row.last_heartbeat_age_s:.0f}s"
        health = row.health + (f" ({_clip(row.health_reason)})" if row.health_reason else "")
        cordon = f"yes: {_clip(row.cordon_reason)}" if row.cordoned else "no"
        rows.append((topo.name, topo.accelerator_type, topo.rack, topo.block, topo.nvlink_domain,
                     f"{use.free}/{use.total}", use.training, use.inference, use.cordoned, use.other,
                     health, cordon, beat))
    tot = status.totals()
    out = format_table(
        ("node", "type", "rack", "block", "nvlink", "free/total", "train", "infer", "cordoned", "other",
         "health", "cordon", "heartbeat"), rows)
    out += (f"\ntotal: {tot.free}/{tot.total} free, {tot.training} training, {tot.inference} inference, "
            f"{tot.cordoned} cordoned, {tot.other} other")
    jobs = [r for r in status.admissions if not r["request"].get("serve_pool")]
    pools = [r for r in status.admissions if r["request"].get("serve_pool")]
    if jobs:
        out += "\n\ntraining jobs in queues:\n" + render_admissions(jobs)
    if pools:
        out += "\n\nServe pools in queues:\n" + render_pool_grants(pools)
    if show_events and status.decisions:
        out += "\n\nautoscaler decisions:\n" + format_table(
            ("time", "subject", "decision", "reason"),
            [(time.strftime("%H:%M:%S", time.localtime(e.ts)), e.subject, e.kind.removeprefix("autoscaler_"), e.cause)
             for e in status.decisions])
    if show_events and status.events:
        out += "\n\nrecent events:\n" + format_table(
            ("time", "subject", "event", "cause"),
            [(time.strftime("%H:%M:%S", time.localtime(e.ts)), e.subject, e.kind, e.cause) for e in status.events])
    return out


def render_admissions(records: Sequence[dict]) -> str:
    """One row per queued or admitted job (``AdmissionRecord`` JSON): queued first, in line order."""
    rows = []
    for r in records:
        req = r["request"]
        line = str(r["position"]) if r["state"] == "QUEUED" else "-"
        size = f"{r['size']}" + (f" ({r['borrowed']} borrowed)" if r["borrowed"] else "")
        rows.append((req["job_id"], req["queue"], r["state"], line, size, f"{req['min_size']}..{req['max_size']}",
                     req["accelerator_type"], req["job_class"], _clip(r["reason"], 90)))
    return format_table(("job", "queue", "state", "place", "size", "wants", "type", "class", "reason"), rows)


def render_pool_grants(records: Sequence[dict]) -> str:
    """One row per Serve pool admitted through a queue (``AdmissionRecord`` JSON of a
    ``serve_admission`` request): the accelerators its replicas hold of what its queue granted
    (``held/granted``; Serve's autoscaling stays within the grant), in whole replicas of ``per``."""
    rows = []
    for r in records:
        req = r["request"]
        wants = f"{req['min_size']}..{req['max_size']}"
        rows.append((req["job_id"], req["queue"], r["state"], f"{r['held']}/{r['size']}", wants,
                     req["replica_size"], req["accelerator_type"], _clip(r["reason"], 90)))
    return format_table(("pool", "queue", "state", "held/granted", "wants", "per", "type", "reason"), rows)
