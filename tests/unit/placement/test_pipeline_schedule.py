"""Pipeline seconds of 1F1B, interleaved 1F1B and DualPipeV, with worked examples by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.placement.cost_model import balanced_plan, evaluate_plan
from rayfleet.placement.model_spec import preset
from rayfleet.placement.pipeline_schedule import dualpipe_possible, interleaving_possible, pipeline_seconds
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")


def _old_formula(stage_s: list[float], m: int, vpp: int) -> float:
    """The pricing before the fix: assumed interleaving fills the pipe whatever m is."""
    return m * max(stage_s) + (sum(stage_s) - max(stage_s)) / vpp


def test_worked_example_full_and_starved_pipelines() -> None:
    """pp = 4 stages of t = 1 s (forward+backward of one micro-batch), vpp = 2 chunks of 0.5 s.

    m = 8 (full): 8 * 1 + (4 - 1) * 1 / 2 = 9.5 s; the bubble 1.5 s is Megatron's
        (pp - 1) / (vpp * m) = 3 / 16 of the 8 s of work.
    m = 2 (starved): each micro-batch crosses all 4 stages (4 s); the second trails the first by
        one chunk (0.5 s): 4.5 s. Without virtual stages (m + pp - 1) * t = 5 s.
    m = 1: 4 s = the sum of the stages, whatever vpp is; the old formula said
        1 * 1 + 3 / 2 = 2.5 s (1.6x too fast).
    Uneven stages (1, 2, 1, 1) s, vpp = 1, m = 1: 5 s, the sum.
    """
    even = [1.0, 1.0, 1.0, 1.0]
    assert pipeline_seconds(even, num_microbatches=8, vpp=2) == pytest.approx(9.5)
    assert (9.5 - 8) / 8 == pytest.approx((4 - 1) / (2 * 8))
    assert pipeline_seconds(even, num_microbatches=2, vpp=2) == pytest.approx(4.5)
    assert pipeline_seconds(even, num_microbatches=2, vpp=1) == pytest.approx(5.0)
    assert pipeline_seconds(even, num_microbatches=1, vpp=2) == pytest.approx(4.0)
    assert pipeline_seconds(even, num_microbatches=1, vpp=4) == pytest.approx(4.0)
    assert _old_formula(even, 1, 2) == pytest.approx(2.5)  # the broken variant
    assert pipeline_seconds([1.0, 2.0, 1.0, 1.0], num_microbatches=1) == pytest.approx(5.0)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("vpp", [1, 2, 4])
def test_pipeline_never_beats_the_work_or_one_traversal(m: int, vpp: int) -> None:
    stages = [1.0, 1.5, 0.8, 1.2, 1.0, 0.9]
    t = pipeline_seconds(stages, num_microbatches=m, vpp=vpp)
    assert t >= m * max(stages) - 1e-12 and t >= sum(stages) - 1e-12
    if vpp == 1:  # plain 1F1B: the slowest stage m times plus one pass through the others
        assert t == pytest.approx(m * max(stages) + sum(stages) - max(stages))


def test_dualpipev_worked_example() -> None:
    """pp = 4 ranks; per stage and micro-batch F = 1 s forward, B = 2 s backward of which
    W = 1 s weight gradients, so t = F + B = 3 s; m = 8 >= 2 * pp.

    DualPipeV (README, PP = 2 * pp half-stage chunks): (PP/2 - 1)(F&B + B - 3W) in half-stage
    units = (4 - 1) * (1.5 + 1 - 1.5) = 3 s = (pp - 1) * F. Step = 8 * 3 + 3 = 27 s, against
    1F1B's 8 * 3 + 3 * 3 = 33 s and interleaved VP2's 8 * 3 + 3 * 3 / 2 = 28.5 s.
    """
    kw = dict(stage_backward_s=[2.0] * 4, stage_weight_grad_s=[1.0] * 4)
    assert pipeline_seconds([3.0] * 4, num_microbatches=8, dualpipe=True, **kw) == pytest.approx(27.0)
    assert pipeline_seconds([3.0] * 4, num_microbatches=8) == pytest.approx(33.0)
    assert pipeline_seconds([3.0] * 4, num_microbatches=8, vpp=2) == pytest.approx(28.5)
    assert dualpipe_possible(8, 4) and not dualpipe_possible(7, 4)
    assert interleaving_possible(4, 4) and not interleaving_possible(3, 4) and not interleaving_possible(8, 1)
    # torch's interleaved 1F1B (what the trainer runs) splits m into rounds of pp: 9 over 4 is 2 rounds of 4.5
    assert interleaving_possible(12, 4) and interleaving_possible(6, 4) and not interleaving_possible(9, 4)


def test_pipeline_with_fewer_microbatches_than_stages_takes_every_stage() -> None:
    """Regression: one micro-batch per replica through PP8 VP2 was priced at slowest stage + half
    the others; the step is at least every stage once."""
    model = preset("llama3-70b", global_batch_sequences=16)
    plan = balanced_plan(model, ParallelPlan(tp=4, pp=8, dp=16, vpp=2), H100)
    step = evaluate_plan(model, plan, H100).step
    assert plan.num_microbatches(model.global_batch_sequences) == 1
    pipeline = step.total - step.dp_comm - step.optimizer
    assert pipeline >= sum(step.stage_microbatch_s) * (1 - 1e-9)
    assert pipeline > 1.5 * _old_formula(list(step.stage_microbatch_s), 1, 2)
    full = evaluate_plan(model, replace(plan, dp=1), H100).step  # m = 16 >= pp: interleaving helps
    assert full.pp_bubble < 0.6 * (sum(full.stage_microbatch_s) - max(full.stage_microbatch_s))
