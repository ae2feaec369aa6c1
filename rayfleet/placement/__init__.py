"""rayfleet.placement: how to split a model over a fleet, where each rank goes, and how to ask Ray.

SDK entry points (pure unless noted):

- :func:`plan_model` -> ranked feasible plans for a model on a fleet;
- :func:`search` -> the same plus why the other shapes are infeasible;
- :func:`build_layout` -> rank -> (node, accelerator index) for one plan;
- :func:`reserve_layout` (Ray) -> placement groups that hold exactly that layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from rayfleet.placement.cost_model import PlanCost, evaluate_plan
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.fleet_capacity import FleetCapacity, fleet_capacity, fleet_capacity_of, parse_fleet
from rayfleet.placement.layout import Layout, build_layout, rank_groups
from rayfleet.placement.model_spec import ModelSpec, ModelSpecInput, load_model_spec, preset
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.placement.planner import brute_force_plans, search_plans
from rayfleet.placement.search_results import JobSize, PlanSearchResult, RankedPlan
from rayfleet.placement.search_space import JobGoal, SearchSpace
from rayfleet.placement.ray_adapter import (PlacementGroupSpec, PlacementTimeoutError, ReservedLayout,
                                            assigned_slot_index, placement_group_specs, reserve_layout,
                                            serve_replica_options, train_label_selectors)
from rayfleet.platform.topology import AcceleratorSlot, FleetTopology

__all__ = [
    "ModelSpec", "ModelSpecInput", "load_model_spec", "preset", "ParallelPlan", "validate_plan", "CostParams",
    "PlanCost", "evaluate_plan", "FleetCapacity", "fleet_capacity", "fleet_capacity_of", "parse_fleet", "RankedPlan",
    "PlanSearchResult", "SearchSpace", "JobGoal", "JobSize", "search_plans", "brute_force_plans", "plan_model", "search", "Layout",
    "build_layout", "rank_groups", "PlacementGroupSpec", "PlacementTimeoutError", "ReservedLayout",
    "placement_group_specs", "reserve_layout", "serve_replica_options", "train_label_selectors",
    "assigned_slot_index",
]

ModelLike = ModelSpec | ModelSpecInput | Mapping[str, Any] | str | Path
FleetLike = FleetTopology | str


def _model(model: ModelLike) -> ModelSpec:
    return model.to_spec() if isinstance(model, ModelSpecInput) else load_model_spec(model)


def _topology(fleet: FleetLike) -> FleetTopology:
    return parse_fleet(fleet) if isinstance(fleet, str) else fleet


def search(model: ModelLike, fleet: FleetLike, *, top_k: int = 5, held: Iterable[AcceleratorSlot] = (),
           cordoned: Iterable[str] = (), params: CostParams = CostParams(),
           space: SearchSpace = SearchSpace(), goal: JobGoal = JobGoal()) -> PlanSearchResult:
    """Ranked plans for ``model`` on the free part of ``fleet``, with the infeasible shapes' reasons
    and how many accelerators the best plan takes (``goal``: objective and size limits).

    ``model``: a spec, a pydantic input, a mapping, a YAML path or a preset name;
    ``fleet``: a topology or a string like ``"H100:128"`` / ``"H100:64,P800:64"``.
    """
    capacity = fleet_capacity_of(fleet) if isinstance(fleet, str) and not held and not cordoned else \
        fleet_capacity(_topology(fleet), held=held, cordoned=cordoned)
    return search_plans(_model(model), capacity, top_k=top_k, params=params, space=space, goal=goal)


def plan_model(model: ModelLike, fleet: FleetLike, *, top_k: int = 5, held: Iterable[AcceleratorSlot] = (),
               cordoned: Iterable[str] = (), params: CostParams = CostParams(),
               space: SearchSpace = SearchSpace(), goal: JobGoal = JobGoal()) -> list[RankedPlan]:
    """The ``top_k`` best feasible plans, best first (see :func:`search`)."""
    return list(search(model, fleet, top_k=top_k, held=held, cordoned=cordoned, params=params, space=space,
                       goal=goal).ranked)
