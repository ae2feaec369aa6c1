"""Serve pools admitted through the queues by the fleet controller, driven without Ray.

The controller runs in-process (reconcile parked), as in test_admission_controller.py. Two root
queues on a fleet of 32 H100: ``inference`` (quota 24, may borrow 8) and ``research`` (quota 8,
may borrow any idle accelerator). A Serve pool's request goes through the same admission book and
``queues.admit`` as a training job's; what differs (platform/serve_admission.py): it is admitted
at once or refused, it never borrows, its record has no driver to heartbeat, and the autoscaler's
lends to it stop at its queue's limits.
"""

import pytest

from rayfleet.errors import SpecError
from rayfleet.platform.admission import AdmissionRequest, AdmissionState, growth_limits
from rayfleet.platform.autoscaler import policy as policy_module
from rayfleet.platform.autoscaler.policy import (
    AutoscalerConfig, AutoscalerPolicy, AutoscalerState, FleetObservation, ScaleServe, ServeObservation,
)
from rayfleet.platform.controller import FleetController
from rayfleet.platform.queues import JobClass, QueueTree, parse_queue_file
from rayfleet.platform.serve_admission import serve_pool_request

QUEUES = [{"name": "inference", "quota": {"H100": 24}, "borrow_limit": {"H100": 8}},
          {"name": "research", "quota": {"H100": 8}}]
FLEET = 32
NODES = {f"n{i}": "H100" for i in range(4)}


def pool(role="decode", queue="inference", replicas=1, max_replicas=None, app="chat", per=8):
    return serve_pool_request(app=app, role=role, queue=queue, accelerator_type="H100", accelerators_per_replica=per,
                              replicas=replicas, max_replicas=max_replicas)


def training(job_id, queue, size, klass=JobClass.GUARANTEED):
    return AdmissionRequest(job_id=job_id, name=f"name-{job_id}", queue=queue, accelerator_type="H100",
                            min_size=size, max_size=size, replica_size=size, job_class=klass)


@pytest.fixture
def controller(tmp_path):
    ctl = FleetController(str(tmp_path / "state.sqlite"), reconcile_s=3600.0)
    ctl.admission.ray_idle = lambda: {"H100": FLEET - sum(r["held"] for r in ctl.admissions())}
    ctl.apply_queues(QUEUES)
    yield ctl
    ctl._stop.set()


def record(controller, job_id):
    return controller.admission_status(job_id)["record"]


def test_a_pool_asks_for_its_replica_range_in_whole_replicas_as_a_guaranteed_workload():
    request = pool(replicas=2, max_replicas=4)
    assert (request.job_id, request.name) == ("serve:chat/decode", "chat/decode")
    assert (request.min_size, request.max_size, request.replica_size) == (16, 32, 8)
    assert request.job_class is JobClass.GUARANTEED and request.serve_pool
    assert AdmissionRequest.from_json(request.to_json()) == request  # crosses Ray and the store as JSON
    # a CPU-only pool outside the queues asks for nothing; naming a queue for it is a mistake
    assert serve_pool_request(app="a", role="decode", queue="default", accelerator_type=None,
                              accelerators_per_replica=0, replicas=1, max_replicas=None) is None
    with pytest.raises(SpecError, match="decode.queue='inference'.*Fix: set decode.accelerator_type") as err:
        serve_pool_request(app="a", role="decode", queue="inference", accelerator_type=None,
                           accelerators_per_replica=1, replicas=1, max_replicas=None)
    assert err.value.field == "decode.queue"


def test_pool_is_admitted_at_the_most_whole_replicas_its_quota_holds_and_never_borrows(controller):
    answer = controller.admit_serve_pool(pool(replicas=1, max_replicas=4).to_json())
    assert answer["outcome"] == "queued" and answer["record"]["state"] == "ADMITTED"
    assert (answer["record"]["size"], answer["record"]["borrowed"]) == (24, 0)  # quota 24; 32 would borrow 8
    # the rule that keeps it there: the same request as an elastic workload would borrow the 8
    controller.release_admission("serve:chat/decode")
    elastic = AdmissionRequest(**{**pool(replicas=1, max_replicas=4).__dict__, "job_class": JobClass.ELASTIC})
    assert controller.admit_serve_pool(elastic.to_json())["record"]["size"] == 32


def test_unknown_queue_is_refused_naming_field_value_and_fix(controller):
    answer = controller.admit_serve_pool(pool(queue="nope").to_json())
    assert answer["outcome"] == "refused"
    field, value, message = answer["error"]
    assert (field, value) == ("decode.queue", "nope")  # the pool's own field, as the serve spec spells it
    assert message.startswith("decode.queue='nope': no such queue on this fleet (queues: inference, research)")
    assert "rayfleet queue apply" in message and "leave `decode.queue` unset" in message
    assert controller.admissions() == []


def test_a_redeploy_to_an_unknown_queue_leaves_the_running_apps_grant(controller):
    controller.admit_serve_pool(pool().to_json())
    assert controller.admit_serve_pool(pool(queue="nope").to_json())["outcome"] == "refused"
    assert record(controller, "serve:chat/decode")["state"] == "ADMITTED"  # not released by the bad request


def test_pool_over_its_quota_is_refused_with_the_reason_and_leaves_no_record(controller):
    answer = controller.admit_serve_pool(pool(replicas=4).to_json())  # 32 > quota 24
    assert answer["outcome"] == "refused"
    field, value, message = answer["error"]
    assert (field, value) == ("decode.replicas", 4)
    assert "does not fit in queue inference: it asks for 32 H100 (4 x 8); its H100 quota is 24, 0 in use" in message
    assert "guaranteed jobs run only inside their queue's quota" in message
    assert "Fix: lower the pool's replicas, raise queue inference's H100 quota" in message
    assert controller.admissions() == []
    # the broken variant is the training path: the same request waits in line instead
    assert controller.request_admission(pool(replicas=4).to_json())["record"]["state"] == "QUEUED"


def test_what_a_pool_holds_counts_against_its_queue_for_training_jobs(controller):
    controller.admit_serve_pool(pool(replicas=2).to_json())  # 16 of inference's 24
    controller.admission_heartbeat("serve:chat/decode", 16)  # its replicas run
    answer = controller.request_admission(training("t1", "inference", 16).to_json())
    assert answer["record"]["state"] == "QUEUED"  # 16 + 16 > 24: the pool is counted
    assert answer["record"]["reason"].endswith("16: guaranteed jobs run only inside their queue's quota")
    assert controller.request_admission(training("t2", "inference", 8).to_json())["record"]["state"] == "ADMITTED"
    controller.release_admission("t2")
    # the app is shut down: its grant goes back and the waiting job starts
    assert controller.release_admission("serve:chat/decode", "the Serve app was shut down")
    assert record(controller, "t1")["state"] == "ADMITTED"


def test_a_pool_outside_the_queues_is_direct_and_counts_against_nothing(controller):
    assert controller.admit_serve_pool(pool(queue="default", replicas=3).to_json()) == {"outcome": "direct"}
    assert controller.request_admission(training("t1", "inference", 24).to_json())["record"]["state"] == "ADMITTED"


def test_a_pool_record_is_not_expired_for_silence_and_redeploy_replaces_it(controller):
    now = [1000.0]
    book = controller.admission
    book.clock = lambda: now[0]
    controller.admit_serve_pool(pool(replicas=1).to_json())
    controller.request_admission(training("t1", "research", 8).to_json())
    now[0] += book.heartbeat_ttl_s + 1
    assert book.expire() == ["t1"]  # the training driver went silent; the pool has no driver
    assert record(controller, "serve:chat/decode")["state"] == "ADMITTED"
    controller.admit_serve_pool(pool(replicas=2, max_replicas=2).to_json())  # the app deployed again
    pools = [r for r in controller.admissions() if r["request"]["serve_pool"]]
    assert [(r["request"]["job_id"], r["size"]) for r in pools] == [("serve:chat/decode", 16)]


# -- the shared autoscaler's lends to a pool stop at its queue's limits ---------------------------
TREE = QueueTree.build(parse_queue_file(QUEUES))


def admitted(request, size):
    from rayfleet.platform.admission import AdmissionRecord

    return AdmissionRecord(request=request, state=AdmissionState.ADMITTED, submitted_at=0.0, size=size, held=size)


def serve_obs(app, replicas, desired, node):
    return ServeObservation(deployment=app, accelerator_type="H100", accelerators_per_replica=8,
                            running_replicas=replicas, desired_replicas=desired, replica_nodes=(node,) * replicas,
                            max_replicas=8, pool_key=f"{app}/decode")


def scale_ups(serve, limits):
    obs = FleetObservation(0.0, {n: 8 for n in NODES}, NODES, tuple(serve), (), queue_limits=limits)
    result = AutoscalerPolicy(AutoscalerConfig()).decide(AutoscalerState(), obs)
    return {d.deployment: d.target_replicas for d in result.decisions if isinstance(d, ScaleServe)}


def test_lending_to_a_pool_stops_at_its_queue_quota():
    limits = growth_limits(TREE, [admitted(pool(replicas=2, max_replicas=2), 16)])
    assert limits.job_to_ceiling == {"chat/decode": 24}  # inference's quota: a pool never borrows
    assert scale_ups([serve_obs("chat", 2, 4, "n0")], limits) == {"chat": 3}
    # broken variant: the observation without the queue's limits lends it all 4
    assert scale_ups([serve_obs("chat", 2, 4, "n0")], type(limits)()) == {"chat": 4}


def test_pools_of_one_queue_share_its_room_within_a_step(monkeypatch):
    records = [admitted(pool(app="a", replicas=1), 8), admitted(pool(app="b", replicas=1), 8)]
    limits = growth_limits(TREE, records)
    assert limits.job_to_ceiling == {"a/decode": 16, "b/decode": 16}  # each alone may take the 8 left
    both = [serve_obs("a", 1, 2, "n0"), serve_obs("b", 1, 2, "n1")]
    assert len(scale_ups(both, limits)) == 1  # together they stay within inference's 24
    monkeypatch.setattr(policy_module, "take_queue_room", lambda *a, **k: None)  # broken: room not charged
    assert scale_ups(both, limits) == {"a": 2, "b": 2}


def test_the_book_follows_what_a_pool_holds_and_the_lends_it_gets(controller):
    controller.autoscaler.free_accelerators = lambda: ({n: 8 for n in NODES}, dict(NODES))
    controller.admit_serve_pool(pool(replicas=2, max_replicas=2).to_json())
    assert record(controller, "serve:chat/decode")["held"] == 0
    controller.report_serve(serve_obs("chat", 2, 2, "n0"))  # its shell reports 2 replicas running
    assert record(controller, "serve:chat/decode")["held"] == 16
    controller.autoscaler.act(ScaleServe("chat", 3, ("n1",), (), "TTFT at risk: +1 replica(s)"))
    assert record(controller, "serve:chat/decode")["size"] == 24  # the lend counts against inference
    assert controller.request_admission(training("t1", "inference", 8).to_json())["record"]["state"] == "QUEUED"


def test_a_pool_whose_app_serve_no_longer_runs_is_released_once_it_has_served(controller, monkeypatch):
    """``serve delete chat`` (not ``ServeDeployment.shutdown``) leaves the record to the reconcile:
    released once Serve no longer lists the app, but not while a deploy is on its way (held 0:
    the app may not exist yet)."""
    apps = set()
    monkeypatch.setattr(controller, "_ended_serve_pools", lambda ids: {
        j for j in ids if j.removeprefix("serve:").rsplit("/", 1)[0] not in apps})
    controller.admit_serve_pool(pool(replicas=1).to_json())
    assert controller.admission.expire(controller._ended_jobs) == []  # deploying: app not created yet
    apps.add("chat")
    controller.admission_heartbeat("serve:chat/decode", 8)  # the deploy saw it healthy
    assert controller.admission.expire(controller._ended_jobs) == []  # Serve runs it
    apps.clear()  # `serve delete chat`
    assert controller.admission.expire(controller._ended_jobs) == ["serve:chat/decode"]
    assert controller.admissions() == []


def test_ended_serve_pools_reads_serves_application_names(controller, monkeypatch):
    from types import SimpleNamespace

    from ray import serve

    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"chat": object()}))
    ids = {"serve:chat/decode", "serve:chat/prefill", "serve:gone/decode", "serve:a/b/decode"}
    assert FleetController._ended_serve_pools(controller, ids) == {"serve:gone/decode", "serve:a/b/decode"}


def test_ended_jobs_answers_for_ray_jobs_and_serve_pools_together(controller, monkeypatch):
    from types import SimpleNamespace

    from ray import serve

    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    jobs = [SimpleNamespace(submission_id="t1", status="STOPPED"), SimpleNamespace(submission_id="t2", status="RUNNING")]
    controller._job_client = SimpleNamespace(list_jobs=lambda: jobs)
    assert controller._ended_jobs({"t1", "t2", "serve:chat/decode"}) == {"t1", "serve:chat/decode"}
    assert controller._ended_jobs({"t1", "t2"}) == {"t1"}
    monkeypatch.setattr(serve, "status", lambda: 1 / 0)  # Serve not answering: the Ray jobs still are
    assert controller._ended_jobs({"t1", "serve:chat/decode"}) == {"t1"}


def test_status_lists_serve_pools_with_their_grants_apart_from_training_jobs(controller):
    """``rayfleet status``: training jobs under their own heading, Serve pools under theirs with the
    accelerators held of those granted (the cluster twin reads a pool's row by its job id)."""
    from rayfleet.platform.inventory import FleetStatus
    from rayfleet.platform.status_table import render_status

    controller.admit_serve_pool(pool(replicas=1, max_replicas=2).to_json())  # granted 16 of inference's 24
    controller.admission_heartbeat("serve:chat/decode", 8)  # one replica runs so far
    controller.request_admission(training("t1", "research", 8).to_json())
    text = render_status(FleetStatus(nodes=(), events=(), admissions=tuple(controller.admissions())))
    jobs, _, pools = text.partition("\n\nServe pools in queues:\n")
    assert "training jobs in queues:" in jobs and "serve:chat/decode" not in jobs  # the old table mixed them
    assert "t1" in jobs.split("training jobs in queues:")[1] and "t1 " not in pools
    header, _, row = pools.splitlines()[:3]
    assert header.split() == ["pool", "queue", "state", "held/granted", "wants", "per", "type", "reason"]
    assert row.split()[:7] == ["serve:chat/decode", "inference", "ADMITTED", "8/16", "8..16", "8", "H100"]
    # no pools, no heading; no training jobs, no training heading
    controller.release_admission("serve:chat/decode")
    assert "Serve pools" not in render_status(FleetStatus(nodes=(), events=(), admissions=tuple(controller.admissions())))
    controller.release_admission("t1")
    controller.admit_serve_pool(pool().to_json())
    only_pools = render_status(FleetStatus(nodes=(), events=(), admissions=tuple(controller.admissions())))
    assert "training jobs" not in only_pools and "Serve pools in queues:" in only_pools
