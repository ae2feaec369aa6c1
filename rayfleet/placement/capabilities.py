"""What the trainer runs: one table of parallelism kinds, read by the planner and by the trainer.

Design decisions:
- One row (:class:`Capability`) per parallelism kind a :class:`ParallelPlan` can name: whether
  ``rayfleet train`` runs it today, why not (and which item of issue 28 adds it), the plan field
  a user sets and the value that avoids it. Rows are filled from the trainer's code
  (``rayfleet/jobs/parallel/*``, ``jobs/loop.py``, ``jobs/optim.py``), not from the planner's
  cost model: the planner prices more kinds than the trainer builds.
- Both sides read the table and nothing else: :func:`require_runnable` is the trainer's plan
  check (the job spec, ``placement/resolve.py`` and the worker's ``build_parallel_context``
  call it), :func:`runnable_space` narrows a :class:`SearchSpace` to what the trainer runs (the
  job's own search and ``rayfleet plan --runnable``), and :func:`runs_label` is the ``runs``
  column of the plan table. A kind that becomes runnable is one ``runs=True`` here: the spec
  accepts it, the job's search considers it and the plan table marks it ``yes``.
- Pure: no Ray, no torch; a row's ``uses`` looks only at the plan's fields and the model's
  GEMM precision ("bf16" / "fp8").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.search_space import SearchSpace

__all__ = ["Capability", "CAPABILITIES", "capability", "refusals", "require_runnable", "runs_label",
           "runnable_space"]


def _no_restriction(space: SearchSpace) -> SearchSpace:
    return space


@dataclass(frozen=True)
class Capability:
    """One parallelism kind and whether the trainer runs it.

    Attributes:
        kind: stable id, e.g. ``"pp.interleaved"``, ``"zero.2"``.
        name: what the plan table's ``runs`` column prints when the kind is refused (no spaces).
        field: the plan field that selects the kind (``plan.vpp``), as errors name it.
        runs: whether ``rayfleet train`` runs it today.
        reason: why not (``runs=False``), or how the trainer runs it (``runs=True``).
        fix: the setting that avoids the kind (for refused kinds).
        uses: ``uses(plan, precision)``: whether a plan (on a model of GEMM precision
            "bf16"/"fp8") uses the kind.
        value: the plan's value of ``field`` (what an error quotes).
        example: ``ParallelPlan`` fields (and ``precision``) of a small plan that uses the kind.
        drop: ``drop(space)``: the search space without the kind (how the planner leaves it out).
    """

    kind: str
    name: str
    field: str
    runs: bool
    reason: str
    fix: str
    uses: Callable[[ParallelPlan, str], bool]
    value: Callable[[ParallelPlan], Any]
    example: Mapping[str, Any] = field(default_factory=dict)
    drop: Callable[[SearchSpace], SearchSpace] = _no_restriction


def _attr(name: str) -> Callable[[ParallelPlan], Any]:
    return lambda plan: getattr(plan, name)


def _zero(stage: int, runs: bool, reason: str) -> Capability:
    def drop(space: SearchSpace) -> SearchSpace:
        kept = tuple(z for z in space.zero_ladder if z != stage)
        return replace(space, zero_stage=None, zero_stages=kept)

    return Capability(f"zero.{stage}", f"ZeRO-{stage}", "plan.zero_stage", runs, reason, "set zero_stage: 3",
                      lambda p, _: p.zero_stage == stage, _attr("zero_stage"), MappingProxyType({"dp": 2, "zero_stage": stage}),
                      drop)


def _recompute(mode: str, reason: str) -> Capability:
    return Capability(f"recompute.{mode}", f"recompute:{mode}", "plan.recompute", True, reason, "set recompute: none",
                      lambda p, _: p.recompute == mode, _attr("recompute"), MappingProxyType({"recompute": mode}),
                      lambda s: replace(s, recompute=tuple(r for r in s.recompute if r != mode)))


_FSDP_NO_RESHARD = ("FSDP2 over DP with reshard_after_forward=False (jobs/parallel/apply.py: every zero_stage "
                    "below 3 takes this path): parameters stay gathered from forward to backward, gradients and "
                    "optimizer states are sharded")

CAPABILITIES: tuple[Capability, ...] = (
    Capability("tp", "tp>1", "plan.tp", True,
               "DTensor tensor parallelism of attention and dense MLPs (jobs/parallel/tensor_parallel.py)",
               "set tp: 1", lambda p, _: p.tp > 1, _attr("tp"), MappingProxyType({"tp": 2})),
    Capability("pp.1f1b", "pp>1", "plan.pp", True,
               "Schedule1F1B over the plan's stage_starts (jobs/parallel/pipeline.py)",
               "set pp: 1", lambda p, _: p.pp > 1 and p.vpp == 1 and not p.dualpipe, _attr("pp"),
               MappingProxyType({"pp": 2}), lambda s: replace(s, max_pp=1)),
    Capability("pp.interleaved", "vpp>1", "plan.vpp", True,
               "ScheduleInterleaved1F1B over vpp model chunks a rank, rank r holding virtual stages r, r+pp, ... "
               "with each rank's stage_starts layers split over its chunks (jobs/parallel/pipeline.py, "
               "placement/pipeline_chunks.py)",
               "set vpp: 1 (plain 1F1B)", lambda p, _: p.vpp > 1, _attr("vpp"), MappingProxyType({"pp": 2, "vpp": 2}),
               lambda s: replace(s, virtual_stages=(1,))),
    Capability("pp.dualpipev", "DualPipeV", "plan.dualpipe", True,
               "ScheduleDualPipeV over two model chunks a rank in a V, rank r holding virtual stages r and "
               "2*pp-1-r (jobs/parallel/pipeline.py, placement/pipeline_chunks.py)",
               "set dualpipe: false (plain 1F1B)", lambda p, _: p.dualpipe, _attr("dualpipe"),
               MappingProxyType({"pp": 2, "dualpipe": True}), lambda s: replace(s, dualpipe=False)),
    # A combination: DualPipeV runs, ZeRO-3 runs, not both (a search space cannot drop the pair,
    # so a search offering DualPipeV with a ZeRO-3 rung drops DualPipeV).
    Capability("pp.dualpipev+zero.3", "DualPipeV+ZeRO-3", "plan.zero_stage", False,
               "DualPipeV with ZeRO-3 (FSDP2 resharding after forward) is not implemented: its separate "
               "weight-gradient pass runs on resharded parameters and the losses leave the single-process run's "
               "(measured at PP2 x DP2; ZeRO-1/2 match it)",
               "set zero_stage: 2 (or dualpipe: false)", lambda p, _: p.dualpipe and p.zero_stage == 3 and p.dp > 1,
               _attr("zero_stage"), MappingProxyType({"pp": 2, "dp": 2, "dualpipe": True, "zero_stage": 3}),
               lambda s: replace(s, dualpipe=False) if s.dualpipe and 3 in s.zero_ladder else s),
    Capability("cp", "cp>1", "plan.cp", True,
               "load-balanced context parallelism: CP rank i holds sequence chunks i and 2*cp-1-i, attention "
               "all-gathers K/V over the CP group (or passes them around a ring: comm.cp_exchange) and merges "
               "per-chunk partial softmaxes by log-sum-exp, GQA and MLA alike; gradients summed over CP "
               "(jobs/parallel/context_parallel.py, context_parallel_ring.py)",
               "set cp: 1 (split further with tp, ep or pp)", lambda p, _: p.cp > 1, _attr("cp"),
               MappingProxyType({"cp": 2}), lambda s: replace(s, context_parallel=(1,))),
    Capability("ep", "ep>1", "plan.ep", True,
               "all-to-all expert dispatch, folded into the DP x TP ranks (jobs/parallel/expert_parallel.py)",
               "set ep: 1", lambda p, _: p.ep > 1, _attr("ep"), MappingProxyType({"dp": 2, "ep": 2})),
    Capability("etp", "etp>1", "plan.etp", True,
               "expert tensor parallelism inside the EP group: each rank keeps 1/etp of its experts' hidden units "
               "(w1/w3 column-, w2 row-parallel); rows are all-gathered over ETP after the EP dispatch and the "
               "partial outputs reduce-scattered before the combine (jobs/parallel/expert_parallel.py, "
               "models/expert_tensor_parallel.py)",
               "set etp: 1 and split experts with ep", lambda p, _: p.etp > 1, _attr("etp"),
               MappingProxyType({"tp": 2, "dp": 2, "ep": 2, "etp": 2}), lambda s: replace(s, expert_tp_options="1")),
    _zero(0, True, _FSDP_NO_RESHARD + " (so ZeRO-0 runs as ZeRO-2 when dp > 1)"),
    _zero(1, True, _FSDP_NO_RESHARD + " (so ZeRO-1 runs as ZeRO-2: its memory is at most the ZeRO-1 estimate)"),
    _zero(2, True, _FSDP_NO_RESHARD),
    _zero(3, True, "FSDP2 over DP with reshard_after_forward=True (jobs/parallel/apply.py)"),
    _recompute("none", "activations kept for backward"),
    _recompute("selective", "attention re-run in backward (jobs/parallel/apply.py apply_recompute)"),
    _recompute("full", "whole blocks re-run in backward (jobs/parallel/apply.py apply_recompute)"),
    Capability("fp8", "fp8", "precision", True,
               "FP8 GEMMs by the models/fp8 converter, applied before parallelization (jobs/loop.py)",
               "set precision: bf16", lambda _, precision: precision == "fp8", lambda _: "fp8",
               MappingProxyType({"precision": "fp8"})),
    Capability("fp8.activations", "acts:fp8", "plan.activation_dtype", False,
               "the FP8 GEMMs save their BF16 inputs for backward (models/fp8/functional.py); caching them in FP8 "
               "is not implemented",
               "set activation_dtype: bf16 (leave out --fp8-activations)", lambda p, _: p.activation_dtype == "fp8",
               _attr("activation_dtype"), MappingProxyType({"precision": "fp8", "activation_dtype": "fp8"}),
               lambda s: replace(s, activation_dtypes=tuple(d for d in s.activation_dtypes if d != "fp8"))),
    Capability("adam.bf16", "adam:bf16", "plan.optimizer_dtype", False,
               "the optimizer is torch.optim.AdamW with FP32 moments (jobs/optim.py); BF16 moments are not "
               "implemented",
               "set optimizer_dtype: fp32 (leave out --bf16-moments)", lambda p, _: p.optimizer_dtype == "bf16",
               _attr("optimizer_dtype"), MappingProxyType({"optimizer_dtype": "bf16"}),
               lambda s: replace(s, optimizer_dtypes=tuple(d for d in s.optimizer_dtypes if d != "bf16"))),
    Capability("layer_tp", "layer_tp", "plan.layer_tp", False,
               "jobs/parallel/tensor_parallel.py applies one TP degree to every layer; per-layer TP degrees are "
               "not implemented",
               "leave layer_tp unset", lambda p, _: p.layer_tp is not None and set(p.layer_tp) != {p.tp},
               _attr("layer_tp"), MappingProxyType({"tp": 2, "layer_tp": (1, 2, 2, 2)})),
    Capability("mixed_fleet", "mixed", "plan.replica_accelerators", True,
               "DP replicas of different accelerator types, each fed its replica_microbatches (jobs/data.py, "
               "jobs/loop.py)",
               "leave replica_accelerators unset", lambda p, _: p.replica_accelerators is not None,
               _attr("replica_accelerators"),
               MappingProxyType({"dp": 2, "replica_accelerators": ("H100", "P800"), "replica_microbatches": (12, 4)})),
)

_BY_KIND: dict[str, Capability] = {c.kind: c for c in CAPABILITIES}


def capability(kind: str) -> Capability:
    """The table's row for ``kind`` (``KeyError`` for an unknown kind: a programming error)."""
    return _BY_KIND[kind]


def refusals(plan: ParallelPlan, *, precision: str | None = None) -> tuple[Capability, ...]:
    """The kinds ``plan`` uses that the trainer does not run (table order).

    ``precision`` ("bf16"/"fp8") is the model's GEMM precision; ``None`` skips the kinds that
    depend on it (a worker that only checks its plan).
    """
    out = []
    for cap in CAPABILITIES:
        if cap.runs or (cap.field == "precision" and precision is None):
            continue
        if cap.uses(plan, precision or "bf16"):
            out.append(cap)
    return tuple(out)


def require_runnable(plan: ParallelPlan, *, precision: str | None = None) -> None:
    """Raise :class:`SpecError` (the field, the value, the table's reason and fix) when the
    trainer cannot run ``plan``; the first refused kind in table order is named."""
    refused = refusals(plan, precision=precision)
    if refused:
        cap = refused[0]
        raise SpecError(cap.field, cap.value(plan), cap.reason, cap.fix)


def runs_label(plan: ParallelPlan, *, precision: str | None = None) -> str:
    """``"yes"``, or ``"no:cp>1,vpp>1"`` naming each refused kind (no spaces: a table column)."""
    refused = refusals(plan, precision=precision)
    return "yes" if not refused else "no:" + ",".join(c.name for c in refused)


def runnable_space(space: SearchSpace = SearchSpace()) -> SearchSpace:
    """``space`` without the kinds the trainer does not run: every plan a search of the result
    ranks passes :func:`require_runnable`."""
    for cap in CAPABILITIES:
        if not cap.runs:
            space = cap.drop(space)
    return space
