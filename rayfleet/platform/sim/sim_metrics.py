"""What the colocation simulator measures, and how.

- *Utilization*: time-average share of accelerators doing work that needs them: training jobs
  that are stepping (a job pausing for a snapshot, restart or resize holds its accelerators but
  is not counted) plus Serve replicas up to the number its load needs at the target utilization. Serve replicas beyond that (a static
  partition at night, the hysteresis tail) count as idle; ``held_share`` counts them too.
- *SLO attainment*: request-weighted share of requests whose TTFT meets the SLO (per tick:
  all of them while replica utilization is below the SLO utilization, else the share that the
  capacity covers); ``slo_time_share`` is the share of ticks fully within the SLO.
- *Training work lost*: accelerator-seconds paused for snapshots/restarts plus work rolled back by
  whole-job preemptions, over useful + lost.
- *Job completion time*: over every job that arrived (the same set for every policy on a
  seed); a job still queued or running at the end counts with its age so far (a lower bound,
  ``censored_jobs`` says how many), so a policy that leaves more jobs unfinished is not
  rewarded by survivor bias. Queueing delay likewise includes time still waiting.
- *Handover*: decision -> Serve replica running, for replicas placed on accelerators lent by
  training (the number the sharing design is about) and for all replicas.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

__all__ = ["MetricsRecorder", "SimResult"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass(frozen=True)
class SimResult:
    mode: str
    num_accelerators: int
    days: float
    utilization: float
    held_share: float
    slo_attainment: float
    slo_time_share: float
    training_lost_share: float
    useful_training_accel_h: float
    lost_training_accel_h: float
    handover_lent_p50_s: float
    handover_lent_p99_s: float
    handover_all_p50_s: float
    handover_all_p99_s: float
    num_lent_handovers: int
    preemptions: int
    resizes: int
    node_requests: int
    jobs_arrived: int
    jobs_completed: int
    mean_jct_h: float
    p95_jct_h: float
    mean_queue_delay_h: float
    censored_jobs: int
    timeline: dict = field(repr=False, default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class MetricsRecorder:
    def __init__(self, *, num_accelerators: int, tick_s: float, timeline_every: int = 10) -> None:
        self.n, self.tick_s, self.every = num_accelerators, tick_s, timeline_every
        self.ticks = 0
        self.recording = True  # False during warm-up: time-averaged metrics skip those ticks
        self.useful_sum = self.held_sum = 0.0
        self.load_sum = self.within_sum = 0.0
        self.ticks_within = 0
        self.useful_accel_s = self.lost_accel_s = 0.0
        self.preemptions = self.resizes = self.node_requests = 0
        self.handover_lent: list[float] = []
        self.handover_all: list[float] = []
        self.jct: list[float] = []
        self.queue_delay: list[float] = []
        self.timeline = {"t_h": [], "utilization": [], "serve_demand": [], "serve_held": [], "training": [], "queued": []}

    def sample(self, *, now: float, load: float, within_slo: float, desired: int, serve_held: int, serve_useful: int,
               training: int, training_held: int, queued: int) -> None:
        if not self.recording:
            return
        self.ticks += 1
        self.useful_sum += (training + serve_useful) / self.n
        self.held_sum += (training_held + serve_held) / self.n
        self.load_sum += load
        self.within_sum += load * within_slo
        self.ticks_within += within_slo >= 1.0
        if self.ticks % self.every == 1:
            tl = self.timeline
            tl["t_h"].append(now / 3600)
            tl["utilization"].append((training + serve_useful) / self.n)
            tl["serve_demand"].append(load)
            tl["serve_held"].append(serve_held)
            tl["training"].append(training)
            tl["queued"].append(queued)

    def handover(self, seconds: float, *, lent: bool) -> None:
        self.handover_all.append(seconds)
        if lent:
            self.handover_lent.append(seconds)

    def completed(self, job, *, finished_s: float) -> None:
        self.jct.append(finished_s - job.arrival.arrival_s)
        self.queue_delay.append(job.queue_wait_s)

    def result(self, *, mode: str, config, jobs_running: list, pending: list, end_s: float) -> SimResult:
        ticks = max(1, self.ticks)
        unfinished = jobs_running + pending
        jct = self.jct + [end_s - j.arrival.arrival_s for j in unfinished]
        delay = self.queue_delay + [j.queue_wait_s for j in jobs_running] + [
            j.queue_wait_s + end_s - j.queued_since for j in pending]
        return SimResult(
            mode=mode, num_accelerators=self.n, days=config.days,
            utilization=self.useful_sum / ticks, held_share=self.held_sum / ticks,
            slo_attainment=self.within_sum / max(self.load_sum, 1e-9), slo_time_share=self.ticks_within / ticks,
            training_lost_share=self.lost_accel_s / max(1e-9, self.useful_accel_s + self.lost_accel_s),
            useful_training_accel_h=self.useful_accel_s / 3600, lost_training_accel_h=self.lost_accel_s / 3600,
            handover_lent_p50_s=_pct(self.handover_lent, 0.5), handover_lent_p99_s=_pct(self.handover_lent, 0.99),
            handover_all_p50_s=_pct(self.handover_all, 0.5), handover_all_p99_s=_pct(self.handover_all, 0.99),
            num_lent_handovers=len(self.handover_lent),
            preemptions=self.preemptions, resizes=self.resizes, node_requests=self.node_requests,
            jobs_arrived=len(self.jct) + len(jobs_running) + len(pending), jobs_completed=len(self.jct),
            mean_jct_h=statistics.fmean(jct) / 3600 if jct else float("nan"),
            p95_jct_h=_pct(jct, 0.95) / 3600,
            mean_queue_delay_h=statistics.fmean(delay) / 3600 if delay else float("nan"),
            censored_jobs=len(unfinished),
            timeline=self.timeline)
