"""Regression: the quickstart notebook's lend flapped (fresh-clone run, read from the fleet's events).

Fleet: n0000 with 4 H100s (n0001 cordoned); Serve ``nb-burst`` has one 1-accelerator replica
there (max 2); the elastic job ``nb-elastic`` (2..3 workers, one accelerator per DP replica)
holds the other three. Config as in the notebook: 1 s ticks, ``scale_down_after_s=3``,
``job_resize_cooldown_s=5``. What happened (seconds from the autoscaler's start):

    31.1  ScaleServe +1, ShrinkTraining 3->2          (Serve wants 2, has 1)
    60.1  handover: the lent replica serves (28.9 s)
    61.3  ScaleServe -1 "load low for 3s"             <- burst still running
    66.4  ScaleServe +1, ShrinkTraining preempted whole (the job at its minimum)
    165.8 handover 99.4 s (90 s of it the Serve shell's settle fallback)
    173.6 the replica removed; no GrowTraining for the paused job, ever

Each test replays a part of it against the real policy and fails on the code before the fix.
"""

from rayfleet.platform.autoscaler.policy import (
    AutoscalerConfig, AutoscalerPolicy, AutoscalerState, FleetObservation, GrowTraining, ScaleServe,
    ServeObservation, ShrinkTraining, TrainingObservation,
)
from rayfleet.platform.queues import JobClass

NODES = {"n0000": "H100"}
NOTEBOOK = AutoscalerConfig(scale_down_after_s=3.0, job_resize_cooldown_s=5.0)


def burst(running, desired, *, pending=0, unplaced=False, ttft=0.3, age=0.0):
    """Serve's report: the base replica on n0000 plus lent ones (also on n0000)."""
    return ServeObservation("nb-burst", "H100", 1, running, desired, pending_replicas=pending,
                            replica_nodes=("n0000",) * (running + pending), min_replicas=1, max_replicas=2,
                            ttft_p95_s=ttft, ttft_slo_s=2.0, unplaced_nodes=("n0000",) if unplaced else (),
                            load_age_s=age)


def job(size, *, resizing=False):
    nodes = () if resizing else (("n0000",),) * size
    return TrainingObservation("nb-elastic", "q", "H100", JobClass.ELASTIC, size, 2, 3, 1, nodes,
                               admitted_size=3, resizing=resizing)


def step(policy, state, now, free, serve, training):
    r = policy.decide(state, FleetObservation(now, {"n0000": free}, NODES, (serve,), (training,)))
    return r.state, r.decisions


def of(decisions, cls):
    return [d for d in decisions if isinstance(d, cls)]


def lend(policy):
    """t=31: the burst makes Serve want 2; the job (3 workers) is shrunk by one DP replica."""
    state, decisions = step(policy, AutoscalerState(), 31.0, 0, burst(1, 2), job(3))
    (up,) = of(decisions, ScaleServe)
    (shrink,) = of(decisions, ShrinkTraining)
    assert up.add_on_nodes == ("n0000",) and shrink.new_size == 2
    assert up.reforming == ("nb-elastic",)  # the shell waits for the job's new layout
    return state


def test_no_scale_down_right_after_the_lend_while_the_burst_runs():
    """The replica loads for 29 s; Serve's in-flight count is noisy (the shell samples it once a
    tick), so some readings say 'Serve wants 1'. A low window that began while the replica
    loaded removed it 1 s after it served. Now: no reading before a window after it runs
    starts one, and a reading of the burst (wants 2) restarts it."""
    policy = AutoscalerPolicy(NOTEBOOK)
    state = lend(policy)
    for t in range(32, 60):  # loading: desired dips to 1 (low readings), the job re-forms
        state, decisions = step(policy, state, float(t), 0, burst(1, 1, pending=1, unplaced=t < 45),
                                job(2, resizing=t < 50))
        assert not of(decisions, ScaleServe), (t, decisions)
    # it serves from t=60; the burst goes on for 5 s (rayfleet/demo.py sleeps 5 s), its readings noisy
    readings = {60: 1, 61: 1, 62: 1, 63: 1, 64: 2, 65: 1}
    for t, desired in readings.items():
        state, decisions = step(policy, state, float(t), 0, burst(2, desired), job(2))
        assert not of(decisions, ScaleServe), (t, decisions)  # the old code: "load low for 3s" at t=60
    # the burst is over: once the window that began at t=65 has passed whole, the lent replica goes
    for t in (66, 67):
        state, decisions = step(policy, state, float(t), 0, burst(2, 1, ttft=0.1), job(2))
        assert not of(decisions, ScaleServe), (t, decisions)
    state, decisions = step(policy, state, 68.0, 0, burst(2, 1, ttft=0.1), job(2))
    (down,) = of(decisions, ScaleServe)
    assert down.remove_from_nodes == ("n0000",) and down.target_replicas == 1 and "load low for 3s" in down.reason


def test_worst_case_readings_after_the_lend_keep_the_replica_past_the_demos_burst():
    """rayfleet/demo.py keeps its burst on 5 s after it sees the lent replica serve. Even if
    every reading from then on says 'wants 1', the replica stays until two windows (6 s) after
    a tick last saw it loading, so at the earliest (that tick 1 s before it served) when the
    burst ends; a last reading of the burst's in-flight requests after that is a reversal,
    which cannot preempt the job whole (next test)."""
    policy = AutoscalerPolicy(NOTEBOOK)
    state = lend(policy)
    last_loading = 59.0
    for t in range(32, 60):
        state, _ = step(policy, state, float(t), 0, burst(1, 1, pending=1), job(2))
    removed_at = None
    for t in range(60, 80):
        state, decisions = step(policy, state, float(t), 0, burst(2, 1, ttft=0.1), job(2))
        if of(decisions, ScaleServe):
            removed_at = float(t)
            break
    assert removed_at == last_loading + 2 * NOTEBOOK.scale_down_after_s  # 65 s: served at 60, burst until >= 65


def test_reversing_a_scale_down_never_preempts_the_lender_whole():
    """t=61.3 scaled Serve down (its replica drains, 7 s); t=66.4 the burst wanted 2 again and
    the only lend left was the job at its minimum, taken whole. The drained replica's
    accelerator comes back by itself: the reversal waits for it instead."""
    policy = AutoscalerPolicy(NOTEBOOK)
    # the old sequence's state: the lend at 31, the scale-down at 61.3 (the job is back to stepping at 2)
    state = AutoscalerState(lent={"nb-elastic": 1}, scaled_down_at={"nb-burst": 61.3})
    state, decisions = step(policy, state, 66.4, 0, burst(1, 2), job(2))
    assert not of(decisions, ShrinkTraining), decisions  # the old code: preempted whole
    assert not of(decisions, ScaleServe)
    # 68.4: the drained replica let go of its accelerator: the reversal takes it, nothing re-forms
    state, decisions = step(policy, state, 68.4, 1, burst(1, 2), job(2))
    (up,) = of(decisions, ScaleServe)
    assert up.add_on_nodes == ("n0000",) and up.reforming == () and not of(decisions, ShrinkTraining)
    # without a recent scale-down the same need still takes the job whole (the last resort stays)
    _, decisions = step(policy, AutoscalerState(), 66.4, 0, burst(1, 2), job(2))
    (shrink,) = of(decisions, ShrinkTraining)
    assert shrink.preempted and "last resort" in shrink.reason
    assert of(decisions, ScaleServe)[0].reforming == ()  # a paused lender re-forms nothing: start at once
    # the guard lasts max(scale_down_after_s, reversal_guard_s) (120 s by default), then lapses
    late = AutoscalerState(scaled_down_at={"nb-burst": 61.3})
    _, decisions = step(policy, late, 61.3 + NOTEBOOK.reversal_guard_s + 1, 0, burst(1, 2), job(2))
    assert of(decisions, ShrinkTraining)[0].preempted


def test_a_job_preempted_whole_is_grown_back_on_the_next_tick_when_room_is_free():
    """After the replica was removed (173.6) the paused job got nothing for minutes: its shell
    reported it resizing (no growth at all while a job resizes), and the resize cooldown would
    have held it anyway (600 s by default). A paused job is grown as soon as its minimum fits."""
    policy = AutoscalerPolicy(AutoscalerConfig(scale_down_after_s=3.0))  # default cooldown: 600 s
    state, decisions = step(policy, AutoscalerState(), 66.4, 0, burst(1, 2), job(2))
    assert of(decisions, ShrinkTraining)[0].preempted
    paused = TrainingObservation("nb-elastic", "q", "H100", JobClass.ELASTIC, 0, 2, 3, 1, (), admitted_size=3)
    assert paused.paused
    # the lent replica holds one accelerator, one is free: below the job's minimum of 2, no grow
    state, decisions = step(policy, state, 80.0, 1, burst(2, 2), paused)
    assert not of(decisions, GrowTraining)
    # 173.6: the replica is removed; at the next tick the job gets all three back
    _, decisions = step(policy, state, 174.0, 3, burst(1, 1, ttft=0.1), paused)
    (grow,) = of(decisions, GrowTraining)
    assert grow.new_size == 3 and grow.nodes == ("n0000",) * 3 and "give back 2" in grow.reason
    # the broken variant: a paused job reported as resizing is never grown
    stuck = TrainingObservation("nb-elastic", "q", "H100", JobClass.ELASTIC, 0, 2, 3, 1, (), resizing=True)
    _, decisions = step(policy, state, 174.0, 3, burst(1, 1, ttft=0.1), stuck)
    assert not of(decisions, GrowTraining)


def test_the_fresh_period_is_its_own_setting():
    """``fresh_after_scale_up_s`` sets how long a scale-up stays fresh after its replicas run
    (one hysteresis window unless set); 0 starts the low window as soon as nothing is loading."""
    def removed_at(config):
        policy = AutoscalerPolicy(config)
        state = lend(policy)
        for t in range(32, 60):
            state, _ = step(policy, state, float(t), 0, burst(1, 1, pending=1), job(2))
        for t in range(60, 90):
            state, decisions = step(policy, state, float(t), 0, burst(2, 1, ttft=0.1), job(2))
            if of(decisions, ScaleServe):
                return t
        return None

    assert removed_at(NOTEBOOK) == 65
    assert removed_at(AutoscalerConfig(scale_down_after_s=3.0, fresh_after_scale_up_s=10.0)) == 72  # 59 + 10 + 3
    assert removed_at(AutoscalerConfig(scale_down_after_s=3.0, fresh_after_scale_up_s=0.0)) == 63  # 60 + 3


def test_the_fresh_period_runs_on_the_figures_own_clock():
    """A pool whose load comes from exported metrics (a vLLM pool: Ray's agent exports every
    few seconds, the shell caches a scrape as long) reads its state ``load_age_s`` late. Seen
    live (vLLM tier, metrics 2 s apart, figures up to 4 s old): the burst paused while the lent
    engine started, the first figures after it ran still showed the pause, the low window began
    at once and the replica was removed while the resumed burst ran; the burst's late figures
    then lent a second accelerator. Counted on the figures' clock the low window starts 4 s
    later (the old code removed it at 65 either way)."""
    def removed_at(age):
        policy = AutoscalerPolicy(NOTEBOOK)
        state = lend(policy)
        for t in range(32, 60):
            state, _ = step(policy, state, float(t), 0, burst(1, 1, pending=1, age=age), job(2))
        for t in range(60, 90):
            state, decisions = step(policy, state, float(t), 0, burst(2, 1, ttft=0.1, age=age), job(2))
            if of(decisions, ScaleServe):
                return t
        return None

    assert removed_at(0.0) == 65  # fresh until 59 + 3, then 3 s low
    assert removed_at(4.0) == 69  # figures of 62 are read at 66


def test_a_scale_up_no_report_shows_yet_is_not_decided_again():
    """Regression (tests/cluster/test_autoscaler.py at load average 80): the Serve shell takes its
    decisions on its own tick and reports after, so the policy's next step (1 s later) still saw
    'Serve wants 2, has 1' and lent a second accelerator for the same need (two lent replicas,
    the job shrunk twice). A scale-up counts as on its way until a report shows it, for at most
    ``report_lag_s`` (a shell that lost it is asked again)."""
    policy = AutoscalerPolicy(NOTEBOOK)
    state = lend(policy)  # t=31
    state, decisions = step(policy, state, 32.0, 0, burst(1, 2), job(3))  # the same, stale report
    assert not decisions, decisions  # the old code: ScaleServe +1 and ShrinkTraining 3->2 again
    state, decisions = step(policy, state, 33.0, 0, burst(1, 2, pending=1, unplaced=True), job(2, resizing=True))
    assert not decisions and "nb-burst" not in state.scaling_to  # the report shows it: nothing left to wait for
    # a shell that never shows it: after report_lag_s the need is decided again
    state = lend(policy)
    state, decisions = step(policy, state, 31.0 + NOTEBOOK.report_lag_s - 1, 0, burst(1, 2), job(3))
    assert not decisions
    state, decisions = step(policy, state, 31.0 + NOTEBOOK.report_lag_s, 0, burst(1, 2), job(3))
    assert of(decisions, ScaleServe) and of(decisions, ShrinkTraining)
