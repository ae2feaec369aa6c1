"""The Serve shell's pure part: what it reports to the shared autoscaler."""

from rayfleet.platform.autoscaler.policy import AutoscalerPolicy, AutoscalerState, FleetObservation, GrowTraining
from rayfleet.platform.autoscaler.policy import TrainingObservation
from rayfleet.platform.queues import JobClass
from rayfleet.serving.deploy.serve_scaling_rules import (LentReplica, RoomWatch, ServeShellConfig, desired_replicas, lender_settled, p95)
from rayfleet.serving.deploy.serve_scaling_rules import serve_observation


def test_p95_is_nearest_rank_and_zero_without_samples():
    assert p95([]) == 0.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([0.1] * 19 + [9.0]) == 0.1  # one slow request in twenty stays under p95


def test_desired_replicas_follows_in_flight_requests_within_bounds():
    assert desired_replicas(7, target_ongoing_requests=2, min_replicas=1, max_replicas=2) == 2
    assert desired_replicas(1, target_ongoing_requests=2, min_replicas=1, max_replicas=2) == 1
    assert desired_replicas(0, target_ongoing_requests=2, min_replicas=2, max_replicas=8) == 2


def test_lender_settles_only_when_nothing_but_the_lent_accelerators_is_free():
    # the training job is re-forming: its 3 accelerators and the lent one are all free
    assert not lender_settled({"n6": 2, "n7": 2, "n0": 0}, pending_lent=1)
    # it holds its new layout: only the lent accelerator on n6 is free
    assert lender_settled({"n6": 1, "n7": 0, "n0": 0}, pending_lent=1)
    assert not lender_settled({"n6": 1, "n7": 1}, pending_lent=1)


def test_observation_counts_lent_replicas_and_lists_them_last():
    config = ServeShellConfig(ttft_slo_s=2.0, target_ongoing_requests=2, max_replicas=3)
    lent = [LentReplica("colocated-1", "app--colocated-1", "n6", decided_at=0, placed_at=1, running_at=5),
            LentReplica("colocated-2", "app--colocated-2", "n7", decided_at=3),  # waiting for its accelerator
            LentReplica("colocated-3", "app--colocated-3", "n7", decided_at=0, placed_at=1, running_at=2,
                        removal_decided_at=9)]  # draining: no longer counted
    obs = serve_observation(deployment="app", accelerator_type="H100", accelerators_per_replica=1,
                            load={"in_flight": 5, "waiting_first_token": 3, "ttft_s": [0.5, 3.0]},
                            kv_usage_by_replica={"colocated-0": 0.2, "colocated-1": 0.7}, base_nodes=["n0"],
                            lent=lent, config=config)
    assert (obs.running_replicas, obs.pending_replicas, obs.desired_replicas) == (2, 1, 3)
    assert obs.replica_nodes == ("n0", "n6", "n7") and obs.unplaced_nodes == ("n7",)
    assert obs.queue_depth == 3 and obs.ttft_p95_s == 3.0 and obs.kv_usage == 0.7 and obs.min_replicas == 1


def test_policy_keeps_room_for_an_unplaced_replica():
    """The regression behind ``unplaced_nodes``: the training job re-formed smaller, the lent
    accelerator showed free before the Serve replica took it, and the policy grew training back
    onto it at once."""
    config = ServeShellConfig(max_replicas=2)
    lent = [LentReplica("colocated-1", "a--colocated-1", "n6", decided_at=0)]
    serve = serve_observation(deployment="a", accelerator_type="H100", accelerators_per_replica=1,
                              load={"in_flight": 4}, kv_usage_by_replica={}, base_nodes=["n0"], lent=lent, config=config)
    job = TrainingObservation("t", "q", "H100", JobClass.ELASTIC, 3, 2, 4, 1, (("n6",), ("n7",), ("n7",)))
    nodes = {"n0": "H100", "n6": "H100", "n7": "H100"}
    policy = AutoscalerPolicy()
    r = policy.decide(AutoscalerState(), FleetObservation(100, {"n0": 0, "n6": 1, "n7": 0}, nodes, (serve,), (job,)))
    assert not [d for d in r.decisions if isinstance(d, GrowTraining)]
    placed = serve_observation(deployment="a", accelerator_type="H100", accelerators_per_replica=1,
                               load={"in_flight": 0}, kv_usage_by_replica={}, base_nodes=["n0"],
                               lent=[], config=config)
    r = policy.decide(AutoscalerState(), FleetObservation(100, {"n0": 0, "n6": 1, "n7": 0}, nodes, (placed,), (job,)))
    assert [d.new_size for d in r.decisions if isinstance(d, GrowTraining)] == [4]  # the broken variant


def test_room_watch_waits_for_the_lender_to_look_settled_for_a_while():
    """A momentary 'settled' view (one node reported its freed accelerators, the other not yet)
    must not place the replica; a settled view that holds for hold_s does."""
    watch = RoomWatch("n6", 1, settle_s=90.0, hold_s=1.0)
    assert not watch.ready(0.0, {"n6": 0, "n7": 0}, pending_lent=1)  # the job still holds everything
    assert not watch.ready(1.0, {"n6": 1, "n7": 0}, pending_lent=1)  # n7's release not reported yet
    assert not watch.ready(1.25, {"n6": 1, "n7": 2}, pending_lent=1)  # ... now it is: the job re-forms
    assert not watch.ready(2.25, {"n6": 1, "n7": 2}, pending_lent=1)
    assert not watch.ready(5.0, {"n6": 1, "n7": 0}, pending_lent=1)  # the new layout holds n7
    assert not watch.ready(5.5, {"n6": 1, "n7": 0}, pending_lent=1)
    assert watch.ready(6.0, {"n6": 1, "n7": 0}, pending_lent=1)
    # a lender that never re-forms: room on the node for settle_s is enough
    lazy = RoomWatch("n6", 1, settle_s=3.0, hold_s=1.0)
    assert not lazy.ready(0.0, {"n6": 1, "n7": 2}, pending_lent=1)
    assert lazy.ready(3.0, {"n6": 1, "n7": 2}, pending_lent=1)
    # no room on the node resets both clocks
    assert not lazy.ready(3.5, {"n6": 0, "n7": 2}, pending_lent=1)
    assert not lazy.ready(4.0, {"n6": 1, "n7": 2}, pending_lent=1)


def test_room_watch_starts_at_once_when_nothing_re_forms():
    """Regression (quickstart notebook, fresh clone): the lender was preempted whole, so its
    accelerators stayed free and it never looked settled; the replica waited out the 90 s
    fallback (handover 99.4 s). A decision naming no re-forming job starts it once there is room."""
    paused_lender = RoomWatch("n0000", 1, settle_s=90.0, hold_s=1.0, reforming=False)
    assert not paused_lender.ready(0.0, {"n0000": 0}, pending_lent=1)  # the job still stops
    assert paused_lender.ready(0.25, {"n0000": 3}, pending_lent=1)  # free: start now
    # the broken variant: waiting for a paused lender to settle takes the whole fallback
    waiting = RoomWatch("n0000", 1, settle_s=90.0, hold_s=1.0)
    assert not any(waiting.ready(t / 4, {"n0000": 3}, pending_lent=1) for t in range(360))
    assert waiting.ready(90.0, {"n0000": 3}, pending_lent=1)
