"""The simulator caps training growth by the queues' limits, as the live controller does (no Ray).

The simulator builds the policy's observation itself; it now carries ``queue_limits`` from
``admission.growth_limits`` over the simulated jobs (and Serve as ``serving``'s guaranteed
workload), the function the live controller's autoscaler gets them from. Worked example: 64 H100
(8 nodes of 8), Serve's peak 3 replicas of 8 (queue ``serving``, quota 24), ``training`` 40 of
which ``research`` holds 28 with ``research_borrow_limit=0``. One elastic research job runs at 28
(7 DP replicas of 4, max 40), Serve runs its 3 replicas, 12 H100 are idle and nobody waits: the
policy would grow the job to 40; research may hold no more than 28, so it must stay there.
The broken variant (the observation without ``queue_limits``, as before) grows it to 40.
"""

from dataclasses import replace

import pytest

from rayfleet.platform.autoscaler.types import GrowTraining, QueueGrowthLimits
from rayfleet.platform.queues import JobClass, queue_usage
from rayfleet.platform.sim import SimConfig, build_simulation
from rayfleet.platform.sim import engine
from rayfleet.platform.sim.fleet import SimJob
from rayfleet.platform.sim.workload import TrainingArrival


def fleet_with_research_at_quota(borrow_limit):
    cfg = SimConfig(num_accelerators=64, days=0.1, research_borrow_limit=borrow_limit)
    sim = build_simulation("shared", cfg)
    sim.pending = {"prod": [], "research": []}
    arrival = TrainingArrival("r1", 0.0, size=40, min_size=4, replica_size=4, work_accel_s=1e9,
                              job_class=JobClass.ELASTIC, priority=0, queue="research")
    job = SimJob(arrival, min_size=4, kind="H100", start_s=0.0)
    for _ in range(7):
        job.replica_nodes.append(sim.fleet.place(4))
    job.changed()
    job.admitted_size = 40  # admitted smaller only for want of room: growth to 40 is its due
    sim.jobs["r1"] = job
    for _ in range(3):
        node = sim.fleet.place(8)
        sim.serve.append((node, 0.0))
    return sim


def grown_to(sim):
    grown = []
    grow = sim._grow
    sim._grow = lambda job, nodes, now: (grown.append((job.job_id, len(nodes))), grow(job, nodes, now))
    sim._act(3600.0, 3, 3, 0.1)  # Serve has what it wants at a low TTFT: nothing is short
    sim.check_invariants()
    return sim.jobs["r1"].size, grown


def test_research_queue_limit_caps_growth_in_the_simulator():
    sim = fleet_with_research_at_quota(0)
    assert sim.tree.queues["research"].ceiling_of("H100") == 28 and sum(sim.fleet.free.values()) == 12
    size, grown = grown_to(sim)
    assert size == 28 and grown == []
    assert queue_usage(sim.tree, [j.workload() for j in sim.jobs.values()], "H100")["research"] <= 28


def test_research_grows_into_its_borrow_limit_and_no_further():
    size, _ = grown_to(fleet_with_research_at_quota(8))
    assert size == 36  # 28 + 8 borrowed; 4 more are idle but beyond the borrow limit


def test_broken_variant_without_queue_limits_grows_past_the_limit(monkeypatch):
    monkeypatch.setattr(engine, "growth_limits", lambda tree, records: QueueGrowthLimits())
    size, grown = grown_to(fleet_with_research_at_quota(0))
    assert size == 40 and grown == [("r1", 3)]  # what the simulator did before it passed queue_limits


def test_unlimited_borrowing_grows_into_every_idle_accelerator():
    """The default simulator (no borrow limit): the limits bind nothing the fleet does not."""
    size, _ = grown_to(fleet_with_research_at_quota(None))
    assert size == 40
