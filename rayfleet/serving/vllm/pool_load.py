"""A vLLM pool's load for the shared autoscaler, from vLLM's own metrics.

The autoscaler's Serve shell (``serving.serve_scaling_shell``) reports, every tick, a pool's
requests in flight, its queue, its TTFT p95 over a window and its KV usage. The built-in engine's
ingress measures these itself; a Ray Serve LLM app has no such ingress, so for ``engine: vllm``
they come from the engines: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``
(gauges), ``vllm:kv_cache_usage_perc`` (gauge, 0..1) and the ``vllm:time_to_first_token_seconds``
histogram, as Ray's Prometheus endpoints export them (``metrics.scrape_vllm_metrics``; Ray
renames them ``ray_vllm_*`` and labels every series with the Serve replica's ``ReplicaId``).

Design decisions:
- vLLM's metrics rather than ``RayfleetLLMServer``'s routing stats: only colocated pools routed
  by rayfleet run that server class (Serve LLM's PD builder fixes its own), and the metrics are
  what a fleet's Prometheus and Grafana already show, so the autoscaler sees the same figures.
- Per replica, only the pool's live replicas (``ReplicaId`` in the ids the caller passes): a
  stopped replica's gauges linger in Ray's agent for up to two export intervals.
- in flight = Serve's ongoing requests at the replica (``serve_replica_processing_queries``,
  labelled ``replica``: what Serve's own autoscaling rule counts), or the engine's running +
  waiting when that is more. In a PD app a request is the decode replica's from the moment it
  arrives, while its prefill runs elsewhere: the decode engine's own gauges missed that part,
  which made the wanted replicas flap between 1 and 2 under a steady burst (seen live: the lent
  replica was drained 8 s after it started). Queue depth = the engines' waiting.
- TTFT p95 over the window: the histogram counts since the engine started, so the window's TTFTs
  are the bucket deltas between now and the sample taken ``window_s`` ago (``LoadWindow``); a
  replica that appeared since counts from zero, and so does one whose counts went down (its
  engine restarted). The quantile is Prometheus' ``histogram_quantile`` (linear within the
  bucket; the highest finite bound when it falls in ``+Inf``). No TTFT in the window: 0.
- Ray exports metrics every ``metrics_report_interval_ms`` (10 s by default), so these figures lag
  by up to that: the autoscaler reacts to a burst, and notices its end, that much later. The
  gauges are point samples: in flight and waiting are the highest over the window, so one low
  sample between busy ones does not drain a replica (seen live at load average 90: a steady
  3-client burst read as "load low" and the lent replica was drained).

The figures are pure functions of the samples (unit-tested without Ray); only
``VLLMPoolLoadSource`` scrapes and lists replicas.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Collection, Iterable, Mapping, Sequence

from rayfleet.serving.vllm.prometheus_scrape import MetricSample, named

__all__ = ["ReplicaSample", "PoolLoad", "replica_samples", "histogram_quantile", "window_buckets", "pool_load",
           "LoadWindow", "VLLMPoolLoadSource", "pool_replica_ids"]

TTFT_QUANTILE = 0.95


@dataclass(frozen=True)
class ReplicaSample:
    """One replica's engine figures at one scrape. ``ttft_buckets``: cumulative counts by
    upper bound in seconds (``math.inf`` last), as the histogram exports them."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    ongoing: float = 0.0  # Serve's requests in the replica (its whole life there, not only the engine's part)
    ttft_buckets: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class PoolLoad:
    """What the shell reports for the pool (see module doc)."""

    in_flight: int
    waiting: int
    ttft_p95_s: float
    num_ttft: int  # TTFTs observed in the window
    kv_usage_by_replica: Mapping[str, float] = field(default_factory=dict)

    def as_load(self) -> dict:
        """The shape of the built-in ingress's ``load()`` that ``serve_observation`` reads."""
        return {"in_flight": self.in_flight, "waiting_first_token": self.waiting, "ttft_p95_s": self.ttft_p95_s,
                "num_ttft": self.num_ttft}


def _bound(le: str) -> float:
    return math.inf if le in ("+Inf", "Inf", "inf") else float(le)


def replica_samples(samples: Iterable[MetricSample], replica_ids: Collection[str]) -> dict[str, ReplicaSample]:
    """Group a scrape by replica (vLLM's ``ReplicaId`` label, Serve's ``replica``), for
    ``replica_ids`` only (pure).

    Series of one replica that differ in other labels (vLLM's ``engine`` index under data
    parallelism) are summed; KV usage takes their maximum.
    """
    running: dict[str, float] = defaultdict(float)
    waiting: dict[str, float] = defaultdict(float)
    ongoing: dict[str, float] = defaultdict(float)
    kv: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for s in samples:
        if s.name.endswith("serve_replica_processing_queries") and s.labels.get("replica") in replica_ids:
            ongoing[s.labels["replica"]] += s.value
            continue
        replica = s.labels.get("ReplicaId", "")
        if replica not in replica_ids:
            continue
        if named(s.name, "num_requests_running"):
            running[replica] += s.value
        elif named(s.name, "num_requests_waiting"):
            waiting[replica] += s.value
        elif named(s.name, "kv_cache_usage_perc"):
            kv[replica] = max(kv[replica], s.value)
        elif named(s.name, "time_to_first_token_seconds_bucket") and "le" in s.labels:
            buckets[replica][_bound(s.labels["le"])] += s.value
    seen = set(running) | set(waiting) | set(kv) | set(buckets) | set(ongoing)
    return {r: ReplicaSample(running=running[r], waiting=waiting[r], kv_usage=kv[r], ongoing=ongoing[r],
                             ttft_buckets=tuple(sorted(buckets[r].items())))
            for r in seen}


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative ``(upper bound, count)`` pairs (pure):
    linear within the bucket holding the ``q``-th observation (from 0 for the first bucket);
    the highest finite bound when it lies in ``+Inf``; 0 for no observations.

    >>> histogram_quantile(0.95, [(0.1, 0), (0.5, 10), (1.0, 20), (math.inf, 20)])
    0.95
    >>> histogram_quantile(0.5, [(0.1, 0), (math.inf, 4)])
    0.1
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return 0.0
    rank = q * ordered[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank and count > prev_count:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = (bound if not math.isinf(bound) else prev_bound), count
    return prev_bound


def window_buckets(now: Mapping[str, ReplicaSample],
                   before: Mapping[str, ReplicaSample]) -> tuple[tuple[float, float], ...]:
    """The pool's TTFT histogram of the window: per replica ``now - before`` bucket by bucket,
    summed over replicas (pure; see module doc for new and restarted replicas)."""
    total: dict[float, float] = defaultdict(float)
    for replica, sample in now.items():
        base = dict(before[replica].ttft_buckets) if replica in before else {}
        current = dict(sample.ttft_buckets)
        if any(current.get(bound, 0.0) < count for bound, count in base.items()):
            base = {}  # its counts went down: a restarted engine, counted from zero
        for bound, count in current.items():
            total[bound] += count - base.get(bound, 0.0)
    return tuple(sorted(total.items()))


def pool_load(now: Mapping[str, ReplicaSample], before: Mapping[str, ReplicaSample]) -> PoolLoad:
    """The pool's load from two scrapes ``window_s`` apart (pure).

    >>> a = ReplicaSample(running=2, waiting=1, kv_usage=0.25, ttft_buckets=((0.5, 3), (1.0, 4), (math.inf, 4)))
    >>> b = ReplicaSample(running=0, waiting=0, kv_usage=0.5, ttft_buckets=((0.5, 0), (1.0, 0), (math.inf, 0)))
    >>> load = pool_load({"r1": a, "r2": b}, {})
    >>> (load.in_flight, load.waiting, round(load.ttft_p95_s, 6), load.num_ttft)
    (3, 1, 0.9, 4)
    """
    buckets = window_buckets(now, before)
    return PoolLoad(in_flight=round(sum(max(s.ongoing, s.running + s.waiting) for s in now.values())),
                    waiting=round(sum(s.waiting for s in now.values())),
                    ttft_p95_s=histogram_quantile(TTFT_QUANTILE, buckets),
                    num_ttft=round(buckets[-1][1]) if buckets else 0,
                    kv_usage_by_replica={r: s.kv_usage for r, s in now.items()})


class LoadWindow:
    """Scrapes over the last ``window_s`` seconds (pure: the caller passes the time).

    ``add(t, samples, live)`` returns the load against the newest scrape at least ``window_s`` old
    (the oldest one while the window is not yet full), in flight and waiting at their highest over
    the scrapes of the last ``window_s``, and forgets scrapes older than the baseline. The
    first scrape is its own baseline: what the engines counted before the shell started is not
    in its window.

    A scrape can miss a replica that is alive (its node's metrics endpoint timed out on a busy
    host, or Ray's agent had not exported it yet). ``live`` names the pool's replicas: one missing
    from a scrape keeps its last sample for ``carry_s``, so its gauges do not read as idle. And
    a replica's TTFT baseline is its oldest sample in the window, or failing that its last one
    before it: counting a replica seen before from zero would put every TTFT since its engine
    started in the window (seen live: after a burst, a TTFT p95 over the burst's slow requests
    lent a second accelerator to an idle pool). Only a replica never seen counts from zero.
    """

    def __init__(self, window_s: float, *, carry_s: float = 60.0) -> None:
        self.window_s = window_s
        self.carry_s = carry_s
        self._scrapes: deque[tuple[float, dict[str, ReplicaSample], PoolLoad]] = deque()
        self._last: dict[str, tuple[float, ReplicaSample]] = {}  # each replica's newest real sample

    def add(self, t: float, samples: Mapping[str, ReplicaSample], live: Collection[str] | None = None) -> PoolLoad:
        samples = dict(samples)
        if live is not None:
            for replica in live:
                seen = self._last.get(replica)
                if replica not in samples and seen is not None and t - seen[0] <= self.carry_s:
                    samples[replica] = seen[1]
        first = not self._scrapes
        baseline = samples if first else self._baseline(samples)
        load = pool_load(samples, baseline)
        self._scrapes.append((t, samples, load))
        while len(self._scrapes) > 1 and t - self._scrapes[1][0] >= self.window_s:
            self._scrapes.popleft()
        if not first:
            load = pool_load(samples, self._baseline(samples))
        for replica, sample in samples.items():
            if self._last.get(replica, (None, None))[1] is not sample:  # a carried sample keeps its age
                self._last[replica] = (t, sample)
        if live is not None:
            self._last = {r: v for r, v in self._last.items() if r in live}
        recent = [past for when, _, past in self._scrapes if t - when < self.window_s]
        return replace(load, in_flight=max(p.in_flight for p in recent), waiting=max(p.waiting for p in recent))

    def _baseline(self, now: Mapping[str, ReplicaSample]) -> dict[str, ReplicaSample]:
        """Per replica in ``now``: its sample in the oldest retained scrape holding it (the
        newest scrape, being ``now`` itself, excluded), else its last sample before, else none."""
        base: dict[str, ReplicaSample] = {}
        older = list(self._scrapes)
        if older and older[-1][1] is now:
            older = older[:-1]
        for _, scrape, _ in older:
            for replica, sample in scrape.items():
                base.setdefault(replica, sample)
        for replica in now:
            if replica not in base and replica in self._last:
                base[replica] = self._last[replica][1]
        return base


def pool_replica_ids(app_name: str, deployment: str) -> set[str]:
    """Serve's unique ids of the live replicas of ``deployment`` in ``app_name`` (what vLLM puts
    in ``ReplicaId``): replica actors are named ``SERVE_REPLICA::<app>#<deployment>#<id>``.
    From the GCS's table of named actors (a dead actor's name is freed), not the state API's
    list of every actor, which goes through the dashboard and cost far more every tick."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    named_actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"][len(prefix):] for a in named_actors if a["name"].startswith(prefix)}


POOL_LOAD_METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "time_to_first_token_seconds_bucket", "serve_replica_processing_queries")
"""The series ``replica_samples`` reads: the scrape parses only these."""


class VLLMPoolLoadSource:
    """The shell's load source for a vLLM pool (thin: scrape, list replicas, call the pure part)."""

    def __init__(self, app_name: str, deployment: str, *, window_s: float, min_interval_s: float | None = None) -> None:
        self.app_name, self.deployment = app_name, deployment
        self.window = LoadWindow(window_s)
        self.min_interval_s = min_interval_s  # None: the cluster's metrics export interval
        self._last: tuple[float, tuple[dict, dict[str, float]]] | None = None
        self._export_s: float | None = None  # the cluster's metrics export interval, read once

    def sample(self) -> tuple[dict, dict[str, float]]:
        """``(load, kv_usage_by_replica)`` as ``serve_observation`` takes them (``load["age_s"]``:
        how old its figures may be, the scrape's age plus one export interval). Scraped at most
        once per metrics export interval: between two exports the endpoints hold the same values
        (the shell ticks every second; Ray exports every 10 s by default), so a tick in between
        gets the last scrape's figures."""
        import time

        from rayfleet.platform.ray_compat import metrics_export_interval_s
        from rayfleet.serving.vllm.prometheus_scrape import scrape_vllm_metrics

        now = time.monotonic()
        if self._export_s is None:
            self._export_s = metrics_export_interval_s()
        if self.min_interval_s is None:
            self.min_interval_s = self._export_s
        if self._last is None or now - self._last[0] >= self.min_interval_s:
            replicas = pool_replica_ids(self.app_name, self.deployment)
            samples = scrape_vllm_metrics(contains="", names=POOL_LOAD_METRICS, timeout_s=5.0)  # vLLM's and Serve's
            load = self.window.add(now, replica_samples(samples, replicas), live=replicas)
            self._last = (now, (load.as_load(), dict(load.kv_usage_by_replica)))
        scraped_at, (load_dict, kv) = self._last
        # The endpoints hold what the agent last exported (up to one interval before the scrape).
        return {**load_dict, "age_s": now - scraped_at + self._export_s}, kv
