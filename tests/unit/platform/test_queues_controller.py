"""The controller's queue storage and autoscaler hook, driven without Ray.

The controller class is a plain Python class (Ray wraps it in an actor); here it runs in-process
with its reconcile loop parked (a very long ``reconcile_s``), observations passed in through
``gather`` and decisions captured through ``act`` -- the hook the cluster test uses with real
Serve and Train shells.
"""

import pickle

import pytest

from rayfleet.errors import SpecError
from rayfleet.platform.autoscaler.types import (
    FleetObservation, ScaleServe, ServeObservation, ShrinkTraining, TrainingObservation,
)
from rayfleet.platform.controller import FleetController
from rayfleet.platform.queues import JobClass


@pytest.fixture
def controller(tmp_path):
    ctl = FleetController(str(tmp_path / "state.sqlite"), reconcile_s=3600.0)
    yield ctl
    ctl._stop.set()


def test_queue_tree_is_validated_persisted_and_restored(controller, tmp_path):
    controller.create_queue({"name": "root", "quota": {"H100": 16}})
    controller.create_queue({"name": "team", "parent": "root", "quota": {"H100": 8}, "borrow_limit": {"H100": 4}})
    with pytest.raises(SpecError, match="children are guaranteed 24"):
        controller.create_queue({"name": "big", "parent": "root", "quota": {"H100": 16}})
    with pytest.raises(SpecError, match="has child queues"):
        controller.delete_queue("root")
    again = FleetController(controller.state_path, reconcile_s=3600.0)  # a restarted controller
    try:
        assert [q["name"] for q in again.list_queues()] == ["root", "team"]
        assert again.list_queues()[1]["borrow_limit"] == {"H100": 4}
    finally:
        again._stop.set()
    controller.delete_queue("team")
    assert [q["name"] for q in controller.list_queues()] == ["root"]
    kinds = [e.kind for e in controller.events(limit=20)]
    assert kinds.count("queue_created") == 2 and "queue_deleted" in kinds


def test_autoscaler_step_records_decisions_and_fills_the_inbox(controller):
    job = TrainingObservation("job-7", "research", "H100", JobClass.ELASTIC, 16, 8, 16, 8,
                              (("n1",), ("n2",)), last_snapshot_at_s=0.0)
    serve = ServeObservation("chat", "H100", 8, running_replicas=1, desired_replicas=2, replica_nodes=("n0",))
    controller.report_training(job)
    controller.report_serve(serve)

    def gather(now):  # the Ray part (free accelerators per node) passed in; reports from the shells
        return FleetObservation(now, {"n0": 0, "n1": 0, "n2": 0}, {n: "H100" for n in ("n0", "n1", "n2")},
                                tuple(controller.autoscaler.serve.values()), tuple(controller.autoscaler.training.values()))

    decisions = controller.autoscaler_step(10.0, gather=gather, act=controller._carry_out)
    assert [type(d) for d in decisions] == [ScaleServe, ShrinkTraining]
    inbox = controller.take_decisions("job-7")
    # the inbox carries the policy's frozen decision objects (they pickle across the Ray boundary)
    assert len(inbox) == 1 and inbox[0].decision == decisions[1] and inbox[0].decided_at_s > 0
    assert pickle.loads(pickle.dumps(inbox[0])) == inbox[0]
    assert inbox[0].decision.new_size == 8 and controller.take_decisions("job-7") == []
    assert controller.take_decisions("chat")[0].decision.target_replicas == 2
    events = {e.kind: e for e in controller.events(limit=10)}
    assert "flash snapshot" in events["autoscaler_ShrinkTraining"].cause
    assert events["autoscaler_ShrinkTraining"].subject == "job-7"
    assert events["autoscaler_ShrinkTraining"].detail["new_size"] == 8  # the event log keeps a flat copy
    controller.report_training(None, job_id="job-7")
    assert not controller.autoscaler.training


def test_record_event_is_the_one_way_in_for_shell_and_job_events(controller):
    controller.record_event("job:tiny", "node_lost", "node n1 of the layout died", {"workers": 4})
    event = controller.events(limit=1)[0]
    assert (event.subject, event.kind, event.cause, event.detail) == ("job:tiny", "node_lost",
                                                                      "node n1 of the layout died", {"workers": 4})
    # a detail that repeats the event's own field names is kept, not a TypeError in the actor
    # (regression: a health decision's asdict() carries "cause" and the event was lost)
    controller.record_event("job:tiny", "rollback", "loss spike", {"cause": "loss spike", "kind": "x", "step": 7})
    assert controller.events(limit=1)[0].detail == {"cause": "loss spike", "kind": "x", "step": 7}
