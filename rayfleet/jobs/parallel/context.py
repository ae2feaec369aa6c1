"""``ParallelContext``: this rank's coordinates, device meshes and process groups for a plan.

Design decisions:
- Two meshes over the same ranks, as in Megatron-Core's "MoE parallel folding": the attention
  grid ``(pp, dp, cp, tp)`` and the expert grid ``(pp, edp, ep, etp)``. Both follow
  :meth:`ParallelPlan.coords` (tp innermost, then cp, dp, pp; etp, ep, edp inside a stage), so
  the ranks the planner placed together (TP inside a node, EP inside the fast domain) are the
  ranks that talk here. Every rank builds both meshes in the same order (``new_group`` is a
  collective over the world).
- Only the kinds the trainer implements are accepted, as the capability table
  (``placement/capabilities.py``) lists them (context parallelism, expert-tensor parallelism,
  interleaved and DualPipeV pipelines run): a plan asking for more fails here with the field and the fix, not with
  a wrong result later. The job's spec and ``resolve_plan`` read the same table first.
- ``moe_token_split``: when TP > 1 and the experts are split (EP > 1 or ETP > 1), the TP peers of
  a rank hold the same tokens; they each route and dispatch a disjoint 1/tp slice (Megatron's
  sequence split before dispatch), so no token reaches an expert twice and every rank of a stage
  holds distinct tokens, which the ETP all-gather relies on. The MoE layer's replicated
  parameters (router, shared experts) then hold partial gradients on each TP peer, summed in
  ``finalize_gradients``.
- ``experts_apart``: EP > 1 or ETP > 1. Either way each rank holds a part of the routed experts
  that has seen the tokens of its whole EP x ETP group, so the experts leave DP's FSDP and are
  reduced over EDP instead (``apply``, ``collectives``).
- Context parallelism (``cp``): the CP ranks of a DP replica hold the same samples, each its
  load-balanced share of every sequence (``context_parallel``). For parameter gradients they
  are extra data-parallel ranks: FSDP2 stays over ``dp`` (``grad_divide_factor`` is still
  ``dp``) and ``finalize_gradients`` sums the replicated gradients over ``cp``; the experts'
  EDP group already spans the CP ranks (the expert grid folds over ``tp * cp * dp``).
- The a2a statistics (``A2AStats``) live on the context: the dispatchers of every MoE layer add
  to them, and the loop reads the step's hidden fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rayfleet.errors import SpecError
from rayfleet.placement.capabilities import require_runnable
from rayfleet.placement.plan import ParallelPlan

__all__ = ["A2AStats", "ParallelContext", "build_parallel_context"]


@dataclass
class A2AStats:
    """Expert all-to-all time of the current step, in seconds (reset by the loop every step).

    Per exchange the dispatcher records three instants on this rank's clock: *issued* (the
    collective was started), *completed* (the transfer actually finished: a callback on the
    work's future stamps it, on the thread that completes it) and *waited* (the training thread
    asked for the result). ``transfer_s`` sums ``completed - issued``; ``exposed_s`` sums the
    part the thread spent blocked, ``max(0, completed - waited)``. A blocking exchange waits at
    once, so it is all exposed. The hidden fraction is ``1 - exposed / transfer``.

    Why completion and not the moment the wait returns: compute run between a finished
    transfer and its wait is not communication; counting issue -> wait as transfer time (the
    earlier measure, kept as ``issued_to_wait_s`` for comparison) made every late wait look
    like hidden communication and overstated the fraction.
    """

    transfer_s: float = 0.0
    exposed_s: float = 0.0
    issued_to_wait_s: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.transfer_s = self.exposed_s = self.issued_to_wait_s = 0.0
        self.calls = 0

    def record(self, *, issued: float, completed: float, waited: float) -> None:
        completed = max(completed, issued)
        self.transfer_s += completed - issued
        self.exposed_s += max(0.0, completed - max(waited, issued))
        self.issued_to_wait_s += max(completed, waited) - issued
        self.calls += 1

    def hidden_fraction(self) -> float | None:
        if self.calls == 0 or self.transfer_s <= 0:
            return None
        return max(0.0, min(1.0, 1.0 - self.exposed_s / self.transfer_s))

    def hidden_fraction_issue_to_wait(self) -> float | None:
        """The earlier, overstated measure (issue -> wait as transfer time); for tests and benchmarks."""
        if self.calls == 0 or self.issued_to_wait_s <= 0:
            return None
        return max(0.0, min(1.0, 1.0 - self.exposed_s / self.issued_to_wait_s))


@dataclass
class ParallelContext:
    """What a rank needs to know about the parallel layout. Built by ``build_parallel_context``."""

    plan: ParallelPlan
    device: torch.device
    rank: int
    world_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    edp_rank: int
    mesh: DeviceMesh  # (pp, dp, cp, tp)
    expert_mesh: DeviceMesh  # (pp, edp, ep, etp)
    stage_group: dist.ProcessGroup | None  # all ranks of this pipeline stage (tp*cp*dp)
    a2a_overlap: bool = False
    fp8_dispatch: bool = False
    misroute_experts: bool = False  # BROKEN ON PURPOSE: the mis-routed EP control of the tests
    cp_rank: int = 0
    cp_control: str = "none"  # "none", or a BROKEN ON PURPOSE CP variant (context_parallel.CPControl)
    cp_exchange: str = "all_gather"  # or "ring" (context_parallel_ring)
    a2a: A2AStats = field(default_factory=A2AStats)
    pipeline: Any = None  # the PipelineRunner when plan.pp > 1 (set by parallelize_model)
    # replicated params with per-TP-peer partial gradients (set by parallelize_model; see tensor_parallel)
    tp_partial_grads: frozenset[str] = frozenset()
    expert_ckpt_mesh: DeviceMesh | None = None  # (ep, edp[, etp]) of this stage: experts' global layout
    etp_rank: int = 0
    etp_control: str = "none"  # "none", or the BROKEN ON PURPOSE "no_reduce" (expert_tensor_parallel)

    @property
    def tp_size(self) -> int:
        return self.plan.tp

    @property
    def dp_size(self) -> int:
        return self.plan.dp

    @property
    def ep_size(self) -> int:
        return self.plan.ep

    @property
    def cp_size(self) -> int:
        return self.plan.cp

    @property
    def etp_size(self) -> int:
        return self.plan.etp

    @property
    def edp_size(self) -> int:
        return self.plan.edp

    @property
    def experts_apart(self) -> bool:
        """Whether each rank holds only part of the routed experts (EP > 1 or ETP > 1)."""
        return self.plan.ep > 1 or self.plan.etp > 1

    @property
    def grad_divide_factor(self) -> int:
        return self.plan.dp

    @property
    def moe_token_split(self) -> bool:
        return self.plan.tp > 1 and self.experts_apart

    def group(self, name: str) -> dist.ProcessGroup:
        """Process group of one mesh dimension: ``tp``, ``dp``, ``pp``, ``cp`` or ``ep``, ``edp``, ``etp``."""
        if name in ("tp", "dp", "pp", "cp"):
            return self.mesh.get_group(name)
        return self.expert_mesh.get_group(name)

    def submesh(self, name: str) -> DeviceMesh:
        return (self.mesh if name in ("tp", "dp", "pp", "cp") else self.expert_mesh)[name]

    def a2a_hidden_fraction(self) -> float | None:
        return self.a2a.hidden_fraction()


def _check_supported(plan: ParallelPlan, world_size: int) -> None:
    if plan.world_size != world_size:
        raise SpecError("plan", plan.describe(), f"needs {plan.world_size} workers but the job has {world_size}",
                        "set resources.num_workers to tp*cp*dp*pp, or leave plan: auto")
    require_runnable(plan)


def build_parallel_context(plan: ParallelPlan, *, device: torch.device, a2a_overlap: bool = False,
                           fp8_dispatch: bool = False, misroute_experts: bool = False,
                           cp_control: str = "none", cp_exchange: str = "all_gather",
                           etp_control: str = "none") -> ParallelContext:
    """Collective over the default group: build both meshes and this rank's context."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    _check_supported(plan, world_size)
    device = torch.device(device)
    ranks = torch.arange(world_size)
    # coords(): rank = tp + tp*(cp + cp*(dp + dp*pp)), so a row-major reshape (pp, dp, cp, tp).
    mesh = DeviceMesh(device.type, ranks.reshape(plan.pp, plan.dp, plan.cp, plan.tp),
                      mesh_dim_names=("pp", "dp", "cp", "tp"))
    expert_mesh = DeviceMesh(device.type, ranks.reshape(plan.pp, plan.edp, plan.ep, plan.etp),
                             mesh_dim_names=("pp", "edp", "ep", "etp"))
    # The checkpoint layout of routed experts: rows [E, ...] split over EP first, then over EDP
    # (FSDP), hidden units over ETP, i.e. a (ep, edp, etp) mesh. DCP needs it to save every rank's
    # experts under one global tensor and to reshard them when the next run has another EP/EDP/ETP.
    ckpt_mesh = None
    if plan.etp > 1:
        grid = ranks.reshape(plan.pp, plan.edp, plan.ep, plan.etp).permute(0, 2, 1, 3).contiguous()
        ckpt_mesh = DeviceMesh(device.type, grid, mesh_dim_names=("pp", "ep", "edp", "etp"))["ep", "edp", "etp"]
    elif plan.ep > 1:  # the (ep, edp) mesh that EP-only checkpoints have always used
        grid = ranks.reshape(plan.pp, plan.edp, plan.ep, plan.etp)[..., 0].permute(0, 2, 1).contiguous()
        ckpt_mesh = DeviceMesh(device.type, grid, mesh_dim_names=("pp", "ep", "edp"))["ep", "edp"]
    stage = plan.tp * plan.cp * plan.dp
    stage_group = None
    for pp_i in range(plan.pp):  # new_group is collective: every rank creates every stage group
        group = dist.new_group(list(range(pp_i * stage, (pp_i + 1) * stage)))
        if rank // stage == pp_i:
            stage_group = group
    c = plan.coords(rank)
    return ParallelContext(plan=plan, device=device, rank=rank, world_size=world_size, tp_rank=c.tp,
                           dp_rank=c.dp, pp_rank=c.pp, ep_rank=c.ep, edp_rank=c.edp, mesh=mesh,
                           expert_mesh=expert_mesh, stage_group=stage_group, a2a_overlap=a2a_overlap,
                           fp8_dispatch=fp8_dispatch, misroute_experts=misroute_experts,
                           expert_ckpt_mesh=ckpt_mesh, cp_rank=c.cp, cp_control=cp_control,
                           cp_exchange=cp_exchange, etp_rank=c.etp, etp_control=etp_control)
