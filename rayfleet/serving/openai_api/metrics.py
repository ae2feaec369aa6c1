"""Prometheus metrics of a served model, named like vLLM's (``vllm:`` -> ``rayfleet:``).

Design decisions:
- ``prometheus_client`` with a private ``CollectorRegistry`` per ingress (several apps or tests
  in one process must not collide in the global registry).
- Latencies the ingress measures are histograms it observes per request: time to first
  token, inter-token latency, end-to-end latency, queue time (reported by the replica that
  ran the request). Engine counters (prefix-cache queries/hits in tokens, KV usage, running
  and waiting requests) are *read* from the router's latest replica states at scrape time by a
  custom collector, labelled by replica, so the engines never push.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rayfleet.serving.engine.async_engine import ReplicaState

__all__ = ["ServingMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.states: Mapping[str, ReplicaState] = {}

    def collect(self):
        labels = ["model_name", "replica"]
        queries = CounterMetricFamily("rayfleet:prefix_cache_queries", "Prefix-cache queries, in tokens", labels=labels)
        hits = CounterMetricFamily("rayfleet:prefix_cache_hits", "Prefix-cache hits, in tokens", labels=labels)
        usage = GaugeMetricFamily("rayfleet:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels=labels)
        running = GaugeMetricFamily("rayfleet:num_requests_running", "Requests in the engine batch", labels=labels)
        waiting = GaugeMetricFamily("rayfleet:num_requests_waiting", "Requests queued in the engine", labels=labels)
        for name, state in sorted(self.states.items()):
            key = [self.model_name, name]
            queries.add_metric(key, state.kv.prefix_query_tokens)
            hits.add_metric(key, state.kv.prefix_hit_tokens)
            usage.add_metric(key, state.kv.usage)
            running.add_metric(key, state.snapshot.num_running_requests)
            waiting.add_metric(key, state.num_waiting)
        yield from (queries, hits, usage, running, waiting)


class ServingMetrics:
    """Histograms and counters observed by ``InferenceService``; ``render`` for ``/metrics``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lbl = {"model_name": model_name}
        self.ttft = Histogram("rayfleet:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r, labelnames=["model_name"]).labels(**lbl)
        self.itl = Histogram("rayfleet:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r, labelnames=["model_name"]).labels(**lbl)
        self.e2e = Histogram("rayfleet:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r, labelnames=["model_name"]).labels(**lbl)
        self.queue_time = Histogram("rayfleet:request_queue_time_seconds", "Time waiting in an engine queue",
                                    buckets=_LATENCY_BUCKETS, registry=r, labelnames=["model_name"]).labels(**lbl)
        self._success = Counter("rayfleet:request_success", "Finished requests by how they ended",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("rayfleet:prompt_tokens", "Prompt tokens", ["model_name"], registry=r).labels(**lbl)
        self.generation_tokens = Counter("rayfleet:generation_tokens", "Generated tokens", ["model_name"],
                                         registry=r).labels(**lbl)
        self.resumes = Counter("rayfleet:request_resumes", "Requests resumed on another replica", ["model_name"],
                               registry=r).labels(**lbl)
        self.prefill_retries = Counter("rayfleet:prefill_retries", "Prefills retried on another replica",
                                       ["model_name"], registry=r).labels(**lbl)
        self.model_name = model_name
        self._engines = _EngineCollector(model_name)
        r.register(self._engines)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(seconds)

    def observe_end(self, seconds: float, num_prompt: int, num_generated: int, how: str) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self._success.labels(self.model_name, how).inc()

    def render(self, states: Mapping[str, ReplicaState]) -> bytes:
        """Prometheus text exposition, engine gauges taken from ``states``."""
        self._engines.states = states
        return generate_latest(self.registry)
