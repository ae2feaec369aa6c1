"""Plain-text tables of ranked plans and rank layouts (for ``rayfleet plan`` and notebooks).

Plain fixed-width text so it reads the same in a terminal, a log and a test assertion.
"""

from __future__ import annotations

import re
from typing import Iterable

from rayfleet.placement.capabilities import runs_label
from rayfleet.placement.layout import Layout
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.search_results import PlanSearchResult
from rayfleet.platform.topology import AcceleratorSlot, FleetTopology

__all__ = ["format_plans", "format_layout"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_plans(result: PlanSearchResult, model: ModelSpec, *, fleet: str = "") -> str:
    """The ranked plans (size, degrees, memory, step time, throughput per accelerator, MFU,
    bottleneck, whether ``rayfleet train`` runs it: ``yes`` or ``no:<kinds>``), how many accelerators the best takes and why, then why other shapes fail."""
    head = (f"model {model.name}: {model.total_params() / 1e9:.1f}B params ({model.active_params() / 1e9:.1f}B "
            f"active), seq {model.seq_len}, batch {model.global_batch_sequences} x {model.seq_len} tokens, "
            f"{model.precision}" + (f" | fleet {fleet}" if fleet else ""))
    rows = []
    for rp in result.ranked:
        p, c = rp.plan, rp.cost
        rows.append([str(rp.rank), f"{p.world_size:,}", f"TP{p.tp}", f"PP{p.pp}" + (f"x{p.vpp}" if p.vpp > 1 else "+DualPipe" if p.dualpipe else ""),
                     f"DP{p.dp}", f"CP{p.cp}", f"EP{p.ep}", f"ETP{p.etp}", str(p.micro_batch_size),
                     f"{p.zero_stage}", p.optimizer_dtype, p.activation_dtype, p.recompute, f"{c.peak_memory_gib:.1f}",
                     f"{c.step_time_s:.3f}", f"{rp.tokens_per_s_per_accelerator:,.0f}", f"{100 * c.mfu:.1f}%",
                     rp.bottleneck, runs_label(p, precision=model.precision)])
    # "runs" last: its "no:cp>1,vpp>1" is the one cell a reader of the table does not expect
    table = _table(["#", "accel", "TP", "PPxVP", "DP", "CP", "EP", "ETP", "mbs", "ZeRO", "adam", "acts", "recompute",
                    "mem GiB", "step s", "tok/s/acc", "MFU", "bottleneck", "runs"], rows) if rows else "no feasible plan"
    lines = [head, table]
    if result.ranked:
        best = result.ranked[0]
        starts = best.plan.stage_starts or (0,)
        lines.append(f"plan 1 stages start at layers {list(starts)}"
                     + (f"; replicas {_replicas(best.plan)}" if best.plan.replica_accelerators else ""))
    if result.job_size is not None:
        size = result.job_size
        lines.append(f"job size: {size.num_accelerators:,} of {size.num_free:,} accelerators -- {size.reason}")
    summary = result.rejection_summary()
    lines.append(f"{result.num_shapes} shapes considered, {len(result.ranked)} shown, {result.num_pruned} "
                 f"pruned by bound, {len(result.rejected)} infeasible"
                 + (": " + ", ".join(f"{n} x {reason}" for reason, n in summary) if summary else ""))
    examples = list(result.rejected[:3])
    if not result.ranked:  # show the shapes that came closest to fitting, not the first tried
        examples = sorted(result.rejected, key=_needed_gib)[:3]
    for rej in examples:
        lines.append(f"  e.g. {rej.shape}: {rej.reason}")
    return "\n".join(lines)


def _needed_gib(rejection) -> float:
    """The GiB a memory rejection says it needs (infinity for other reasons)."""
    match = re.search(r"(\d+(?:\.\d+)?) GiB", rejection.reason)
    return float(match.group(1)) if rejection.reason.startswith("memory") and match else float("inf")


def _replicas(plan) -> str:
    out: dict[str, list[int]] = {}
    for t, m in zip(plan.replica_accelerators, plan.replica_microbatches or ()):
        out.setdefault(t, []).append(m)
    return ", ".join(f"{len(v)} x {t} ({v[0]} micro-batches)" for t, v in out.items())


def format_layout(layout: Layout, topology: FleetTopology, *, held: Iterable[AcceleratorSlot] = (),
                  max_nodes: int = 32) -> str:
    """A node x accelerator-index grid: ``r<rank>`` where a rank sits, ``x`` held, ``.`` free."""
    held_set = set(held)
    at = {slot: rank for rank, slot in enumerate(layout.rank_to_slot)}
    used = set(layout.nodes())
    nodes = [n for n in topology.nodes if n.name in used]
    width = max((n.num_accelerators for n in nodes), default=0)
    rows = []
    for n in nodes[:max_nodes]:
        cells = []
        for i in range(width):
            slot = AcceleratorSlot(n.name, i)
            if slot in at:
                c = layout.plan.coords(at[slot])
                cells.append(f"r{at[slot]}:s{c.pp}")
            else:
                cells.append("x" if slot in held_set else ("." if i < n.num_accelerators else ""))
        rows.append([n.name, n.rack, n.block, n.accelerator_type] + cells)
    text = _table(["node", "rack", "block", "type"] + [str(i) for i in range(width)], rows)
    more = len(nodes) - max_nodes
    plan = layout.plan
    legend = (f"cell = r<rank>:s<pipeline stage>; rank order tp, cp, dp, pp (innermost first): "
              f"TP{plan.tp} groups are consecutive ranks, DP peers differ by {plan.tp * plan.cp}, "
              f"PP peers by {plan.tp * plan.cp * plan.dp}")
    return text + (f"\n... {more} more nodes" if more > 0 else "") + "\n" + legend
