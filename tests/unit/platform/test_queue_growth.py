"""The shared autoscaler grows queue-admitted jobs only as their queues allow (no Ray).

Two root queues of 2 H100 each on a fleet of 32 (team-a may not borrow, team-b may borrow 2):
the queues govern 4 H100. A job admitted through team-b may hold at most 4, however idle the
fleet; growth above team-b's quota is borrowing, recorded in the admission book, and reclaimed
like any borrowed accelerator; a job shrunk by a reclaim grows back once the lender idles.
"""

import time

import pytest

from rayfleet.platform.admission import (
    AdmissionRecord, AdmissionRequest, AdmissionState, growth_limits, resized,
)
from rayfleet.platform.autoscaler.policy import (
    AutoscalerConfig, AutoscalerPolicy, AutoscalerState, FleetObservation, GrowTraining, ServeObservation,
    ShrinkTraining, TrainingObservation,
)
from rayfleet.platform.controller import FleetController
from rayfleet.platform.queues import JobClass, QueueTree, parse_queue_file

QUEUES = [{"name": "team-a", "quota": {"H100": 2}, "borrow_limit": {"H100": 0}},
          {"name": "team-b", "quota": {"H100": 2}, "borrow_limit": {"H100": 2}}]
TREE = QueueTree.build(parse_queue_file(QUEUES))
NODES = {f"n{i}": "H100" for i in range(4)}
IDLE = {"n0": 8, "n1": 8, "n2": 8, "n3": 8}
FLEET = 32


def request(job_id, queue, low, high, klass=JobClass.ELASTIC, replica=1):
    return AdmissionRequest(job_id=job_id, name=f"name-{job_id}", queue=queue, accelerator_type="H100",
                            min_size=low, max_size=high, replica_size=replica, job_class=klass)


def admitted(job_id, queue, size, high, *, held=None, klass=JobClass.ELASTIC, state=AdmissionState.ADMITTED):
    return AdmissionRecord(request=request(job_id, queue, 1, high, klass), state=state, submitted_at=0.0,
                           size=size, held=size if held is None else held)


def training(job_id, size, high, *, queue="team-b", node="n0"):
    return TrainingObservation(job_id, queue, "H100", JobClass.ELASTIC, size, 1, high, 1,
                               tuple((node,) for _ in range(size)), admitted_size=size)


def grow_once(policy, jobs, limits, free=IDLE):
    result = policy.decide(AutoscalerState(), FleetObservation(0.0, dict(free), NODES, (), tuple(jobs),
                                                               queue_limits=limits))
    return {d.job_id: d for d in result.decisions if isinstance(d, GrowTraining)}


class IgnoresQueues(AutoscalerPolicy):
    """The broken variant: the policy as it was, blind to the queues' limits."""

    def decide(self, state, obs):
        return super().decide(state, FleetObservation(obs.now_s, obs.free_by_node, obs.node_type, obs.serve,
                                                      obs.training, obs.pending_training_accelerators))


def assert_grows_only_to_allowance(policy):
    limits = growth_limits(TREE, [admitted("b1", "team-b", 2, 8)])
    grown = grow_once(policy, [training("name-b1", 2, 8)], limits)
    assert grown["name-b1"].new_size == 4  # 2 quota + 2 borrow limit, not the 8 it asks for
    assert "its queue team-b allows it up to 4" in grown["name-b1"].reason


def test_growth_limits_worked_example():
    """The docstring's example: team-b's job at 2 may reach 4 (team-b's ceiling, the roots' 4)."""
    limits = growth_limits(TREE, [admitted("b1", "team-b", 2, 8)])
    assert limits.job_to_ceiling == {"name-b1": 4}
    assert limits.job_to_granted == {"name-b1": 2}
    assert limits.limit_to_room == {"H100 in queue team-b": 2, "H100 of the roots' quota": 2}
    # team-a idles but may not borrow: a job there stays at its quota
    assert growth_limits(TREE, [admitted("a1", "team-a", 1, 8)]).job_to_ceiling == {"name-a1": 2}


def test_policy_grows_a_queue_admitted_job_only_to_its_queues_allowance():
    policy = AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0))
    assert_grows_only_to_allowance(policy)
    with pytest.raises(AssertionError):  # a policy that ignores the limits grows it to 8
        assert_grows_only_to_allowance(IgnoresQueues(AutoscalerConfig(job_resize_cooldown_s=0)))
    # a job outside the queues grows as before, beside the governed one
    limits = growth_limits(TREE, [admitted("b1", "team-b", 2, 8)])
    grown = grow_once(policy, [training("name-b1", 2, 8), training("free", 2, 8, queue="default", node="n1")], limits)
    assert (grown["name-b1"].new_size, grown["free"].new_size) == (4, 8)


def test_jobs_of_one_queue_share_its_room_within_a_step():
    records = [admitted("b1", "team-b", 1, 8), admitted("b2", "team-b", 1, 8)]
    limits = growth_limits(TREE, records)
    assert limits.job_to_ceiling == {"name-b1": 3, "name-b2": 3}  # each alone could take team-b's 2
    grown = grow_once(AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0)),
                      [training("name-b1", 1, 8), training("name-b2", 1, 8, node="n1")], limits)
    sizes = {job: grown[job].new_size if job in grown else 1 for job in ("name-b1", "name-b2")}
    assert sizes == {"name-b1": 3, "name-b2": 1}  # together team-b holds 4, no more (each to 3 would be 6)


def test_waiting_jobs_and_promised_accelerators_are_left_to_admission():
    # b2 was preempted whole by a reclaim and waits in its queue: only admission starts it again
    waiting = growth_limits(TREE, [admitted("b2", "team-b", 0, 8, state=AdmissionState.QUEUED)])
    assert waiting.job_to_ceiling == {"name-b2": 0}
    policy = AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0))
    assert not grow_once(policy, [training("name-b2", 0, 8)], waiting)
    # a1 was admitted at 2 and does not hold them yet: the 2 idle accelerators are a1's
    promised = growth_limits(TREE, [admitted("a1", "team-a", 2, 2, held=0, klass=JobClass.GUARANTEED)])
    assert promised.promised == {"H100": 2}
    two_idle = {"n0": 0, "n1": 2, "n2": 0, "n3": 0}
    assert not grow_once(policy, [training("free", 2, 8, queue="default")], promised, free=two_idle)
    assert grow_once(policy, [training("free", 2, 8, queue="default")], growth_limits(TREE, []), free=two_idle)


def test_resized_record_recomputes_borrowing():
    records = [admitted("b1", "team-b", 2, 8)]
    grown = resized(TREE, records, job_id="b1", new_size=4, reason="idle")
    assert (grown.size, grown.borrowed) == (4, 2) and grown.reason.startswith("resized 2->4 by the autoscaler")
    assert resized(TREE, [grown], job_id="b1", new_size=1, reason="lent").borrowed == 0


@pytest.fixture
def controller(tmp_path):
    ctl = FleetController(str(tmp_path / "state.sqlite"), reconcile_s=3600.0)
    ctl.admission.ray_idle = lambda: {"H100": FLEET - sum(r["held"] for r in ctl.admissions())}
    ctl.autoscaler.free_accelerators = lambda: (dict(IDLE), dict(NODES))  # idle nodes: only the limits bind
    ctl.autoscaler.configure({"job_resize_cooldown_s": 0})
    ctl.apply_queues(QUEUES)
    yield ctl
    ctl._stop.set()


def record(controller, job_id):
    return controller.admission_status(job_id)["record"]


def hold(controller, job_id, size):
    """The job's formation holds ``size`` (its driver's heartbeat) and its shell reports it."""
    controller.admission_heartbeat(job_id, size)
    controller.report_training(training(f"name-{job_id}", size, 8))


def test_a_job_shrunk_by_reclaim_grows_back_to_its_allowance_and_the_book_follows(controller):
    controller.request_admission(request("b1", "team-b", 1, 8).to_json())
    assert (record(controller, "b1")["size"], record(controller, "b1")["borrowed"]) == (4, 2)
    hold(controller, "b1", 4)
    # team-a, inside its quota, reclaims the 2 that b1 borrowed
    controller.request_admission(request("a1", "team-a", 2, 2, JobClass.GUARANTEED, replica=2).to_json())
    [shrink] = [e.decision for e in controller.take_decisions("name-b1")]
    assert isinstance(shrink, ShrinkTraining) and shrink.new_size == 2
    hold(controller, "b1", 2)
    controller.admission_heartbeat("a1", 2)
    # the fleet has 28 idle accelerators, but the queues' 4 are held: b1 does not grow back
    assert not [d for d in controller.autoscaler_step(time.time()) if isinstance(d, GrowTraining)]
    # team-a idles: b1 grows back into what team-b may borrow, and stops there (it asks for 8)
    controller.release_admission("a1")
    [grow] = [d for d in controller.autoscaler_step(time.time()) if isinstance(d, GrowTraining)]
    assert (grow.job_id, grow.new_size) == ("name-b1", 4)
    assert [type(e.decision) for e in controller.take_decisions("name-b1")] == [GrowTraining]
    b1 = record(controller, "b1")
    assert (b1["size"], b1["borrowed"]) == (4, 2)  # the book follows the resize: the growth is borrowed
    assert any(e.kind == "queue_resized" and e.cause.startswith("2->4, borrowing 2") for e in controller.events(50))
    hold(controller, "b1", 4)
    assert not [d for d in controller.autoscaler_step(time.time()) if isinstance(d, GrowTraining)]
    # so team-a reclaims it again, from the size the book now records
    controller.request_admission(request("a2", "team-a", 2, 2, JobClass.GUARANTEED, replica=2).to_json())
    [again] = [e.decision for e in controller.take_decisions("name-b1")]
    assert isinstance(again, ShrinkTraining) and again.new_size == 2
    assert record(controller, "a2")["waiting_for"] == ["b1"]


def test_the_book_follows_a_shrink_for_serve_and_ignores_jobs_outside_the_queues(controller):
    controller.request_admission(request("b1", "team-b", 1, 8).to_json())
    hold(controller, "b1", 4)
    controller.autoscaler.act(ShrinkTraining("name-b1", 3, (3,), {"n0": 1}, "lend to Serve"))
    assert (record(controller, "b1")["size"], record(controller, "b1")["borrowed"]) == (3, 1)
    assert not controller.admission.resized("not-in-a-queue", 6, "idle")
    controller.autoscaler.act(GrowTraining("not-in-a-queue", 6, ("n1",), "idle"))  # no record: nothing to follow
    assert [r["request"]["job_id"] for r in controller.admissions()] == ["b1"]


def test_admission_leaves_the_accelerator_a_serve_replica_is_on_its_way_to(controller):
    """A job shrunk to lend to Serve holds less and its record says so, but the replica does not
    hold the lent accelerator yet: admission must not hand it to a waiting job meanwhile."""
    controller.admission.ray_idle = controller._idle_by_type  # the controller's own count, not the fixture's
    controller.autoscaler.free_accelerators = lambda: ({"n0": 1, "n1": 0}, {"n0": "H100", "n1": "H100"})
    controller.report_serve(ServeObservation("chat", "H100", 1, 1, 2, pending_replicas=1, replica_nodes=("n1", "n0"),
                                             unplaced_nodes=("n0",)))
    controller.request_admission(request("a1", "team-a", 1, 1, JobClass.GUARANTEED).to_json())
    a1 = record(controller, "a1")
    assert a1["state"] == "QUEUED" and "0 idle" in a1["reason"]
    controller.report_serve(None, "chat")  # without the replica on its way the accelerator is idle
    controller.admission.step()
    assert record(controller, "a1")["state"] == "ADMITTED"
