"""The colocation simulator: same policy object, accounting invariants, baselines behave as named."""

import pytest

from rayfleet.platform.autoscaler.policy import AutoscalerPolicy
from rayfleet.platform.sim import SimConfig, build_simulation
from rayfleet.platform.sim.workload import DemandModel

SMALL = SimConfig(num_accelerators=256, days=1.0, warmup_s=3 * 3600.0, bursts_per_day=4.0, seed=3)


@pytest.fixture(scope="module")
def results():
    out = {}
    for mode in ("shared", "static", "kueue"):
        sim = build_simulation(mode, SMALL)
        out[mode] = (sim, sim.run())
        sim.check_invariants()
    return out


def test_simulator_drives_the_controllers_policy_class(results):
    assert all(type(sim.policy) is AutoscalerPolicy for sim, _ in results.values())


def test_deterministic_for_a_seed(results):
    again = build_simulation("shared", SMALL).run()
    first = results["shared"][1]
    assert again.as_dict() == first.as_dict()


def test_shared_lends_and_beats_the_static_split(results):
    shared, static, kueue = (results[m][1] for m in ("shared", "static", "kueue"))
    assert static.num_lent_handovers == 0 and static.preemptions == 0  # nothing is lent in a static split
    assert shared.num_lent_handovers > 0 and shared.resizes > 0
    assert shared.utilization > static.utilization + 0.03
    assert shared.slo_attainment >= 0.99
    assert shared.training_lost_share <= 0.02


def test_kueue_baseline_preempts_whole_jobs_and_never_resizes(results):
    shared, kueue = results["shared"][1], results["kueue"][1]
    assert kueue.resizes == 0 and kueue.preemptions > shared.preemptions


def test_handover_includes_snapshot_teardown_and_model_load(results):
    shared = results["shared"][1]
    costs = SMALL.costs
    assert shared.handover_lent_p50_s > costs.snapshot_s + costs.teardown_s
    assert shared.handover_lent_p50_s > shared.handover_all_p50_s * 0.9


def test_demand_envelope_peak_to_trough():
    model = DemandModel(peak_replicas=100, peak_to_trough=4.0, bursts_per_day=0)
    values = [model.envelope(h * 600.0) for h in range(144)]
    assert max(values) == pytest.approx(100, rel=1e-3) and min(values) == pytest.approx(25, rel=1e-2)
    with pytest.raises(ValueError, match="peak_to_trough"):
        DemandModel(peak_replicas=1, peak_to_trough=20)


def test_offered_load_sets_the_training_work_offered():
    base = SimConfig(num_accelerators=1024)
    assert base.training_load() == base.training_load_factor  # saturated default
    # 0.4 at peak, 3:1 diurnal -> inference needs 0.4 * (1 + 1/3) / 2 = 26.7% on average
    assert base.mean_inference_share() == pytest.approx(0.2667, abs=1e-3)
    at80 = SimConfig(num_accelerators=1024, offered_load=0.8)
    train_share = 1 - at80.peak_serve_replicas * 8 / 1024
    assert at80.training_load() * train_share + at80.mean_inference_share() == pytest.approx(0.8)
    with pytest.raises(ValueError, match="offered_load"):
        SimConfig(offered_load=3.0).training_load()


def test_only_stepping_training_counts_as_utilized():
    """A job pausing for a restart holds its accelerators without using them: with restarts that
    take an hour, held share stays up while utilization drops (before, both counted the same)."""
    from dataclasses import replace

    cheap = build_simulation("shared", SMALL).run()
    slow = build_simulation("shared", replace(SMALL, costs=replace(SMALL.costs, restart_s=3600.0))).run()
    assert cheap.utilization <= cheap.held_share
    assert slow.held_share - slow.utilization > cheap.held_share - cheap.utilization + 0.01


def test_handover_calibration_round_trips_into_the_cost_model(tmp_path):
    """benchmarks/handover.py's phase p50s become the simulator's handover costs; a bad file is refused."""
    from rayfleet.errors import SpecError
    from rayfleet.platform.sim.costs import CostModel, write_handover_calibration

    path = tmp_path / "handover.json"
    default, source = CostModel.calibrated(path)
    assert default == CostModel() and source.startswith("defaults")
    write_handover_calibration(path, {"stopped": 3.0, "re-formed": 4.0, "placed": 9.5, "serving": 21.0,
                                      "job stepping": 25.0}, baseline_scale_up_s=8.0, source="test run")
    costs, source = CostModel.calibrated(path)
    assert source == "calibrated-local: test run"
    assert (costs.snapshot_s, costs.teardown_s, costs.model_load_median_s, costs.restart_s) == (3.0, 6.5, 11.5, 22.0)
    # the simulator's lent handover is those phases end to end
    assert costs.snapshot_s + costs.teardown_s + costs.model_load_median_s == 21.0
    with pytest.raises(SpecError, match="phases missing"):
        write_handover_calibration(path, {"stopped": 3.0}, baseline_scale_up_s=8.0, source="x")
    path.write_text('{"costs": {"snapshot_s": -1}}')
    with pytest.raises(SpecError, match="snapshot_s"):
        CostModel.calibrated(path)
