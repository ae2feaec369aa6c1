"""Workloads for the colocation simulator: training arrivals from the Philly trace and an
inference demand envelope with request sizes from the Azure LLM trace.

Design decisions:
- Training: Microsoft Philly jobs (``traces/philly_jobs.csv``; CC BY 4.0, via
  petuum/adaptdl) in arrival order from a seeded offset. Arrival times are compressed so the
  offered training work equals ``load_factor`` x the accelerators training can use; GPU counts
  are multiplied by ``size_scale`` (Philly jobs are 1-128 GPUs; an MoE fleet's jobs are larger)
  and durations are capped (the trace has multi-week outliers that would not finish in a week).
  Each job's class (guaranteed / elastic / opportunistic) and priority are drawn with the seed.
- Inference: a diurnal envelope ``trough + (peak - trough) * (1 - cos(2 pi (t - phase) / day)) / 2``
  with peak:trough configurable (2:1 .. 5:1), plus unforecast bursts (Poisson arrivals,
  multiplicative height, minutes long). Demand is in *replica-equivalents at full load*; each
  tick's mean request cost comes from a sample of Azure conversation requests
  (``azure2023_conv.csv``; CC BY 4.0), so request-size noise is the trace's own.
"""

from __future__ import annotations

import csv
import functools
import math
import os
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rayfleet.errors import SpecError
from rayfleet.platform.queues import JobClass

__all__ = ["TrainingArrival", "load_philly_arrivals", "DemandModel", "load_request_costs", "default_trace_dir"]

DAY_S = 86_400.0


TRACE_DIR_ENV = "RAYFLEET_TRACE_DIR"


def default_trace_dir() -> Path:
    """Where the workload traces are: ``$RAYFLEET_TRACE_DIR`` if set, else the repository's
    ``traces/`` folder (shipped with their sources and licences in ``traces/README.md``).

    Raises ``SpecError`` naming the setting when that folder does not exist.
    """
    configured = os.environ.get(TRACE_DIR_ENV)
    path = Path(configured) if configured else Path(__file__).resolve().parents[3] / "traces"
    if not path.is_dir():
        raise SpecError(TRACE_DIR_ENV, str(path), "is not a folder of traces",
                        f"set {TRACE_DIR_ENV} to a folder holding philly_jobs.csv, azure2023_conv.csv and "
                        "mooncake_synthetic.jsonl (the repository's traces/ has them)")
    return path


@dataclass(frozen=True)
class TrainingArrival:
    job_id: str
    arrival_s: float
    size: int  # requested accelerators (= max size)
    min_size: int
    replica_size: int
    work_accel_s: float  # accelerator-seconds of useful work at any size (linear scaling)
    job_class: JobClass
    priority: int
    queue: str


def load_philly_arrivals(path: Path, *, horizon_s: float, training_accelerators: int, load_factor: float,
                         size_scale: int, replica_size: int, max_duration_s: float, seed: int,
                         class_mix: tuple[float, float, float] = (0.15, 0.7, 0.15)) -> list[TrainingArrival]:
    """Arrivals within ``horizon_s`` offering ``load_factor`` x ``training_accelerators`` of work.

    ``class_mix`` is (guaranteed, elastic, opportunistic) shares. Guaranteed jobs go to queue
    ``prod``, others to ``research``.
    """
    rows = _read_philly(str(path))
    rng = random.Random(seed)
    start = rng.randrange(len(rows) // 4)
    cap = max(replica_size, training_accelerators // 2 // replica_size * replica_size)

    def shape(num_gpus: int) -> int:
        size = max(replica_size, math.ceil(num_gpus * size_scale / replica_size) * replica_size)
        return min(size, cap)

    # Offered work per trace-second over the rest of the trace sets the time compression.
    window = rows[start:]
    span = max(1.0, window[-1][0] - window[0][0])
    rate = sum(shape(g) * min(d, max_duration_s) for _, d, g in window) / span
    compress = load_factor * training_accelerators / rate  # trace seconds per simulated second
    out: list[TrainingArrival] = []
    t0 = window[0][0]
    for i, (ts, duration, gpus) in enumerate(window):
        arrival = (ts - t0) / compress
        if arrival > horizon_s:
            break
        size = shape(gpus)
        draw = rng.random()
        cls = (JobClass.GUARANTEED if draw < class_mix[0] else
               JobClass.ELASTIC if draw < class_mix[0] + class_mix[1] else JobClass.OPPORTUNISTIC)
        min_size = size if cls is not JobClass.ELASTIC else max(replica_size, size // 2 // replica_size * replica_size)
        out.append(TrainingArrival(
            job_id=f"job-{i:06d}", arrival_s=arrival, size=size, min_size=min_size, replica_size=replica_size,
            work_accel_s=max(60.0, min(duration, max_duration_s)) * size, job_class=cls,
            priority=rng.choice((0, 0, 0, 1, 2)), queue="prod" if cls is JobClass.GUARANTEED else "research"))
    return out


@functools.lru_cache(maxsize=2)
def _read_philly(path: str) -> list[tuple[float, float, int]]:
    """(arrival timestamp, duration s, GPUs) sorted by arrival; cached: every policy reads it."""
    rows = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            ts = datetime.fromisoformat(row["timestamp"]).timestamp()
            rows.append((ts, float(row["duration"]), int(row["num_gpus"])))
    rows.sort()
    return rows


def load_request_costs(path: Path) -> list[float]:
    """Relative cost of each Azure request (prefill tokens + decode tokens weighted), mean 1.0.

    A decode token costs ``DECODE_WEIGHT`` prefill tokens of replica time (assumed: decode is
    memory-bound, ~one forward pass per token per batch slot).
    """
    decode_weight = 8.0
    costs = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            costs.append(int(row["ContextTokens"]) + decode_weight * int(row["GeneratedTokens"]))
    mean = sum(costs) / len(costs)
    return [c / mean for c in costs]


@dataclass
class DemandModel:
    """Inference demand (replica-equivalents at 100% utilization) over time. Seeded."""

    peak_replicas: float
    peak_to_trough: float = 3.0
    phase_s: float = 14 * 3600.0  # peak at 14:00
    bursts_per_day: float = 3.0
    burst_height: tuple[float, float] = (1.2, 1.6)  # multiplicative
    burst_minutes: tuple[float, float] = (10.0, 45.0)
    requests_per_tick: int = 256  # Azure requests sampled per tick for the size noise
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1.0 <= self.peak_to_trough <= 10.0:
            raise ValueError(f"peak_to_trough={self.peak_to_trough}: use 2..5 (diurnal ratio)")
        self._rng = random.Random(self.seed)
        self._bursts: list[tuple[float, float, float]] = []
        self._next_burst = self._rng.expovariate(self.bursts_per_day / DAY_S) if self.bursts_per_day else math.inf

    def envelope(self, t: float) -> float:
        trough = self.peak_replicas / self.peak_to_trough
        return trough + (self.peak_replicas - trough) * (1 - math.cos(2 * math.pi * (t - self.phase_s + DAY_S / 2) / DAY_S)) / 2

    def burst_factor(self, t: float) -> float:
        while self._next_burst <= t:
            length = 60 * self._rng.uniform(*self.burst_minutes)
            self._bursts.append((self._next_burst, self._next_burst + length, self._rng.uniform(*self.burst_height)))
            self._next_burst += self._rng.expovariate(self.bursts_per_day / DAY_S)
        self._bursts = [b for b in self._bursts if b[1] > t]
        return max([h for s, e, h in self._bursts if s <= t] or [1.0])

    def demand(self, t: float, request_costs: list[float]) -> float:
        sample = self._rng.choices(request_costs, k=self.requests_per_tick)
        return self.envelope(t) * self.burst_factor(t) * (sum(sample) / len(sample))
