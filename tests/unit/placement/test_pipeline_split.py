"""Dynamic pipeline split: optimal against exhaustive enumeration; balances MoE vs dense layers."""

from __future__ import annotations

import itertools
import random

import pytest

from rayfleet.placement.cost_model import balanced_plan, evaluate_plan
from rayfleet.placement.model_spec import preset
from rayfleet.placement.pipeline_split import balance_stages, stage_costs
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.catalogue import get_accelerator


def _best_by_enumeration(costs, pp, speeds):
    best = float("inf")
    for cut in itertools.combinations(range(1, len(costs)), pp - 1):
        starts = (0,) + cut
        best = min(best, max(c / s for c, s in zip(stage_costs(costs, starts), speeds)))
    return best


def test_worked_example() -> None:
    assert balance_stages([3, 1, 1, 1, 1, 3], 2) == (0, 3)
    assert balance_stages([4, 1, 1, 1, 1, 1], 2) == (0, 2)


@pytest.mark.parametrize("seed", range(30))
def test_matches_exhaustive_min_max(seed: int) -> None:
    rng = random.Random(seed)
    num_layers = rng.randint(2, 10)
    pp = rng.randint(1, min(4, num_layers))
    costs = [rng.choice([1.0, 1.0, 2.5, 0.3]) * rng.uniform(0.5, 1.5) for _ in range(num_layers)]
    speeds = [rng.choice([1.0, 2.0]) for _ in range(pp)] if seed % 2 else [1.0] * pp
    starts = balance_stages(costs, pp, stage_speeds=speeds)
    assert len(starts) == pp and starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))
    got = max(c / s for c, s in zip(stage_costs(costs, starts), speeds))
    assert got == pytest.approx(_best_by_enumeration(costs, pp, speeds), rel=1e-9)


def test_faster_stages_get_more_layers() -> None:
    starts = balance_stages([1.0] * 12, 2, stage_speeds=[2.0, 1.0])
    assert starts == (0, 8)


def test_deepseek_split_beats_even_split() -> None:
    """Dense first layers and the embedding/head make an even split slower than the balanced one."""
    model = preset("deepseek-v3", num_layers=16, first_k_dense_layers=3)
    h100 = get_accelerator("H100")
    plan = ParallelPlan(tp=2, pp=4, dp=8, ep=16)
    balanced = evaluate_plan(model, plan, h100)
    even = evaluate_plan(model, ParallelPlan(tp=2, pp=4, dp=8, ep=16, stage_starts=(0, 4, 8, 12)), h100)
    assert balanced.plan.stage_starts != (0, 4, 8, 12)
    assert max(balanced.step.stage_microbatch_s) < max(even.step.stage_microbatch_s)
    assert balanced.step_time_s < even.step_time_s
    assert balanced_plan(model, plan, h100).stage_starts == balanced.plan.stage_starts
