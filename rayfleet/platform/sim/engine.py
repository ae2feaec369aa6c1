"""Discrete-time event simulation of one shared fleet under one sharing policy.

Design decisions:
- Fixed ticks (``tick_s``, 60 s by default) rather than an event heap: the policy is meant to
  run on a control-loop period anyway, and inference demand changes continuously. Within a tick,
  events are applied in a fixed order: arrivals -> training progress and completions -> Serve
  replicas becoming ready and the tick's SLO accounting -> policy decisions -> queue admission.
  Delays shorter than a tick (snapshot, restart, model load) are kept exactly as timestamps.
- The policy under test is the *same* :class:`AutoscalerPolicy` object the controller runs; the
  simulator only builds its observation and carries out its decisions. Baselines are the same
  policy configured differently (:mod:`rayfleet.platform.sim.baselines`).
- Training admission uses :func:`rayfleet.platform.queues.admit` on a queue tree
  ``root -> serving | training -> prod | research`` where Serve's replicas count as a
  guaranteed workload of ``serving`` (so training borrows Serve's idle quota). The policy's
  observation carries the queues' growth limits (``admission.growth_limits``, the function the
  live controller gives its autoscaler), so growth obeys borrow limits in both.
- Training progress is linear in accelerators (work in accelerator-seconds): a resize changes the
  rate, a pause (snapshot + restart) stops it, and a paused job's accelerators are held but not
  utilized. Lost work: pauses x size, and on a whole-job
  preemption the work since the last snapshot.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from rayfleet.platform.admission import AdmissionRecord, growth_limits
from rayfleet.platform.autoscaler.policy import (
    AutoscalerState, FleetObservation, GrowTraining, RequestNodes, ScaleServe, ServeObservation, ShrinkTraining,
)
from rayfleet.platform.queues import JobClass, Queue, QueueTree, Workload, admit, queue_usage
from rayfleet.platform.sim.costs import CostModel
from rayfleet.platform.sim.fleet import SimFleet, SimJob
from rayfleet.platform.sim.sim_metrics import MetricsRecorder, SimResult
from rayfleet.platform.sim.workload import DemandModel, default_trace_dir, load_philly_arrivals, load_request_costs

__all__ = ["SimConfig", "Simulation"]

DAY_S = 86_400.0


@dataclass(frozen=True)
class SimConfig:
    num_accelerators: int = 1024
    accelerators_per_node: int = 8
    accelerator_type: str = "H100"
    days: float = 7.0
    tick_s: float = 60.0
    seed: int = 0
    inference_peak_share: float = 0.4  # share of the fleet Serve needs at the diurnal peak (at target utilization)
    peak_to_trough: float = 3.0
    bursts_per_day: float = 3.0
    serve_replica_accelerators: int = 8  # one replica = one node (e.g. an EP8 decode replica)
    train_replica_accelerators: int = 4  # one DP replica = half a node (TP4)
    # Offered training work / the accelerators training owns by quota. Above 1: training always
    # has queued work (as on real shared fleets), so idle accelerators are the policy's doing.
    training_load_factor: float = 1.6
    # Offered load of the whole fleet (training work + inference's mean need at the target
    # utilization) / accelerators. When set, it replaces ``training_load_factor``: below 1 the
    # fleet is not saturated, so policies differ in how fast they run jobs, not only in how
    # full they keep the fleet (at 1.6 every policy is near 100% and queues grow all week).
    offered_load: float | None = None
    warmup_s: float = 12 * 3600.0  # metrics ignore the first hours (the fleet starts empty)
    size_scale: int = 8
    max_job_duration_s: float = 2 * DAY_S
    admission_attempts_per_tick: int = 24
    # Extra accelerators the research queue may borrow above its quota (None: any idle ones, as
    # Kueue's default cohort). Admission and the autoscaler's growth both hold to it.
    research_borrow_limit: int | None = None
    admission_scan_per_tick: int = 400
    costs: CostModel = field(default_factory=CostModel)
    trace_dir: Path = field(default_factory=default_trace_dir)

    @property
    def peak_serve_replicas(self) -> int:
        """Replicas Serve needs at the diurnal peak (the static split's partition)."""
        return max(1, round(self.inference_peak_share * self.num_accelerators / self.serve_replica_accelerators))

    def mean_inference_share(self) -> float:
        """Inference's mean need as a share of the fleet: the diurnal envelope's mean (bursts left out)."""
        return self.inference_peak_share * (1 + 1 / self.peak_to_trough) / 2

    def training_load(self) -> float:
        """Offered training work / the accelerators training owns by quota (from ``offered_load`` when set)."""
        if self.offered_load is None:
            return self.training_load_factor
        if not 0.0 < self.offered_load <= 2.0:
            raise ValueError(f"offered_load={self.offered_load}: use a share of capacity in (0, 2], e.g. 0.8")
        train_share = 1 - self.peak_serve_replicas * self.serve_replica_accelerators / self.num_accelerators
        return max(0.01, self.offered_load - self.mean_inference_share()) / train_share


class Simulation:
    """Run one policy over the configured fleet and workload; :meth:`run` returns the metrics."""

    def __init__(self, config: SimConfig, policy, *, mode: str, whole_job_preemption: bool = False,
                 elastic_admission: bool = True, static_serve_replicas: int | None = None,
                 admit_at_full_size: bool = False) -> None:
        self.cfg, self.policy, self.mode = config, policy, mode
        self.whole_job_preemption = whole_job_preemption
        self.elastic_admission = elastic_admission
        self.admit_at_full_size = admit_at_full_size  # elastic jobs still shrink to min when lending
        self.static_serve_replicas = static_serve_replicas
        c = config
        self.fleet = SimFleet(c.num_accelerators // c.accelerators_per_node, c.accelerators_per_node, c.accelerator_type)
        serve_quota = c.peak_serve_replicas * c.serve_replica_accelerators
        train_quota = c.num_accelerators - serve_quota
        prod_quota = int(0.3 * train_quota) // c.train_replica_accelerators * c.train_replica_accelerators
        k = c.accelerator_type
        self.tree = QueueTree.build([
            Queue("root", None, {k: c.num_accelerators}),
            Queue("serving", "root", {k: serve_quota}, priority=10),
            Queue("training", "root", {k: train_quota}),
            Queue("prod", "training", {k: prod_quota}, priority=1),
            Queue("research", "training", {k: train_quota - prod_quota},
                  None if c.research_borrow_limit is None else {k: c.research_borrow_limit}),
        ])
        self.arrivals = load_philly_arrivals(
            c.trace_dir / "philly_jobs.csv", horizon_s=c.days * DAY_S, training_accelerators=train_quota,
            load_factor=c.training_load(), size_scale=c.size_scale, replica_size=c.train_replica_accelerators,
            max_duration_s=c.max_job_duration_s, seed=c.seed)
        self.request_costs = load_request_costs(c.trace_dir / "azure2023_conv.csv")
        self.demand = DemandModel(peak_replicas=c.peak_serve_replicas * c.costs.target_utilization,
                                  peak_to_trough=c.peak_to_trough, bursts_per_day=c.bursts_per_day, seed=c.seed)
        self.rng = random.Random(c.seed + 1)
        self.jobs: dict[str, SimJob] = {}
        self.pending: dict[str, list[SimJob]] = {"prod": [], "research": []}
        self.serve: list[tuple[str, float]] = []  # (node, ready_at)
        self.state = AutoscalerState()
        self.metrics = MetricsRecorder(num_accelerators=c.num_accelerators, tick_s=c.tick_s)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        c = self.cfg
        next_arrival = 0
        for step in range(int(c.days * DAY_S / c.tick_s)):
            now = step * c.tick_s
            while next_arrival < len(self.arrivals) and self.arrivals[next_arrival].arrival_s <= now:
                a = self.arrivals[next_arrival]
                min_size = a.min_size if self.elastic_admission else a.size
                job = SimJob(a, min_size=min_size, kind=c.accelerator_type, queued_since=a.arrival_s)
                self.pending[a.queue].append(job)
                next_arrival += 1
            self._progress(now)
            load = self.demand.demand(now, self.request_costs)
            running = sum(1 for _, ready in self.serve if ready <= now)
            rho = load / running if running else math.inf
            slo_util = c.costs.slo_utilization
            within = 1.0 if rho <= slo_util else slo_util / rho
            desired = max(1, math.ceil(load / c.costs.target_utilization))
            ttft = c.costs.ttft_base_s / (1 - rho) if rho < 0.99 else 100 * c.costs.ttft_slo_s
            self._act(now, desired, running, min(ttft, 100 * c.costs.ttft_slo_s))
            self._admit(now)
            # Utilized = stepping: a job pausing for a snapshot or restart holds its accelerators
            # but does no work on them (it counts in ``held`` only).
            training = sum(j.size for j in self.jobs.values() if j.paused_until <= now)
            self.metrics.recording = now >= c.warmup_s
            self.metrics.sample(now=now, load=load, within_slo=within, desired=desired,
                                serve_held=len(self.serve) * c.serve_replica_accelerators,
                                serve_useful=min(len(self.serve), desired) * c.serve_replica_accelerators,
                                training=training, training_held=sum(j.size for j in self.jobs.values()),
                                queued=sum(len(p) for p in self.pending.values()))
        return self.metrics.result(mode=self.mode, config=c, jobs_running=list(self.jobs.values()),
                                   pending=[j for p in self.pending.values() for j in p], end_s=c.days * DAY_S)

    def check_invariants(self) -> None:
        """Every accelerator is free, held by one training replica, or held by one Serve replica."""
        held = {n: 0 for n in self.fleet.nodes}
        for job in self.jobs.values():
            assert job.size == len(job.replica_nodes) * job.arrival.replica_size, job.job_id
            assert job.size >= job.min_size, (job.job_id, job.size, job.min_size)  # gang minimum
            for node in job.replica_nodes:
                held[node] += job.arrival.replica_size
        for node, _ in self.serve:
            held[node] += self.cfg.serve_replica_accelerators
        for node, count in held.items():
            assert count + self.fleet.free[node] == self.fleet.per_node, (node, count, self.fleet.free[node])

    def _progress(self, now: float) -> None:
        dt, costs = self.cfg.tick_s, self.cfg.costs
        for job in list(self.jobs.values()):
            active = max(0.0, now - max(now - dt, job.paused_until))
            if active <= 0:
                continue
            job.work_done += job.size * active
            self.metrics.useful_accel_s += job.size * active
            snap = now - (now - job.start_s) % costs.snapshot_interval_s
            if snap > job.last_snapshot_s:
                job.last_snapshot_s = snap
                job._obs = None  # only the observation shows snapshots
            if job.work_done >= job.arrival.work_accel_s:
                overshoot = (job.work_done - job.arrival.work_accel_s) / job.size
                self.metrics.useful_accel_s -= job.work_done - job.arrival.work_accel_s
                self.metrics.completed(job, finished_s=now - overshoot)
                self._release(job)
                del self.jobs[job.job_id]

    def _release(self, job: SimJob) -> None:
        for node in job.replica_nodes:
            self.fleet.give(node, job.arrival.replica_size)
        job.replica_nodes = []
        job.changed()

    # -- policy ---------------------------------------------------------------------------------
    def _act(self, now: float, desired: int, running: int, ttft: float) -> None:
        c = self.cfg
        static = self.static_serve_replicas
        serve = ServeObservation(
            deployment="chat", accelerator_type=c.accelerator_type, accelerators_per_replica=c.serve_replica_accelerators,
            running_replicas=running, pending_replicas=len(self.serve) - running,
            desired_replicas=static if static else desired,
            replica_nodes=tuple(n for n, ready in self.serve if ready <= now) + tuple(n for n, ready in self.serve if ready > now),
            min_replicas=static or 1, max_replicas=static or (1 << 30), ttft_p95_s=ttft, ttft_slo_s=c.costs.ttft_slo_s)
        as_class = JobClass.OPPORTUNISTIC if self.whole_job_preemption else None
        training = tuple(j.observation(as_class=as_class if j.arrival.job_class is not JobClass.GUARANTEED else None)
                         for j in self.jobs.values())
        pending = sum(j.min_size for p in self.pending.values() for j in p[:8])
        # Growth is capped by the queues as on the live fleet: the same growth_limits over the
        # same records (every running job holds its size; Serve is serving's guaranteed workload)
        records = [AdmissionRecord.running(w) for w in [j.workload() for j in self.jobs.values()]
                   + [self._serve_workload()]]
        obs = FleetObservation(now_s=now, free_by_node=dict(self.fleet.free), node_type=self.fleet.node_type,
                               serve=(serve,), training=training,
                               pending_training_accelerators={c.accelerator_type: pending} if pending else {},
                               queue_limits=growth_limits(self.tree, records))
        result = self.policy.decide(self.state, obs)
        self.state = result.state
        lent_nodes: set[str] = set()
        order = {ShrinkTraining: 0, ScaleServe: 1, GrowTraining: 2, RequestNodes: 3}
        for d in sorted(result.decisions, key=lambda d: order[type(d)]):
            if isinstance(d, ShrinkTraining):
                lent_nodes.update(d.freed_by_node)
                self._shrink(self.jobs[d.job_id], d.replicas, now, snapshot_first=d.snapshot_first)
            elif isinstance(d, ScaleServe):
                self._scale_serve(d, now, lent_nodes)
            elif isinstance(d, GrowTraining):
                self._grow(self.jobs[d.job_id], d.nodes, now)
            else:
                self.metrics.node_requests += 1

    def _shrink(self, job: SimJob, replicas, now: float, *, snapshot_first: bool) -> None:
        costs, rs = self.cfg.costs, job.arrival.replica_size
        drop = set(replicas)
        if len(drop) >= len(job.replica_nodes):  # whole-job preemption: back to the queue
            if snapshot_first:
                job.last_snapshot_s = now
                self.metrics.lost_accel_s += job.size * costs.snapshot_s
            rolled_back = min(job.work_done, job.size * (now - job.last_snapshot_s))
            job.work_done -= rolled_back
            self.metrics.useful_accel_s -= rolled_back
            self.metrics.lost_accel_s += rolled_back
            self.metrics.preemptions += 1
            job.preemptions += 1
            self._release(job)
            del self.jobs[job.job_id]
            job.queued_since = now
            self.pending[job.arrival.queue].insert(0, job)
            return
        for i in sorted(drop, reverse=True):
            self.fleet.give(job.replica_nodes.pop(i), rs)
        job.changed()
        pause = (costs.snapshot_s if snapshot_first else 0.0) + costs.restart_s
        self._pause(job, now, pause)
        job.last_snapshot_s = now
        job.resizes += 1
        self.metrics.resizes += 1
        job.changed()

    def _pause(self, job: SimJob, now: float, pause: float) -> None:
        start = max(now, job.paused_until)
        job.paused_until = start + pause
        self.metrics.lost_accel_s += job.size * pause

    def _grow(self, job: SimJob, nodes, now: float) -> None:
        for node in nodes:
            self.fleet.take(node, job.arrival.replica_size)
            job.replica_nodes.append(node)
        job.changed()
        self._pause(job, now, self.cfg.costs.restart_s)
        job.resizes += 1
        self.metrics.resizes += 1
        job.changed()

    def _scale_serve(self, d: ScaleServe, now: float, lent_nodes: set[str]) -> None:
        costs, per = self.cfg.costs, self.cfg.serve_replica_accelerators
        for node in d.add_on_nodes:
            self.fleet.take(node, per)
            load_s = costs.model_load_median_s * math.exp(costs.model_load_sigma * self.rng.gauss(0, 1))
            lent = node in lent_nodes
            handover = (costs.snapshot_s + costs.teardown_s if lent else 0.0) + load_s
            self.serve.append((node, now + handover))
            self.metrics.handover(handover, lent=lent)
        for node in d.remove_from_nodes:
            here = [i for i, (n, _) in enumerate(self.serve) if n == node]
            index = max([i for i in here if self.serve[i][1] <= now] or here)  # a running one (policy doc)
            self.serve.pop(index)
            self.fleet.give(node, per)

    def _serve_workload(self) -> Workload:
        """Serve's replicas as a guaranteed workload of queue ``serving`` (module doc)."""
        held = max(1, len(self.serve) * self.cfg.serve_replica_accelerators)
        return Workload("serve", "serving", self.cfg.accelerator_type, held, 1, held, 1, JobClass.GUARANTEED)

    # -- admission --------------------------------------------------------------------------------
    def _admit(self, now: float) -> None:
        c, kind = self.cfg, self.cfg.accelerator_type
        serve_load = self._serve_workload()
        running = [j.workload() for j in self.jobs.values()] + [serve_load]
        usage = queue_usage(self.tree, running, kind)
        for queue in ("prod", "research"):
            waiting = self.pending[queue]
            i = attempts = 0  # a per-queue budget: one queue's stuck head does not starve the other
            # Best-effort FIFO (Kueue's default): a head job that does not fit does not block
            # smaller ones behind it; the scan is bounded per tick.
            while i < min(len(waiting), c.admission_scan_per_tick) and attempts < c.admission_attempts_per_tick:
                job = waiting[i]
                free = self.fleet.placeable(job.arrival.replica_size) * job.arrival.replica_size
                gang = job.arrival.size if self.admit_at_full_size else job.min_size
                if free < gang and usage[queue] + job.min_size > self.tree.queues[queue].quota_of(kind):
                    i += 1  # neither idle room nor a guarantee to reclaim with: skip without asking
                    continue
                attempts += 1
                request = job.workload(pending=True)
                if self.admit_at_full_size:
                    request = replace(request, min_size=request.max_size)
                decision = admit(self.tree, request, running=running, free={kind: free}, usage=usage)
                if not decision.admitted:
                    i += 1
                    continue
                for reclaim in decision.reclaims:
                    victim = self.jobs[reclaim.job_id]
                    keep = reclaim.new_size // victim.arrival.replica_size
                    self._shrink(victim, range(keep, len(victim.replica_nodes)), now, snapshot_first=not reclaim.preempted)
                for _ in range(decision.size // job.arrival.replica_size):
                    node = self.fleet.place(job.arrival.replica_size)
                    assert node is not None, "admission counted placeable replicas"
                    job.replica_nodes.append(node)
                waiting.pop(i)
                job.changed()
                job.admitted_size = job.size
                if job.start_s is None:
                    job.start_s = now
                else:  # re-admitted after a preemption: restart from its snapshot
                    self._pause(job, now, c.costs.restart_s)
                job.queue_wait_s += now - job.queued_since
                job.changed()
                self.jobs[job.job_id] = job
                if decision.reclaims:
                    running = [j.workload() for j in self.jobs.values()] + [serve_load]
                    usage = queue_usage(self.tree, running, kind)
                else:
                    running.append(job.workload())
                    for name in self.tree.path(queue):
                        usage[name] += job.size
