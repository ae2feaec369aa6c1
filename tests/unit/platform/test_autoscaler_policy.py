"""The shared autoscaler policy: lending, topology, cheapest job, hysteresis, guarantees."""

from rayfleet.platform.autoscaler.policy import (
    AutoscalerConfig, AutoscalerPolicy, AutoscalerState, FleetObservation, GrowTraining, RequestNodes,
    ScaleServe, ServeObservation, ShrinkTraining, TrainingObservation,
)
from rayfleet.platform.queues import JobClass

NODES = {f"n{i}": "H100" for i in range(4)}


def train(job_id, replicas, *, cls=JobClass.ELASTIC, prio=0, min_size=2, replica_size=2, snap_at=0.0, max_size=None):
    nodes = tuple((n,) for n in replicas)
    size = replica_size * len(nodes)
    return TrainingObservation(job_id, "q", "H100", cls, size, min_size, max_size or size, replica_size, nodes,
                               priority=prio, admitted_size=size, last_snapshot_at_s=snap_at)


def serve(running, desired, *, ttft=0.1, nodes=None, per=4):
    return ServeObservation("chat", "H100", per, running, desired, replica_nodes=tuple(nodes or ["n0"] * running),
                            ttft_p95_s=ttft, ttft_slo_s=1.0)


def obs(now, free, serves, jobs, pending=None):
    return FleetObservation(now, free, NODES, tuple(serves), tuple(jobs), pending or {})


def kinds(result, cls):
    return [d for d in result.decisions if isinstance(d, cls)]


def test_uses_free_capacity_before_touching_training():
    policy = AutoscalerPolicy()
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 0, "n1": 4, "n2": 0, "n3": 0}, [serve(1, 2)],
                                             [train("t", ["n0", "n0", "n2", "n2"])]))
    assert not kinds(r, ShrinkTraining)
    assert kinds(r, ScaleServe)[0].add_on_nodes == ("n1",)


def test_shrinks_whole_replicas_on_one_node_so_a_serve_replica_fits():
    # 4-accelerator Serve replica; job A has 2-accelerator DP replicas spread over n0..n3, one node
    # (n3) already has 2 free: taking one replica there suffices (topology-aware).
    policy = AutoscalerPolicy()
    jobs = [train("a", ["n0", "n0", "n1", "n1", "n2", "n2", "n3"], min_size=2)]
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 0, "n1": 0, "n2": 0, "n3": 2}, [serve(1, 2, ttft=0.9)], jobs))
    shrink = kinds(r, ShrinkTraining)
    assert len(shrink) == 1 and shrink[0].new_size == 12 and shrink[0].freed_by_node == {"n3": 2}
    assert shrink[0].snapshot_first and "TTFT" in shrink[0].reason
    assert kinds(r, ScaleServe)[0].add_on_nodes == ("n3",)


def test_cheapest_job_lowest_priority_then_freshest_snapshot():
    policy = AutoscalerPolicy()
    jobs = [train("high", ["n0"] * 4, prio=5, snap_at=100), train("stale", ["n1"] * 4, snap_at=0),
            train("fresh", ["n2"] * 4, snap_at=100)]
    free = {"n0": 0, "n1": 0, "n2": 0, "n3": 0}
    r = policy.decide(AutoscalerState(), obs(110, free, [serve(1, 2)], jobs))
    assert [d.job_id for d in kinds(r, ShrinkTraining)] == ["fresh"]
    r = policy.decide(AutoscalerState(), obs(110, free, [serve(1, 3)], jobs))
    assert sorted(d.job_id for d in kinds(r, ShrinkTraining)) == ["fresh", "stale"]  # "high" last
    r = policy.decide(AutoscalerState(), obs(110, free, [serve(1, 4)], jobs))
    assert {d.job_id: d.new_size for d in kinds(r, ShrinkTraining)} == {"fresh": 4, "stale": 4, "high": 4}


def test_guaranteed_never_shrunk_and_gang_minimum_respected():
    policy = AutoscalerPolicy(AutoscalerConfig(preempt_elastic_last_resort=False))
    jobs = [train("g", ["n0", "n0"], cls=JobClass.GUARANTEED),
            train("e", ["n1", "n1", "n2"], min_size=4)]  # may give only one replica
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 0, "n1": 0, "n2": 2, "n3": 0}, [serve(0, 5)], jobs))
    shrinks = kinds(r, ShrinkTraining)
    assert all(d.job_id != "g" for d in shrinks)
    assert all(d.new_size >= 4 for d in shrinks if d.job_id == "e")
    assert kinds(r, ScaleServe)[0].target_replicas == 1  # only n2 could be made whole
    req = kinds(r, RequestNodes)
    assert req and req[0].num_accelerators == 16 and "starved" in req[0].reason


def test_opportunistic_preempted_whole():
    policy = AutoscalerPolicy()
    jobs = [train("o", ["n0", "n0", "n1"], cls=JobClass.OPPORTUNISTIC)]
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 0, "n1": 2, "n2": 0, "n3": 0}, [serve(0, 1)], jobs))
    (shrink,) = kinds(r, ShrinkTraining)
    assert shrink.preempted and not shrink.snapshot_first and shrink.replicas == (0, 1, 2)


def run_oscillating(policy, periods=20, period_s=300):
    """Desired replicas flip between 2 and 1 every ``period_s``: a policy without hysteresis flaps."""
    state, running, changes = AutoscalerState(), 2, 0
    for step in range(periods * period_s // 60):
        now = step * 60.0
        desired = 2 if (now // period_s) % 2 == 0 else 1
        free = {"n0": 8 - 4 * running, "n1": 0, "n2": 0, "n3": 0}
        r = policy.decide(state, obs(now, free, [serve(running, desired, ttft=0.2)], []))
        state = r.state
        for d in kinds(r, ScaleServe):
            changes += d.target_replicas != running
            running = d.target_replicas
    return changes


def test_no_flapping_under_oscillating_load():
    assert run_oscillating(AutoscalerPolicy(AutoscalerConfig(scale_down_after_s=900))) == 0
    # the broken variant (no hysteresis window) flaps on every swing
    assert run_oscillating(AutoscalerPolicy(AutoscalerConfig(scale_down_after_s=0))) > 10


def test_scale_down_after_window_then_training_grows_back():
    policy = AutoscalerPolicy(AutoscalerConfig(scale_down_after_s=600, job_resize_cooldown_s=0))
    jobs = [train("a", ["n0", "n0", "n1"], max_size=8)]
    free = {"n0": 0, "n1": 2, "n2": 0, "n3": 0}
    state = policy.decide(AutoscalerState(), obs(0, free, [serve(1, 2, nodes=["n3"])], jobs)).state
    assert state.lent == {"a": 2}
    lent_jobs = [train("a", ["n0", "n0"], max_size=8)]
    serve_nodes = ["n3", "n1"]
    # the scale-up's replica runs from t=60; readings start a low window only a window after the
    # scale-up (t=600), and the window must then pass whole
    for t in (60, 300, 600, 900, 1199, 1200):
        r = policy.decide(state, obs(t, {"n0": 0, "n1": 0, "n2": 0, "n3": 0}, [serve(2, 1, nodes=serve_nodes)], lent_jobs))
        state = r.state
        assert not kinds(r, ScaleServe) or t >= 1200
    down = kinds(r, ScaleServe)
    assert down and down[0].remove_from_nodes == ("n1",) and "load low for 600s" in down[0].reason
    r = policy.decide(state, obs(1320, {"n0": 0, "n1": 4, "n2": 0, "n3": 0}, [serve(1, 1, nodes=["n3"])], lent_jobs,
                                 pending={"H100": 2}))  # the queue's 2 fit beside the 2 given back
    (grow,) = kinds(r, GrowTraining)
    assert grow.new_size == 6 and grow.nodes == ("n1",) and "give back 2" in grow.reason
    assert r.state.lent == {}


def test_queued_training_is_admitted_before_lent_accelerators_go_back():
    """Free accelerators the queue needs stay free for admission; lenders get only the rest.
    (Lenders-first made shared lose to whole-job preemption on JCT in the simulator.)"""
    lent = AutoscalerState(lent={"a": 2})
    jobs = [train("a", ["n0", "n0"], max_size=8)]
    free = {"n0": 0, "n1": 4, "n2": 0, "n3": 0}
    waiting = obs(720, free, [serve(1, 1, nodes=["n3"])], jobs, pending={"H100": 4})
    assert not kinds(AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0)).decide(lent, waiting), GrowTraining)
    lenders_first = AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0, reserve_for_queue=False))
    (grow,) = kinds(lenders_first.decide(lent, waiting), GrowTraining)
    assert grow.new_size == 6 and "give back 2" in grow.reason  # takes 2 of the 4 the queue waits for


def test_no_growth_while_serve_is_at_risk():
    policy = AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0))
    jobs = [train("a", ["n0"], max_size=8)]
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 0, "n1": 8, "n2": 0, "n3": 0}, [serve(1, 1, ttft=0.95)], jobs))
    assert not kinds(r, GrowTraining) and kinds(r, ScaleServe)


def test_elastic_at_minimum_preempted_whole_only_as_last_resort_after_a_snapshot():
    policy = AutoscalerPolicy()
    jobs = [train("g", ["n0", "n0"], cls=JobClass.GUARANTEED), train("e", ["n1", "n1", "n2"], min_size=4)]
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 0, "n1": 0, "n2": 2, "n3": 0}, [serve(0, 5)], jobs))
    (shrink,) = kinds(r, ShrinkTraining)
    assert shrink.job_id == "e" and shrink.preempted and shrink.snapshot_first and "last resort" in shrink.reason
    assert kinds(r, ScaleServe)[0].target_replicas == 2


def test_at_risk_adds_one_replica_at_a_time_while_one_is_loading():
    """A regression: with 1 s ticks, TTFT stays high while the lent replica loads its model;
    counting the pending replica as help on its way keeps the policy from lending again each tick."""
    policy = AutoscalerPolicy()
    jobs = [train("t", ["n0", "n1", "n2", "n3"], replica_size=4, min_size=4)]
    free = {"n0": 0, "n1": 0, "n2": 0, "n3": 0}
    hot = ServeObservation("chat", "H100", 4, 1, 1, pending_replicas=1, replica_nodes=("n0", "n1"),
                           ttft_p95_s=0.95, ttft_slo_s=1.0)
    r = policy.decide(AutoscalerState(), obs(0, free, [hot], jobs))
    assert not r.decisions
    r = policy.decide(AutoscalerState(), obs(0, free, [ServeObservation(
        "chat", "H100", 4, 1, 1, replica_nodes=("n0",), ttft_p95_s=0.95, ttft_slo_s=1.0)],
        [train("t", ["n0", "n0", "n1", "n1"], replica_size=2, min_size=2)]))
    assert kinds(r, ScaleServe) and kinds(r, ShrinkTraining)  # no replica on its way: lend


def test_a_resizing_job_is_neither_grown_nor_lets_others_grow():
    policy = AutoscalerPolicy(AutoscalerConfig(job_resize_cooldown_s=0))
    moving = TrainingObservation("a", "q", "H100", JobClass.ELASTIC, 2, 1, 4, 1, (), resizing=True)
    other = train("b", ["n2"], replica_size=1, min_size=1, max_size=4)
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 4, "n1": 4, "n2": 0, "n3": 0}, [], [moving, other]))
    assert not kinds(r, GrowTraining)
    still = TrainingObservation("a", "q", "H100", JobClass.ELASTIC, 2, 1, 4, 1, (("n0",), ("n0",)))
    r = policy.decide(AutoscalerState(), obs(0, {"n0": 4, "n1": 4, "n2": 0, "n3": 0}, [], [still, other]))
    assert {d.job_id for d in kinds(r, GrowTraining)} == {"a", "b"}


def test_a_replica_still_loading_is_not_scaled_away():
    """Regression (demo): load dipped while the lent replica was still starting; the policy
    decided to remove it, the shell could not (it only removes running replicas), and the
    logged decision never happened. Only running replicas above the minimum may go."""
    policy = AutoscalerPolicy(AutoscalerConfig(scale_down_after_s=3))
    free = {n: 0 for n in NODES}
    loading = ServeObservation("chat", "H100", 4, running_replicas=1, desired_replicas=1, pending_replicas=1,
                               replica_nodes=("n3", "n1"), ttft_p95_s=0.1, ttft_slo_s=1.0)
    state = AutoscalerState()
    for t in (0, 2, 4, 6, 10):
        r = policy.decide(state, obs(t, free, [loading], []))
        state = r.state
        assert not kinds(r, ScaleServe), (t, r.decisions)
    # once it runs (seen at t=12), a window after it was last seen loading (t=13) the low window
    # starts; when it has passed whole, the replica goes, and only it
    running = ServeObservation("chat", "H100", 4, running_replicas=2, desired_replicas=1,
                               replica_nodes=("n3", "n1"), ttft_p95_s=0.1, ttft_slo_s=1.0)
    for t in (12, 13, 15):
        r = policy.decide(state, obs(t, free, [running], []))
        state = r.state
        assert not kinds(r, ScaleServe), (t, r.decisions)
    (down,) = kinds(policy.decide(state, obs(16, free, [running], [])), ScaleServe)
    assert down.remove_from_nodes == ("n1",) and down.target_replicas == 1 and "load low for 3s" in down.reason
