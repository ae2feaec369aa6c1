"""The cost model against published H100 training runs (calibration/published_runs.yaml)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.calibration import (PUBLISHED_RUNS_PATH, explain_gap, fit_efficiency, load_published_runs,
                                            predict_run, rank_published_plan)
from rayfleet.placement.cost_params import CostParams

RUNS = load_published_runs()
# Cases where the planner's top prediction beats the published plan by more than 5% and the
# published shape is not in its top 3, each searched under the runtime options its run had
# (dispatcher, EP/TP overlap; benchmarks/placement.py --calibration prints them all;
# docs/planner-calibration.md has the analysis). Each is a known modelling gap; the test below
# fails when one closes, so the list stays true:
# - Qwen3-235B (+48%): the model prefers EP8 inside a server (NVLink all-to-all, hidden by the
#   EP overlap) over the published EP32 with a per-copy all-to-all across 4 servers (its
#   combines are longer than the attention steps they are paired with: ~6 s exposed). Measured
#   H100 runs of the same model (Megatron-MoE-ModelZoo, BF16, another code branch) put intra-
#   node EP8 pipelines slower than cross-node EP32; no all-to-all term explains that. Term by
#   term (`--calibration --breakdown`) the whole gap is the all-to-all, each side of which agrees
#   with outside measurements; per-local-expert costs and EP-narrow plans' memory are the open
#   suspects (docs/planner-calibration.md, the latest round).
# DeepSeek-V3 closed when the EP overlap paired each all-to-all with the compute piece Megatron's
# combined 1F1B step runs it beside (test_cost_model.py); Qwen3-30B when the FP32 main-grad
# accumulation of local experts was priced (test_wgrad_accumulation.py).
KNOWN_RANKING_GAPS: frozenset[str] = frozenset({"mbridge-qwen3-235b-a22b-h100"})


def test_table_has_the_required_runs_and_sources() -> None:
    ids = {r.id for r in RUNS}
    assert {"mbridge-llama3-8b-h100", "mbridge-llama3-70b-h100"} <= ids
    assert sum(r.model.is_moe for r in RUNS) >= 3 and sum(not r.fit for r in RUNS) >= 1
    assert all(r.source and r.tokens_per_s_per_gpu > 0 for r in RUNS)
    by_id = {r.id: r for r in RUNS}
    assert by_id["mbridge-llama3-8b-h100"].step_time_s == pytest.approx(9.31, abs=0.01)
    assert by_id["mbridge-llama3-70b-h100"].step_time_s == pytest.approx(10.1, abs=0.05)


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_predicted_throughput_within_15_percent(run) -> None:
    prediction = predict_run(run)
    assert abs(prediction.error) <= 0.15, (run.id, prediction.tokens_per_s_per_gpu, run.tokens_per_s_per_gpu)


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_published_plan_ranks_where_experts_put_it(run) -> None:
    ranking = rank_published_plan(run)
    holds = (ranking.rank is not None and ranking.rank <= 3) or ranking.gap_to_top <= 0.05
    assert holds == (run.id not in KNOWN_RANKING_GAPS), (run.id, ranking.rank, ranking.gap_to_top,
                                                           ranking.top_plan.describe())


def test_gap_breakdown_prices_both_plans_term_by_term() -> None:
    run = next(r for r in RUNS if r.id == "mbridge-qwen3-235b-a22b-h100")
    gap = explain_gap(run)
    ranking = rank_published_plan(run)
    assert gap.published.step_time_s == pytest.approx(ranking.published_step_s)
    assert gap.top.step_time_s == pytest.approx(ranking.top_step_s)
    assert sum(t[1] for t in gap.terms()) == pytest.approx(gap.published.step_time_s)
    assert sum(t[2] for t in gap.terms()) == pytest.approx(gap.top.step_time_s)
    # the finding docs/planner-calibration.md analyses: the top keeps 4x the experts per GPU
    # (EP8 inside a server) and wins only on the EP all-to-all, paying more compute
    assert gap.largest_difference == "ep_comm"
    assert run.model.num_experts // gap.top.plan.ep == 4 * (run.model.num_experts // gap.published.plan.ep)
    assert gap.top.step.compute > gap.published.step.compute


def test_fit_recovers_a_perturbed_constant() -> None:
    run = next(r for r in RUNS if r.id == "mbridge-llama3-8b-h100")
    wrong = replace(CostParams(), gemm_efficiency=0.3)
    assert predict_run(run, wrong).error < -0.3
    fitted = fit_efficiency([run], wrong, fields=["gemm_efficiency"], rounds=1)
    assert abs(predict_run(run, fitted).error) < 0.03


def test_bad_table_rows_name_the_field(tmp_path) -> None:
    bad = tmp_path / "runs.yaml"
    bad.write_text(PUBLISHED_RUNS_PATH.read_text().replace("num_gpus: 8,", "num_gpus: 12,", 1))
    with pytest.raises(SpecError, match=r"runs\[0\] \(mbridge-llama3-8b-h100\)\.plan"):
        load_published_runs(bad)
