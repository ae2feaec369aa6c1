"""The controller-side loop around the policy, with gather/act/record passed in (no Ray)."""

from rayfleet.platform.autoscaler.loop import AutoscalerLoop
from rayfleet.platform.autoscaler.policy import AutoscalerPolicy
from rayfleet.platform.autoscaler.types import (
    FleetObservation, ServeObservation, TrainingObservation, decision_detail,
)
from rayfleet.platform.queues import JobClass


def observation(now):
    serve = ServeObservation("chat", "H100", 8, running_replicas=1, desired_replicas=2, replica_nodes=("n0",),
                             ttft_p95_s=0.9, ttft_slo_s=1.0)
    job = TrainingObservation("job-1", "research", "H100", JobClass.ELASTIC, 16, 8, 16, 4,
                              (("n1",), ("n1",), ("n2",), ("n2",)), last_snapshot_at_s=now - 30)
    return FleetObservation(now, {"n0": 0, "n1": 0, "n2": 0}, {n: "H100" for n in ("n0", "n1", "n2")}, (serve,), (job,))


def test_loop_records_every_decision_with_its_reason_and_survives_a_failing_actuator():
    events, acted = [], []

    def act(decision):
        if type(decision).__name__ == "ScaleServe":
            raise RuntimeError("serve down")
        acted.append(decision)

    loop = AutoscalerLoop(AutoscalerPolicy(), gather=observation, act=act,
                          record=lambda *e: events.append(e))
    decisions = loop.step(100.0)
    kinds = [e[1] for e in events]
    assert "autoscaler_ShrinkTraining" in kinds and "autoscaler_ScaleServe_failed" in kinds
    shrink = next(e for e in events if e[1] == "autoscaler_ShrinkTraining")
    assert shrink[0] == "job-1" and "flash snapshot" in shrink[2] and shrink[3]["new_size"] == 8
    assert len(acted) == 1 and len(decisions) == 2
    assert loop.state.lent == {"job-1": 8}


def test_decision_detail_is_json_able():
    import json

    loop = AutoscalerLoop(AutoscalerPolicy(), gather=observation, act=lambda d: None, record=lambda *e: None)
    for decision in loop.step(0.0):
        json.dumps(decision_detail(decision))
