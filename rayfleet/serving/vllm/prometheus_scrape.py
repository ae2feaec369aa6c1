"""vLLM's own metrics, read where Ray's Prometheus exports them.

Serve LLM replicas run vLLM with ``log_engine_metrics`` (``config`` turns it on), so every engine
publishes vLLM's metrics (``vllm:num_requests_running``, ``vllm:prefix_cache_hits``, the KV
connector's ``vllm:nixl_bytes_transferred``, ...) through Ray's metrics agent on its node, beside
Ray's and Serve's own: the same endpoint a fleet's Prometheus already scrapes (Ray prefixes the
names with ``ray_``). This module reads those endpoints for tests, benchmarks and ``rayfleet``
tooling; it adds no exporter of its own.

Design decisions:
- One scrape per live node (``ray.nodes()``: ``NodeManagerAddress`` + ``MetricsExportPort``);
  a node whose agent does not answer is skipped, not an error (it may be starting or gone).
- Samples are summed over nodes and over label sets unless labels are given, because a pool's
  counters are the sum of its replicas' (each replica's engine labels its own series).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["MetricSample", "parse_samples", "scrape_vllm_metrics", "metric_sum", "named"]


@dataclass(frozen=True)
class MetricSample:
    """One Prometheus sample: ``name`` as exported (e.g. ``ray_vllm:prompt_tokens_total``)."""

    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)


def parse_samples(text: str, *, contains: str = "vllm", names: Iterable[str] = ()) -> list[MetricSample]:
    """Samples of the Prometheus text ``text`` whose name contains ``contains`` (and, when
    ``names`` are given, one of them).

    Lines of other metrics are dropped before parsing: a node's endpoint holds every Ray, Serve
    and vLLM series, and the autoscaler's Serve shell, parsing all of them every tick for five
    of them, spent a fifth of a core on it through a vLLM lend."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = tuple(names)
    if wanted or contains:
        keys = wanted or (contains,)
        text = "\n".join(line for line in text.splitlines()
                         if contains in (name := _line_metric(line)) and any(k in name for k in keys))
    out: list[MetricSample] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if contains in s.name and (not wanted or any(k in s.name for k in wanted)):
                out.append(MetricSample(s.name, float(s.value), dict(s.labels)))
    return out


def _line_metric(line: str) -> str:
    """The metric a Prometheus text line is about: a sample's name, or the family a ``# HELP`` /
    ``# TYPE`` line describes ("" for other comments)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop)
        if at != -1:
            end = min(end, at)
    return line[:end]


def _endpoints(nodes: Iterable[Mapping[str, Any]]) -> list[str]:
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]


def scrape_vllm_metrics(*, contains: str = "vllm", names: Iterable[str] = (),
                        timeout_s: float = 10.0) -> list[MetricSample]:
    """Every vLLM sample (or those of ``names``, see ``parse_samples``) of every live node of the
    connected Ray cluster (see module doc)."""
    import ray

    samples: list[MetricSample] = []
    for url in _endpoints(ray.nodes()):
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                samples.extend(parse_samples(resp.read().decode(), contains=contains, names=names))
        except (urllib.error.URLError, OSError):
            continue
    return samples


def named(name: str, suffix: str) -> bool:
    """Whether an exported sample ``name`` is vLLM's metric ``suffix``: counters may carry
    Prometheus' ``_total`` once or twice depending on the exporter (``prompt_tokens`` matches
    ``ray_vllm:prompt_tokens_total``); histogram parts keep their own suffix (``_sum``)."""
    base = name[:-len("_total")] if name.endswith("_total") else name
    # Anchored at vLLM's prefix, so prefix_cache_hits does not match external_prefix_cache_hits.
    return any(n.endswith(f"vllm{sep}{suffix}") for n in (base, name) for sep in (":", "_"))


def metric_sum(samples: Iterable[MetricSample], suffix: str, **labels: str) -> float:
    """Sum of the samples named ``suffix`` (see ``named``; e.g. ``prefix_cache_hits`` or
    ``nixl_bytes_transferred_sum``) whose labels include ``labels``; 0.0 when there is none."""
    return sum(s.value for s in samples
               if named(s.name, suffix) and all(s.labels.get(k) == v for k, v in labels.items()))
