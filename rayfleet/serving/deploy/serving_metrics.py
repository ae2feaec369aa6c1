"""Metrics of a served model: the app's ``/metrics`` and Ray's metrics, with vLLM's names.

Design decisions:
- In ``deploy``, beside their writers: the request path (``InferenceService``) records each
  request's latencies here and the engine replicas (``EngineReplica``) their counters; the
  OpenAI app only serves the text (``GenerationService.metrics_text``), so it never imports this.
- Two sinks for the same observations. ``/metrics`` (Prometheus text from a private
  ``prometheus_client`` registry per ingress, so several apps or tests in one process do not
  collide) names them like vLLM with ``rayfleet:`` for ``vllm:``. Ray's metrics
  (``ray.util.metrics``, exported by every node's metrics agent to Ray's Prometheus endpoint
  and dashboard) use the names vLLM's Ray stat logger gives them (``vllm:x`` becomes
  ``vllm_x``: Ray refuses ``:``), so a Ray Serve LLM dashboard shows rayfleet pools next to
  vLLM ones, told apart by ``model_name`` (and ``engine="rayfleet"``).
- Label values follow vLLM: ``finished_reason`` is ``stop``, ``length`` or ``abort``.
- Latencies the ingress measures (time to first token, inter-token, end-to-end, queue time
  reported by the replica) are observed per request by ``ServingMetrics``. Engine counters
  (prefix-cache queries/hits in tokens, KV usage, running and waiting requests) are read at
  scrape time from the replicas' published states for ``/metrics``, and recorded into Ray's
  metrics by each replica itself (``RayEngineMetrics``), labelled by replica.
- Ray is imported only when Ray metrics are asked for: unit tests and the in-process app run
  without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rayfleet.serving.engine.replica_state import ReplicaState

__all__ = ["ServingMetrics", "RayEngineMetrics", "FINISHED_REASONS", "finished_reason_label"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
FINISHED_REASONS = ("stop", "length", "abort")
_ENGINE_TAG = "rayfleet"


def finished_reason_label(finish_reason: str | None) -> str:
    """vLLM's ``finished_reason`` label value for a request that ended with ``finish_reason``
    (``None``: it did not finish, e.g. the client left or replicas kept failing).

    >>> [finished_reason_label(r) for r in ("stop", "length", None, "abort")]
    ['stop', 'length', 'abort', 'abort']
    """
    return finish_reason if finish_reason in ("stop", "length") else "abort"


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


class _RayRequestMetrics:
    """The ingress's per-request observations as Ray metrics (vLLM's names, see module doc)."""

    def __init__(self, model_name: str) -> None:
        from ray.util.metrics import Counter as RayCounter
        from ray.util.metrics import Histogram as RayHistogram

        tags = {"model_name": model_name, "engine": _ENGINE_TAG}
        keys = tuple(tags)

        def histogram(name: str, doc: str) -> Any:
            h = RayHistogram(name, doc, boundaries=list(_LATENCY_BUCKETS), tag_keys=keys)
            h.set_default_tags(tags)
            return h

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            c = RayCounter(name, doc, tag_keys=keys + extra)
            c.set_default_tags(tags)
            return c

        self.ttft = histogram("vllm_time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("vllm_e2e_request_latency_seconds", "End-to-end request latency")
        self.queue_time = histogram("vllm_request_queue_time_seconds", "Time waiting in an engine queue")
        self.success = counter("vllm_request_success", "Finished requests by how they ended", ("finished_reason",))
        self.prompt_tokens = counter("vllm_prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("vllm_generation_tokens", "Generated tokens")
        self.resumes = counter("rayfleet_request_resumes", "Requests resumed on another replica")
        self.prefill_retries = counter("rayfleet_prefill_retries", "Prefills retried on another replica")


class _Both:
    """Observe/inc on the Prometheus child and, when present, the Ray metric."""

    def __init__(self, prom: Any, ray_metric: Any = None) -> None:
        self.prom, self.ray_metric = prom, ray_metric

    def observe(self, value: float) -> None:
        self.prom.observe(value)
        if self.ray_metric is not None:
            self.ray_metric.observe(value)

    def inc(self, value: float = 1.0) -> None:
        self.prom.inc(value)
        if self.ray_metric is not None and value > 0:
            self.ray_metric.inc(value)

    def __getattr__(self, name: str) -> Any:  # the Prometheus child's own API (tests read ``_value``)
        return getattr(self.prom, name)


class ServingMetrics:
    """Histograms and counters observed by ``InferenceService``; ``render`` for ``/metrics``.
    ``ray_metrics=True`` also records them as Ray metrics (inside a Ray worker)."""

    def __init__(self, model_name: str, *, ray_metrics: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lbl = {"model_name": model_name}
        ray_m = _RayRequestMetrics(model_name) if ray_metrics else None
        self._ray = ray_m

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r, labelnames=["model_name"]).labels(**lbl)

        def count(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=r).labels(**lbl)

        self.ttft = _Both(hist("rayfleet:time_to_first_token_seconds", "Time to first token"), ray_m and ray_m.ttft)
        self.itl = _Both(hist("rayfleet:inter_token_latency_seconds", "Time between output tokens"), ray_m and ray_m.itl)
        self.e2e = _Both(hist("rayfleet:e2e_request_latency_seconds", "End-to-end request latency"), ray_m and ray_m.e2e)
        self.queue_time = _Both(hist("rayfleet:request_queue_time_seconds", "Time waiting in an engine queue"),
                                ray_m and ray_m.queue_time)
        self._success = Counter("rayfleet:request_success", "Finished requests by how they ended",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = _Both(count("rayfleet:prompt_tokens", "Prompt tokens"), ray_m and ray_m.prompt_tokens)
        self.generation_tokens = _Both(count("rayfleet:generation_tokens", "Generated tokens"),
                                       ray_m and ray_m.generation_tokens)
        self.resumes = _Both(count("rayfleet:request_resumes", "Requests resumed on another replica"),
                             ray_m and ray_m.resumes)
        self.prefill_retries = _Both(count("rayfleet:prefill_retries", "Prefills retried on another replica"),
                                     ray_m and ray_m.prefill_retries)
        self.model_name = model_name
        self._engines = _EngineCollector(model_name)
        r.register(self._engines)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(seconds)

    def observe_end(self, seconds: float, num_prompt: int, num_generated: int, finish_reason: str | None) -> None:
        """A request ended: ``finish_reason`` as the engine said (``stop``/``length``), or
        ``None``/``abort`` when it did not finish (see ``finished_reason_label``)."""
        label = finished_reason_label(finish_reason)
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self._success.labels(self.model_name, label).inc()
        if self._ray is not None:
            self._ray.success.inc(1.0, tags={"finished_reason": label})

    def render(self, states: Mapping[str, ReplicaState]) -> bytes:
        """Prometheus text exposition, engine gauges taken from ``states``."""
        self._engines.states = states
        return generate_latest(self.registry)


class RayEngineMetrics:
    """One engine replica's counters and gauges as Ray metrics (recorded by the replica each
    time it publishes its state; vLLM's names, see module doc)."""

    def __init__(self, *, model_name: str, role: str, replica: str) -> None:
        from ray.util.metrics import Counter as RayCounter
        from ray.util.metrics import Gauge as RayGauge

        tags = {"model_name": model_name, "engine": _ENGINE_TAG, "role": role, "replica": replica}
        keys = tuple(tags)

        def make(cls: Any, name: str, doc: str) -> Any:
            m = cls(name, doc, tag_keys=keys)
            m.set_default_tags(tags)
            return m

        self.queries = make(RayCounter, "vllm_prefix_cache_queries", "Prefix-cache queries, in tokens")
        self.hits = make(RayCounter, "vllm_prefix_cache_hits", "Prefix-cache hits, in tokens")
        self.usage = make(RayGauge, "vllm_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.running = make(RayGauge, "vllm_num_requests_running", "Requests in the engine batch")
        self.waiting = make(RayGauge, "vllm_num_requests_waiting", "Requests queued in the engine")
        self._last_queries = 0
        self._last_hits = 0

    def observe(self, state: ReplicaState) -> None:
        """Record ``state`` (counters as increments since the last call)."""
        kv = state.kv
        if kv.prefix_query_tokens > self._last_queries:
            self.queries.inc(kv.prefix_query_tokens - self._last_queries)
        if kv.prefix_hit_tokens > self._last_hits:
            self.hits.inc(kv.prefix_hit_tokens - self._last_hits)
        self._last_queries, self._last_hits = kv.prefix_query_tokens, kv.prefix_hit_tokens
        self.usage.set(kv.usage)
        self.running.set(state.snapshot.num_running_requests)
        self.waiting.set(state.num_waiting)
