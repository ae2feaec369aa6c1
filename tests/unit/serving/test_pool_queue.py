"""A serve spec's pools admitted through the fleet's queues at deploy time (no Ray).

``deploy.pool_admission.admit_pools`` is driven against an in-process fleet controller (its
reconcile parked; ``call`` is its methods called directly, where the deployer goes through Ray).
Queues: ``inference`` (quota 16 H100, may borrow 8) on a fleet of 32. A disaggregated app's
prefill and decode pools ask for 8 H100 per replica.
"""

import pytest

from rayfleet.errors import SpecError
from rayfleet.platform.controller import FleetController
from rayfleet.serving.deploy.pool_admission import (PoolGrant, PoolRefusedError, admit_pools, release_pools,
                                                    report_started, serve_bounds)
from rayfleet.serving.spec import ServeSpec

FLEET = 32


def spec(prefill=None, decode=None, name="chat"):
    pool = {"accelerator_type": "H100", "accelerators_per_replica": 8}
    return ServeSpec.parse({"name": name, "mode": "disaggregated", "model": {"checkpoint": "file:///ckpt/run-7/"},
                            "prefill": {**pool, **(prefill or {})}, "decode": {**pool, **(decode or {})}})


@pytest.fixture
def controller(tmp_path):
    ctl = FleetController(str(tmp_path / "state.sqlite"), reconcile_s=3600.0)
    ctl.admission.ray_idle = lambda: {"H100": FLEET - sum(r["held"] for r in ctl.admissions())}
    ctl.apply_queues([{"name": "inference", "quota": {"H100": 16}, "borrow_limit": {"H100": 8}}])
    yield ctl
    ctl._stop.set()


def direct(controller):
    return lambda method, *args: getattr(controller, method)(*args)


def test_pool_queue_field_defaults_to_running_outside_the_queues():
    s = spec()
    assert s.prefill.queue == s.decode.queue == "default"
    assert s.decode.admission_request(app="chat", role="decode") is not None  # asks for 8 H100, direct
    cpu = ServeSpec.parse({"mode": "colocated", "model": {"checkpoint": "file:///c/"},
                           "colocated": {"accelerators_per_replica": 0}})
    assert cpu.colocated.admission_request(app="x", role="colocated") is None
    with pytest.raises(SpecError, match="queue"):
        ServeSpec.parse({"mode": "colocated", "model": {"checkpoint": "file:///c/"},
                         "colocated": {"queue": "bad name!"}})


def test_admitted_pools_are_capped_at_their_grant_and_count_in_their_queue(controller):
    s = spec(prefill={"queue": "inference"}, decode={"queue": "inference", "max_replicas": 4})
    grants = admit_pools("chat", s.pools(), direct(controller), deadline=1e18)
    # prefill takes 8 of inference's 16; decode asks for 8..32 and gets the 8 left (never borrows)
    assert {r: (g.replicas, g.job_id) for r, g in grants.items()} == {
        "prefill": (1, "serve:chat/prefill"), "decode": (1, "serve:chat/decode")}
    assert serve_bounds(s.decode, grants["decode"]) == (1, 1)  # Serve may not scale decode to 4 alone
    assert serve_bounds(s.decode, None) == (1, 4)  # the broken variant: the spec's own bounds
    report_started(grants, s.pools(), direct(controller))
    assert sorted((r["request"]["job_id"], r["held"]) for r in controller.admissions()) == [
        ("serve:chat/decode", 8), ("serve:chat/prefill", 8)]
    release_pools(grants.values(), direct(controller), "the Serve app was shut down")
    assert controller.admissions() == []


def test_a_refused_pool_fails_the_deploy_and_gives_back_the_pools_admitted_before_it(controller):
    s = spec(prefill={"queue": "inference"}, decode={"queue": "inference", "replicas": 2})  # 8 + 16 > 16
    with pytest.raises(PoolRefusedError) as err:
        admit_pools("chat", s.pools(), direct(controller), deadline=1e18)
    assert "decode.replicas=2" in str(err.value) and "does not fit in queue inference" in str(err.value)
    assert controller.admissions() == []  # prefill's grant was released (nothing was deployed)


def test_unknown_queue_fails_the_deploy_with_the_fix(controller):
    with pytest.raises(PoolRefusedError, match="queue='research': no such queue.*rayfleet queue apply"):
        admit_pools("chat", spec(decode={"queue": "research"}).pools(), direct(controller), deadline=1e18)


def test_pools_outside_the_queues_keep_their_spec_bounds(controller):
    grants = admit_pools("chat", spec(decode={"max_replicas": 3}).pools(), direct(controller), deadline=1e18)
    assert grants["decode"] == PoolGrant("decode", 3, 8)  # no job id: nothing to release or report
    assert controller.admissions() == []


def test_a_pool_waiting_for_a_reclaim_gives_up_at_the_deadline(controller):
    calls = []

    def never_ready(method, *args):
        calls.append(method)
        if method == "admit_serve_pool":
            return {"outcome": "queued", "record": {}}
        if method == "admission_status":
            return {"ready": False, "record": {"waiting_for": ["name-b1"], "size": 8}}
        return True

    now = [0.0]
    with pytest.raises(PoolRefusedError, match=r"reclaims from \(name-b1\) did not let go"):
        admit_pools("chat", spec(decode={"queue": "inference"}).pools(), never_ready, deadline=2.0,
                    clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert calls.count("admission_status") == 5 and calls[-1] == "release_admission"  # 0, .5, .., 2.0


def test_a_pool_within_its_quota_reclaims_from_a_borrower_and_deploys_once_it_lets_go(controller):
    """The deploy's side of a reclaim (the live tier shows a reclaim only between training jobs):
    ``research`` borrows inference's idle 16; a pool within inference's quota is admitted at once,
    the borrower gets a ShrinkTraining, and ``admit_pools`` waits until the borrower holds its new
    size, then grants. The broken variant, granting before the borrower let go, would hand Serve
    accelerators a training job still holds: the grant appears only after the shrink is reported."""
    from rayfleet.platform.admission import AdmissionRequest
    from rayfleet.platform.autoscaler.types import ShrinkTraining
    from rayfleet.platform.queues import JobClass

    controller.create_queue({"name": "research", "quota": {"H100": 8}})  # may borrow any idle accelerator
    borrower = AdmissionRequest(job_id="r1", name="name-r1", queue="research", accelerator_type="H100",
                                min_size=8, max_size=32, replica_size=8, job_class=JobClass.ELASTIC)
    assert controller.request_admission(borrower.to_json())["record"]["borrowed"] == 16  # all the roots' 24
    controller.admission_heartbeat("r1", 24)
    polls = []

    def wait(seconds):  # the borrower re-forms at its new size while the deploy polls
        polls.append(seconds)
        [entry] = controller.take_decisions("name-r1")
        assert isinstance(entry.decision, ShrinkTraining) and entry.decision.new_size == 16
        controller.admission_heartbeat("r1", 16)

    grants = admit_pools("chat", spec(decode={"queue": "inference"}).pools(), direct(controller), deadline=1e18,
                         sleep=wait)
    assert polls == [0.5] and grants["decode"].replicas == 1  # granted only after one poll saw r1 let go
    assert "reclaiming 8" in grants["decode"].reason, grants["decode"].reason
    assert {r["request"]["job_id"]: (r["size"], r["borrowed"]) for r in controller.admissions()} == {
        "r1": (16, 8), "serve:chat/decode": (8, 0)}
