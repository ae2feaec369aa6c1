"""What a plan search returns: ranked plans, rejected shapes, and why the job has the size it has."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rayfleet.placement.cost_model import PlanCost
from rayfleet.placement.plan import ParallelPlan

__all__ = ["RankedPlan", "Rejection", "PlanSearchResult", "JobSize"]


@dataclass(frozen=True)
class RankedPlan:
    """One feasible plan with its predicted cost; ``rank`` 1 is the best for the objective."""

    rank: int
    plan: ParallelPlan
    cost: PlanCost

    @property
    def step_time_s(self) -> float:
        return self.cost.step_time_s

    @property
    def peak_memory_gib(self) -> float:
        return self.cost.peak_memory_gib

    @property
    def bottleneck(self) -> str:
        return self.cost.step.bottleneck

    @property
    def num_accelerators(self) -> int:
        return self.plan.world_size

    @property
    def tokens_per_s_per_accelerator(self) -> float:
        return self.cost.tokens_per_s / self.plan.world_size


@dataclass(frozen=True)
class Rejection:
    """A shape that cannot run, and why (the first reason found)."""

    shape: str
    reason: str


@dataclass(frozen=True)
class JobSize:
    """How many accelerators the best plan takes, out of how many, and why.

    Attributes:
        num_accelerators: the best plan's size.
        num_free: free accelerators the search could use (after ``max_accelerators``).
        reason: one sentence a user can act on (which limit decided the size).
        best_tokens_per_s_per_accelerator: the most efficient plan's throughput per accelerator
            (the reference for the scaling-efficiency floor), 0 when not computed.
    """

    num_accelerators: int
    num_free: int
    reason: str
    best_tokens_per_s_per_accelerator: float = 0.0


@dataclass(frozen=True)
class PlanSearchResult:
    """Ranked plans plus an account of the rest.

    Attributes:
        ranked: feasible plans, best first (one per shape ``tp, cp, pp, dp, ep, etp``).
        rejected: infeasible shapes with their reason.
        num_shapes: shapes considered; ``num_pruned`` of them were never fully priced because
            their lower bound could not beat the k-th best or could not meet the efficiency floor.
        job_size: the size decision (``None`` when nothing is feasible).
    """

    ranked: tuple[RankedPlan, ...]
    rejected: tuple[Rejection, ...]
    num_shapes: int
    num_pruned: int
    job_size: JobSize | None = None

    def rejection_summary(self) -> list[tuple[str, int]]:
        """(reason category, count), most common first."""
        return Counter(r.reason.split(":")[0].split(" Fix")[0] for r in self.rejected).most_common()
