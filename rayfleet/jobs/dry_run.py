"""``rayfleet train JOB.yaml --dry-run``: the plan a job would get, without Ray or a submission.

Design decisions:
- The same door as a real submission: :func:`rayfleet.jobs.planning.plan_inputs` then
  :func:`~rayfleet.jobs.planning.job_plan` (``placement/resolve.py``), so an explicit plan the
  trainer cannot run is refused here with the capability table's reason, and ``plan: auto``
  is the job's own search over the table's runnable space.
- No fleet is asked: the job is planned at the size it names -- ``resources.num_workers``,
  else the explicit plan's size, else an elastic job's ``max_workers`` -- on accelerators of
  ``resources.accelerator``. An elastic job is also planned at ``min_workers`` (the smallest
  formation its driver may re-plan at), and the report says so.
- The dataset is not read (a dry run plans; the submission checks the manifest).
- Pure: no Ray, no I/O; the CLI prints :func:`format_dry_run`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayfleet.errors import SpecError
from rayfleet.jobs.planning import job_plan, plan_inputs, world_size_of
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.placement.capabilities import runs_label
from rayfleet.placement.cost_model import evaluate_plan
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.catalogue import get_accelerator

__all__ = ["DryRunReport", "dry_run", "format_dry_run"]


@dataclass(frozen=True)
class DryRunReport:
    """The plan a job would run with, and how it was sized.

    ``step_time_s`` / ``mfu`` are the cost model's (``None`` when it cannot price the plan);
    ``nodes`` maps accelerator type -> servers the layout fills; ``sized_by`` says where the
    world size came from; ``smallest`` is the plan at an elastic job's ``min_workers`` (its
    ``describe()``, or why none fits).
    """

    name: str
    plan: ParallelPlan
    searched: bool
    world_size: int
    sized_by: str
    peak_memory_gib: float
    usable_memory_gib: float
    step_time_s: float | None
    mfu: float | None
    nodes: dict[str, int]
    runs: str
    smallest: str | None = None


def _world_size(spec: TrainJobSpec) -> tuple[int, str]:
    size = world_size_of(plan_inputs(spec))
    elastic = spec.resources.elastic
    if spec.resources.num_workers is not None:
        return size, "resources.num_workers" + (" (elastic: the requested size)" if elastic else "")
    if size is not None:
        return size, "the explicit plan's tp*cp*pp*dp"
    if elastic is not None:
        return elastic.max_workers, "resources.elastic.max_workers (a live fleet may form fewer)"
    raise SpecError("resources.num_workers", None, "a dry run plans without a fleet, so it needs the job's size",
                    "set resources.num_workers (or pass --set resources.num_workers=N)")


def _nodes(plan: ParallelPlan, accelerator: str) -> dict[str, int]:
    if plan.replica_accelerators is None:
        per_node = get_accelerator(accelerator).accelerators_per_node
        return {get_accelerator(accelerator).name: math.ceil(plan.world_size / per_node)}
    out: dict[str, int] = {}
    replica = plan.tp * plan.cp * plan.pp
    for kind in sorted(set(plan.replica_accelerators)):
        count = replica * plan.replica_accelerators.count(kind)
        out[kind] = math.ceil(count / get_accelerator(kind).accelerators_per_node)
    return out


def dry_run(spec: TrainJobSpec, *, params: CostParams = CostParams()) -> DryRunReport:
    """Plan ``spec`` as its submission would (raises ``SpecError`` as the submission would)."""
    inputs = plan_inputs(spec)
    world, sized_by = _world_size(spec)
    resolved = job_plan(inputs, world_size=world, params=params)
    plan = resolved.plan
    accel = {t: get_accelerator(t) for t in set(plan.replica_accelerators)} if plan.replica_accelerators \
        else get_accelerator(inputs.accelerator)
    try:
        cost = evaluate_plan(inputs.model, plan, accel, params=params)
        step, mfu, usable = cost.step_time_s, cost.mfu, cost.usable_memory_bytes / 2 ** 30
    except (SpecError, ValueError, KeyError, ZeroDivisionError):
        step = mfu = None
        usable = get_accelerator(inputs.accelerator).hbm_gib * params.usable_memory_fraction
    smallest = None
    elastic = spec.resources.elastic
    if elastic is not None and elastic.min_workers != world:
        try:
            smallest = job_plan(inputs, world_size=elastic.min_workers, params=params).plan.describe()
        except SpecError as err:
            smallest = f"none fits ({err})"
    return DryRunReport(name=spec.name, plan=plan, searched=resolved.searched, world_size=world, sized_by=sized_by,
                        peak_memory_gib=resolved.peak_memory_gib, usable_memory_gib=usable, step_time_s=step,
                        mfu=mfu, nodes=_nodes(plan, inputs.accelerator),
                        runs=runs_label(plan, precision=inputs.model.precision), smallest=smallest)


def _gib(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms"


def format_dry_run(report: DryRunReport, spec: TrainJobSpec) -> str:
    """The lines ``rayfleet train --dry-run`` prints."""
    plan = report.plan
    how = "searched (plan: auto, over what the trainer runs)" if report.searched else "explicit"
    step = f"{_seconds(report.step_time_s)} (MFU {100 * report.mfu:.1f}%, cost model)" \
        if report.step_time_s is not None and report.mfu is not None else "n/a (the cost model cannot price it)"
    nodes = ", ".join(f"{n:,} x {t} node{'s' if n != 1 else ''}" for t, n in report.nodes.items())
    lines = [
        f"{report.name}: dry run (no Ray, nothing submitted; the dataset is not read)",
        f"  plan:     {plan.describe()} [{how}]",
        f"  size:     {report.world_size:,} workers from {report.sized_by}",
        f"  layout:   {report.world_size:,} ranks on {nodes}"
        + (f"; stages start at layers {list(plan.stage_starts)}" if plan.stage_starts else ""),
        f"  memory:   {_gib(report.peak_memory_gib)} peak per device of {report.usable_memory_gib:.1f} GiB usable",
        f"  step:     {step}",
        f"  batch:    {spec.global_batch_size} x {spec.data.seq_len} tokens, "
        f"{plan.num_microbatches(spec.global_batch_size) if plan.replica_microbatches is None else 'per-replica'} "
        f"micro-batch(es) of {plan.micro_batch_size} per replica, precision {spec.precision}",
        f"  runs:     {report.runs}",
    ]
    if spec.resources.elastic is not None:
        e = spec.resources.elastic
        lines.append(f"  elastic:  formations of {e.min_workers}..{e.max_workers} workers re-plan at their size; "
                     f"at {e.min_workers}: {report.smallest or plan.describe()}")
    return "\n".join(lines)
