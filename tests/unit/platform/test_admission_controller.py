"""Queue admission in the fleet controller, driven without Ray.

The controller runs in-process with its reconcile loop parked (``reconcile_s`` of an hour); Ray's
idle accelerators are passed in (``admission.ray_idle``) and decisions land in the autoscaler's
inboxes, where the jobs' shells would take them. The scenario is the cluster test's
(tests/cluster/test_queue_admission.py) in milliseconds: two queues of 2 H100 each on a fleet of
32, a third job that waits, borrows when the other queue idles and is shrunk when it reclaims.
"""

import pytest

from rayfleet.errors import SpecError
from rayfleet.platform.admission import (
    AdmissionRecord, AdmissionRequest, AdmissionState, admission_step, governed_free, request_sizes, route,
)
from rayfleet.platform.autoscaler.types import GrowTraining, ShrinkTraining
from rayfleet.platform.controller import FleetController
from rayfleet.platform.queues import JobClass, QueueTree, Workload, parse_queue_file, parse_queue_spec

QUEUES = {"queues": [{"name": "team-a", "quota": {"H100": 2}, "borrow_limit": {"H100": 0}},
                     {"name": "team-b", "quota": {"H100": 2}, "borrow_limit": {"H100": 2}}]}
FLEET = 32


def request(job_id, queue, low, high, klass=JobClass.GUARANTEED, replica=None):
    return AdmissionRequest(job_id=job_id, name=f"name-{job_id}", queue=queue, accelerator_type="H100",
                            min_size=low, max_size=high, replica_size=replica or low, job_class=klass)


class Fleet:
    """The Ray side as the controller sees it: jobs hold what their drivers report."""

    def __init__(self, controller):
        self.controller = controller
        controller.admission.ray_idle = lambda: {"H100": FLEET - self.held()}

    def held(self):
        return sum(r["held"] for r in self.controller.admissions())

    def run(self, job_id):  # the job's formation steps: it holds what it was granted
        size = self.controller.admission_status(job_id)["record"]["size"]
        assert self.controller.admission_heartbeat(job_id, size)

    def state(self, job_id):
        return self.controller.admission_status(job_id)["record"]


@pytest.fixture
def controller(tmp_path):
    ctl = FleetController(str(tmp_path / "state.sqlite"), reconcile_s=3600.0)
    ctl.admission.ray_idle = lambda: {"H100": FLEET}  # no Ray here: the idle fleet is passed in
    ctl.apply_queues(QUEUES["queues"])
    yield ctl
    ctl._stop.set()


def test_unknown_queue_is_refused_naming_field_value_and_fix(controller):
    answer = controller.request_admission(request("x", "research", 2, 2).to_json())
    assert answer["outcome"] == "refused"
    field, value, message = answer["error"]
    assert (field, value) == ("queue", "research")
    assert "no such queue" in message and "rayfleet queue apply" in message and "team-a" in message
    assert controller.admissions() == []


def test_a_job_without_a_queue_is_admitted_directly_while_no_default_queue_is_declared(controller):
    assert controller.request_admission(request("x", "default", 2, 2).to_json()) == {"outcome": "direct"}
    controller.create_queue({"name": "default", "quota": {}})  # declared: default jobs queue too
    assert controller.request_admission(request("y", "default", 2, 2).to_json())["outcome"] == "queued"


def test_wait_borrow_reclaim_by_shrinking_the_borrower_and_survive_a_restart(controller, tmp_path):
    fleet = Fleet(controller)
    for job_id, queue in (("a1", "team-a"), ("b1", "team-b")):
        assert controller.request_admission(request(job_id, queue, 2, 2).to_json())["outcome"] == "queued"
        assert controller.admission_status(job_id)["ready"]
        fleet.run(job_id)
    # b2 is elastic 1..2: team-b's quota is used and the queues' 4 H100 are all held (not the fleet's 32)
    controller.request_admission(request("b2", "team-b", 1, 2, JobClass.ELASTIC, replica=1).to_json())
    b2 = fleet.state("b2")
    assert (b2["state"], b2["position"]) == ("QUEUED", 1)
    assert "gang minimum 1 does not fit" in b2["reason"] and "0 idle" in b2["reason"]
    assert not controller.admission_status("b2")["ready"]

    # a controller restart: same file, the reconcile parked; b2 keeps its state, reason and place
    again = FleetController(controller.state_path, reconcile_s=3600.0)
    try:
        assert again.admission_status("b2")["record"] == b2
        assert [r["request"]["job_id"] for r in again.admissions()] == ["b2", "a1", "b1"]  # queued first
        Fleet(again)
        # team-a idles (a1 ends): b2 borrows team-a's 2 idle accelerators, up to team-b's borrow limit
        assert again.release_admission("a1")
        b2 = again.admission_status("b2")
        assert b2["ready"] and b2["record"]["state"] == "ADMITTED"
        assert (b2["record"]["size"], b2["record"]["borrowed"]) == (2, 2)
        assert "borrowing 2 idle" in b2["record"]["reason"]
        again.admission_heartbeat("b2", 2)
        # team-a is within its quota and wants 1: b2 is shrunk by one DP replica, not preempted
        again.request_admission(request("a2", "team-a", 1, 1).to_json())
        a2 = again.admission_status("a2")
        assert a2["record"]["state"] == "ADMITTED" and a2["record"]["waiting_for"] == ["b2"]
        assert not a2["ready"]  # b2 has not let go yet
        inbox = again.take_decisions("name-b2")
        assert [type(e.decision) for e in inbox] == [ShrinkTraining]
        shrink = inbox[0].decision
        assert (shrink.new_size, shrink.replicas) == (1, (1,))
        assert "reclaimed by team-a" in shrink.reason and "queue team-b borrows 2 above quota" in shrink.reason
        again.admission_heartbeat("b2", 0)  # its formation stopped ...
        assert not again.admission_status("a2")["ready"]
        again.admission_heartbeat("b2", 1)  # ... and re-formed at 1
        assert again.admission_status("a2")["ready"]
        kinds = [(e.subject, e.kind) for e in again.events(limit=100) if e.kind.startswith("queue_")]
        order = [k for k in kinds if k[1] in ("queue_waiting", "queue_admitted", "queue_reclaim", "queue_released")]
        assert order.index(("job:name-b2", "queue_waiting")) < order.index(("job:name-a1", "queue_released")) \
            < order.index(("job:name-b2", "queue_admitted")) < order.index(("job:name-b2", "queue_reclaim")) \
            < order.index(("job:name-a2", "queue_admitted"))
    finally:
        again._stop.set()


def test_an_opportunistic_borrower_is_preempted_whole_and_readmitted_with_a_grow(controller):
    fleet = Fleet(controller)
    controller.request_admission(request("b1", "team-b", 2, 2).to_json())
    fleet.run("b1")
    controller.request_admission(request("b2", "team-b", 2, 2, JobClass.OPPORTUNISTIC, replica=2).to_json())
    fleet.run("b2")
    assert fleet.state("b2")["borrowed"] == 2
    controller.request_admission(request("a1", "team-a", 2, 2).to_json())
    [entry] = controller.take_decisions("name-b2")
    assert entry.decision.new_size == 0 and "preempted whole" in entry.decision.reason
    b2 = fleet.state("b2")
    assert b2["state"] == "QUEUED" and b2["reason"].startswith("preempted: ")
    controller.admission_heartbeat("b2", 0)  # paused: holds nothing
    assert controller.admission_status("a1")["ready"]
    fleet.run("a1")
    controller.release_admission("a1")  # room again: b2 is re-admitted and told to grow
    assert fleet.state("b2")["state"] == "ADMITTED"
    assert [type(e.decision) for e in controller.take_decisions("name-b2")] == [GrowTraining]


def test_promised_accelerators_are_not_idle_and_silent_drivers_expire(controller):
    controller.admission.ray_idle = lambda: {"H100": 3}  # Ray's count: 3 idle on the whole fleet
    controller.request_admission(request("b1", "team-b", 2, 2).to_json())
    controller.request_admission(request("b2", "team-b", 2, 2, JobClass.ELASTIC).to_json())  # would borrow 2
    b2 = controller.admission_status("b2")["record"]
    assert b2["state"] == "QUEUED" and "1 idle" in b2["reason"]  # b1 was promised 2 of the 3
    assert controller.admission.expire(lambda ids: {"b1", "not-ours"}) == ["b1"]  # Ray says b1's job ended
    assert any(e.kind == "queue_released" and e.cause == "its Ray job ended" for e in controller.events(limit=20))
    assert controller.admission.expire(lambda ids: 1 / 0) == []  # the job API down: nothing released
    controller.request_admission(request("b1", "team-b", 2, 2).to_json())
    controller.admission.heartbeat_ttl_s = -1.0  # every driver is late
    assert sorted(controller.admission.expire()) == ["b1", "b2"]
    assert controller.admissions() == []
    assert any(e.kind == "queue_released" and "no heartbeat" in e.cause for e in controller.events(limit=20))


def test_a_queue_with_jobs_cannot_be_deleted(controller):
    controller.request_admission(request("a1", "team-a", 2, 2).to_json())
    with pytest.raises(SpecError, match="holds 1 queued or running job"):
        controller.delete_queue("team-a")
    controller.release_admission("a1")
    controller.delete_queue("team-a")


def test_apply_queues_validates_the_whole_tree_and_reports_changes(controller):
    result = controller.apply_queues([{"name": "team-a", "quota": {"H100": 2}, "borrow_limit": {"H100": 0}},
                                      {"name": "team-b", "quota": {"H100": 4}, "borrow_limit": {"H100": 2}},
                                      {"name": "team-c", "parent": "team-b", "quota": {"H100": 4}}])
    assert result == {"created": ["team-c"], "updated": ["team-b"], "unchanged": ["team-a"]}
    with pytest.raises(SpecError, match="children are guaranteed 8"):  # nothing stored on failure
        controller.apply_queues([{"name": "team-d", "parent": "team-b", "quota": {"H100": 4}},
                                 {"name": "team-e", "quota": {"H100": 1}}])
    assert "team-e" not in {q["name"] for q in controller.list_queues()}


def test_parse_queue_file_names_the_bad_entry():
    assert [q.name for q in parse_queue_file(QUEUES)] == ["team-a", "team-b"]
    assert [q.name for q in parse_queue_file(QUEUES["queues"])] == ["team-a", "team-b"]
    with pytest.raises(SpecError, match="holds no list of queues"):
        parse_queue_file({"queue": []}, source="q.yaml")
    with pytest.raises(SpecError, match=r"queue.quota"):
        parse_queue_file({"queues": [{"name": "a", "quota": {"NOPE": 1}}]})


def test_route_and_governed_capacity():
    tree = QueueTree.build(parse_queue_file(QUEUES))
    assert route(tree, "default") is None and route(tree, "team-a") == "team-a"
    with pytest.raises(SpecError, match="queue='nope'"):
        route(tree, "nope")
    parent = QueueTree.build([parse_queue_spec({"name": "org", "quota": {"H100": 4}}),
                              parse_queue_spec({"name": "kid", "parent": "org", "quota": {"H100": 4}}),
                              parse_queue_spec({"name": "other", "quota": {"H100": 2}})])
    with pytest.raises(SpecError, match="is a parent queue") as refused:
        route(parent, "org")
    assert "name one of its leaves: kid" in str(refused.value) and "other" not in str(refused.value)  # its own leaves only
    running = [Workload("j", "team-a", "H100", 2, 2, 2, 2)]
    assert governed_free(tree, running, "H100", idle=30) == 2  # the roots govern 4; 2 are held
    assert governed_free(tree, running, "H100", idle=1) == 1
    assert governed_free(tree, running, "A100", idle=16) == 16  # no quota of that type: the idle fleet


def test_admission_step_is_pure_and_orders_by_submission():
    tree = QueueTree.build(parse_queue_file(QUEUES))
    queued = [AdmissionRecord(request("late", "team-b", 2, 2), AdmissionState.QUEUED, submitted_at=2.0),
              AdmissionRecord(request("early", "team-b", 2, 2), AdmissionState.QUEUED, submitted_at=1.0)]
    step = admission_step(tree, queued, ray_idle={"H100": 2}, now=5.0)
    by_id = {r.job_id: r for r in step.records}
    assert by_id["early"].state is AdmissionState.ADMITTED and by_id["late"].position == 1
    assert [r.job_id for r in step.admitted] == ["early"] and not step.reclaims


def test_request_sizes_round_to_whole_replicas():
    assert request_sizes(min_workers=3, max_workers=9, replica_size=2) == (4, 8)
    with pytest.raises(SpecError, match="resources.elastic"):
        request_sizes(min_workers=3, max_workers=3, replica_size=2)


def test_a_restarted_controller_sends_an_unfinished_reclaim_again(controller):
    """The autoscaler's inboxes are in memory: a ShrinkTraining not yet taken dies with the controller."""
    fleet = Fleet(controller)
    controller.request_admission(request("b1", "team-b", 2, 2).to_json())
    fleet.run("b1")
    controller.request_admission(request("b2", "team-b", 1, 2, JobClass.ELASTIC, replica=1).to_json())
    fleet.run("b2")  # borrowing 2, holding 2
    controller.request_admission(request("a1", "team-a", 1, 1).to_json())  # reclaims 1 of b2's
    again = FleetController(controller.state_path, reconcile_s=3600.0)  # before b2's shell took it
    try:
        [entry] = again.take_decisions("name-b2")
        assert (entry.decision.new_size, entry.decision.replicas) == (1, (1,))
        assert "sent again after a controller restart" in entry.decision.reason
        Fleet(again)
        again.admission_heartbeat("b2", 1)  # b2 re-formed at 1: nothing is sent after the next restart
        third = FleetController(controller.state_path, reconcile_s=3600.0)
        third._stop.set()
        assert third.take_decisions("name-b2") == []
    finally:
        again._stop.set()
