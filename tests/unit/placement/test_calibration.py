"""The cost model against published H100 training runs (calibration/published_runs.yaml)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.calibration import (CORE_FITTED_FIELDS, PHYSICAL_PRIORS, PRE_CALIBRATION, PUBLISHED_RUNS_PATH,
                                            cold_leave_one_out, explain_gap, fit_efficiency, load_published_runs,
                                            predict_run, rank_published_plan)
from rayfleet.placement.cost_params import CostParams

RUNS = load_published_runs()
# Cases where the planner's top prediction beats the published plan by more than 5% and the
# published shape is not in its top 3, each searched under the runtime options its run had
# (dispatcher, EP/TP overlap; benchmarks/placement.py --calibration prints them all;
# docs/planner-calibration.md has the analysis). Each is a known modelling gap; the test below
# fails when one closes, so the list stays true:
# - Llama-3 8B (+5.6%) and 70B (both containers, +5.6%): since hidden collectives slow the compute
#   beside them (CostParams.collective_overlap_slowdown, measured 0.19), the 8B's FSDP DP8 on
#   NVLink pays for the gathers it hides and TP2 DP4 ZeRO-1 edges ahead; the 70B's top is TP8 PP4
#   VP20 ZeRO-1 (it was the TP8 DP8 ZeRO-3 shape nobody published, +10.3%).
# - Every Qwen3-235B row: the tops are now ZeRO-1 pipelines with EP8/EP16 (TP2 PP8 VP6), no
#   longer fully recomputed ZeRO-3 shapes; the intra-node all-to-all is what they save.
# - Qwen3-235B (+34%): the published EP32 with a per-copy all-to-all across 4 servers pays its
#   combines in full; every ModelZoo row shares the gap (the TP4 EP8 row most, +40%).
# Llama-3.1 405B ranks 2nd; Qwen3-30B-A3B (both containers) 1st; DeepSeek-V3 within 2.8% of the
# top (TP4 PP1 DP256 EP64 ZeRO-3) once its MTP module is priced on the last stage: every device
# of a PP1 plan runs it, the published PP8's balanced split gives the last stage fewer layers.
KNOWN_RANKING_GAPS: frozenset[str] = frozenset({
    "mbridge-llama3-8b-h100", "mbridge-llama3-70b-h100", "mbridge-llama3-70b-h100-25.11",
    "mbridge-qwen3-235b-a22b-h100", "mbridge-qwen3-235b-a22b-h100-25.09", "modelzoo-qwen3-235b-ep32-deepep-h100",
    "modelzoo-qwen3-235b-ep32-deepep-overlap-h100", "modelzoo-qwen3-235b-fsdp-ep8-h100",
    "modelzoo-qwen3-235b-tp4-ep8-deepep-h100"})
# Held-out rows the fitted model mispredicts by more than 15% (issue 27 asked for them to be
# added, not fitted away): the 25.09 token-drop Qwen3-235B run is 24% slower than the 25.11 run
# of the same plan the fit uses; one prediction cannot be within 13.4% of both (+26% in sample).
# The 25.11 Qwen3-30B-A3B run (dropless, forced balance) measured 5,275 tokens/s per GPU where
# the 25.09 token-drop run of the same plan the fit uses measured 10,494 (+109%): routing cannot
# explain it (forced balance waits ~1% on its busiest rank, token drop padded to capacity none;
# the Qwen3-235B pair of the same two containers moves the other way, 1,204 -> 1,575), and no
# other term of the model halves a plan's throughput between containers.
# The ModelZoo FSDP EP8 row (BF16, full recompute, -16.0%) went over when full recompute began to
# pay its rerun forward's EP all-to-all and TP pair (test_recompute_collectives.py): the physics
# is the framework's, and the row was already the model's slowest BF16 prediction (-10.8%); every
# BF16 row of that page but TP4 EP8 is priced slow, which points at one GEMM efficiency for FP8
# and BF16, not at the rerun.
KNOWN_PREDICTION_MISSES: frozenset[str] = frozenset({"mbridge-qwen3-235b-a22b-h100-25.09",
                                                     "mbridge-qwen3-30b-a3b-h100-25.11",
                                                     "modelzoo-qwen3-235b-fsdp-ep8-h100"})


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
    assert run.fit <= (run.id not in KNOWN_PREDICTION_MISSES)  # a fit row may not miss
    assert (abs(prediction.error) <= 0.15) == (run.id not in KNOWN_PREDICTION_MISSES), (
        run.id, prediction.tokens_per_s_per_gpu, run.tokens_per_s_per_gpu)


def test_rows_are_faithful_to_their_sources() -> None:
    """Every MoE row states its routing; where two tables disagree on one plan both numbers stay
    (never only the higher); at least 8 MoE rows from at least two public sources."""
    moe = [r for r in RUNS if r.model.is_moe]
    assert all(r.routing in ("forced_balance", "token_drop", "dropless") for r in moe)
    assert all(r.routing == "n/a" for r in RUNS if not r.model.is_moe)
    assert len(moe) >= 8 and len({r.source.split(" ")[0] for r in moe}) >= 2
    by_id = {r.id: r for r in RUNS}
    assert by_id["mbridge-qwen3-30b-a3b-h100"].routing == "token_drop"
    # the two Qwen3-30B-A3B tables: the same plan, token-drop (25.09) and dropless (25.11)
    thirty = [by_id["mbridge-qwen3-30b-a3b-h100"], by_id["mbridge-qwen3-30b-a3b-h100-25.11"]]
    assert thirty[0].plan == thirty[1].plan and [r.tokens_per_s_per_gpu for r in thirty] == [10494, 5275]
    assert [r.routing for r in thirty] == ["token_drop", "forced_balance"] and [r.fit for r in thirty] == [True, False]
    # the ModelZoo 4K table does not state its routing; the recipe's H100 run script forces balance
    zoo = [r for r in moe if r.id.startswith("modelzoo-")]
    assert zoo and all(r.routing == "forced_balance" and "--moe-router-force-load-balancing" in r.source for r in zoo)
    both = [by_id["mbridge-qwen3-235b-a22b-h100"], by_id["mbridge-qwen3-235b-a22b-h100-25.09"]]
    assert [r.plan for r in both][0] == both[1].plan and {r.tokens_per_s_per_gpu for r in both} == {1575, 1204}
    assert sum(r.fit for r in both) == 1


def test_routing_label_is_checked(tmp_path) -> None:
    text = PUBLISHED_RUNS_PATH.read_text().replace("routing: token_drop", "routing: n/a", 1)
    (tmp_path / "runs.yaml").write_text(text)
    with pytest.raises(SpecError, match="routing"):
        load_published_runs(tmp_path / "runs.yaml")


def test_leave_one_out_is_cold_and_blind_to_the_left_out_model() -> None:
    """Regression: leave-one-out started from the all-data optimum, so a coordinate search could
    stop where it began. Each fit now starts from PRE_CALIBRATION and never sees the model left out
    (the 25.11 Llama-3 70B row is predicted without the 25.09 row of the same plan)."""
    dense = [r for r in RUNS if not r.model.is_moe]
    loo = cold_leave_one_out(dense, fields=["gemm_efficiency"], rounds=1)
    for run, out in zip(dense, loo):
        assert run.id == out.run_id and all(by.split("-h100")[0] != run.id.split("-h100")[0] for by in out.fitted_on)
        others = [r for r in dense if r.fit and r.model.name != run.model.name]
        cold = fit_efficiency(others, PRE_CALIBRATION, fields=["gemm_efficiency"], rounds=1)
        assert out.error == pytest.approx(predict_run(run, cold).error)
    assert PRE_CALIBRATION != CostParams() and len(CORE_FITTED_FIELDS) < sum(r.fit for r in RUNS) / 2


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


def test_bf16_runs_are_priced_with_the_measured_bf16_gemm_efficiency() -> None:
    """Regression: one GEMM efficiency, fitted on FP8 training runs (0.55 of the FP8 peak, with
    FP8's cast kernels in it), priced BF16 runs at 0.55 of the BF16 peak and made the ModelZoo
    BF16 rows 22-34% too slow; large BF16 GEMMs reach ~0.72 on H100."""
    run = next(r for r in RUNS if r.id == "modelzoo-qwen3-235b-ep32-deepep-overlap-h100")
    assert run.model.precision == "bf16"
    params = CostParams()
    broken = replace(params, bf16_gemm_efficiency=params.gemm_efficiency)
    assert predict_run(run, broken).error < -0.15 < predict_run(run, params).error
    fp8 = next(r for r in RUNS if r.id == "mbridge-llama3-8b-h100")  # FP8 runs do not see it
    assert predict_run(fp8, replace(params, bf16_gemm_efficiency=0.9)).error == pytest.approx(predict_run(fp8).error)


def test_priors_pull_the_fit_toward_the_measured_value() -> None:
    run = next(r for r in RUNS if r.id == "mbridge-llama3-8b-h100")
    free = fit_efficiency([run], PRE_CALIBRATION, fields=["gemm_efficiency"], rounds=1)
    far = {"gemm_efficiency": 0.8}
    pulled = fit_efficiency([run], PRE_CALIBRATION, fields=["gemm_efficiency"], rounds=1, priors=far)
    assert free.gemm_efficiency < pulled.gemm_efficiency < 0.8
    assert set(PHYSICAL_PRIORS) <= {"gemm_efficiency", "attention_efficiency"}


def test_bad_table_rows_name_the_field(tmp_path) -> None:
    bad = tmp_path / "runs.yaml"
    bad.write_text(PUBLISHED_RUNS_PATH.read_text().replace("num_gpus: 8,", "num_gpus: 12,", 1))
    with pytest.raises(SpecError, match=r"runs\[0\] \(mbridge-llama3-8b-h100\)\.plan"):
        load_published_runs(bad)
