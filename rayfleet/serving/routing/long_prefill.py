"""Adaptive long-context prefill: split one long prompt over several prefill replicas.

A prompt of ``N >= threshold_tokens`` tokens is cut into contiguous *spans* ``[s_i, e_i)``, one
per replica. Replica ``i`` computes its span through every layer; its layer-``l`` attention
reads the layer-``l`` KV of all earlier spans, which the earlier replicas publish (through the
``kv_transfer`` interface) as soon as they finish that layer. The last replica therefore ends
with the whole prompt's KV and the logits of the last token: the same ``PrefillResult``-shaped
answer a single replica gives, handed to decode the same way.

Design decisions:
- Sequence-parallel with a layer wavefront: span ``i`` runs layer ``l`` once span ``i`` has run
  layer ``l - 1`` and spans ``< i`` have published layer ``l``. With ``C`` spans and ``L`` layers
  the critical path is about ``C + L - 1`` span-layers instead of ``C * L``, so two replicas
  can cut a prefill's time by up to ``2L / (L + 1)``. Rejected alternative: chunked pipeline
  parallelism (Mooncake's CPP: replica ``j`` owns a band of layers and chunks flow through).
  It moves smaller activations instead of KV, but leaves the prompt's KV split by layer over the
  replicas and needs a pipeline stage per band; here every replica runs the whole model, so any
  prefill replica can take any span, and the KV arrives where decode (or the last replica)
  needs it anyway.
- Span boundaries are block-aligned, so a span's KV is whole blocks ``[s / bs, e / bs)`` of
  every layer: it moves as a slice of the paged layout and lands at the same block offsets.
- Spans are sized so that each replica's finish time (its queued prefill work plus the span's
  cost) is about equal (``LongPrefillPolicy``): a token costs ``1 + key_cost * e`` units, where
  ``e`` counts the keys its query reads (our paged attention reads the whole block table, so
  every query of a span ending at ``e`` reads ``e`` keys) and ``key_cost`` is the attention work
  per key relative to the per-token GEMMs (``key_cost_for``). Later spans are therefore shorter,
  and a replica with a prefill backlog gets a shorter span or none: no replica queues while
  another idles, down to the granularity of one block.
- The span's KV lives in a scratch ``PagedKVCache`` beside the engine's block pool (sized for
  ``[0, e)``), not in pool blocks: the pool is the engine's (and the KV-tier layer's) to manage,
  and the scratch is freed when the span's job is released. The memory is bounded by the prompt
  length, which ``max_model_len`` bounds.
- The policy here is torch-free (the ingress's router plans splits and imports no torch); a
  span's computation, ``span_prefill.SpanPrefill``, is plain torch (no Ray, no asyncio): the unit
  test runs the spans of a split in turn in one process and compares with a single engine;
  ``split_prefill`` drives it on replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig
from rayfleet.serving.engine.replica_state import ReplicaSnapshot

__all__ = ["SpanAssignment", "SplitPlan", "LongPrefillPolicy", "key_cost_for", "span_costs"]


@dataclass(frozen=True)
class SpanAssignment:
    """Tokens ``[start, end)`` of the prompt, computed on ``replica_id``."""

    replica_id: str
    start: int
    end: int


@dataclass(frozen=True)
class SplitPlan:
    """Spans in prompt order (contiguous, covering ``[0, N)``) and why they were chosen."""

    spans: tuple[SpanAssignment, ...]
    reason: str


def key_cost_for(config: MoEConfig) -> float:
    """Attention multiply-adds per (query, key) pair over the per-token GEMM multiply-adds of one
    layer (attention projections plus the routed and shared experts of an MoE layer)."""
    hd = config.resolved_head_dim
    projections = config.dim * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
    ffn = 3 * config.dim * config.moe_ffn_dim * (config.top_k + config.num_shared_experts)
    return 2 * config.num_heads * hd / (projections + ffn)


def span_costs(bounds: Sequence[int], *, key_cost: float) -> list[float]:
    """Cost of each span ``[bounds[i], bounds[i+1])`` in token units: ``len * (1 + key_cost * end)``."""
    return [(e - s) * (1.0 + key_cost * e) for s, e in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class LongPrefillPolicy:
    """When and how to split a long prompt. Pure.

    threshold_tokens: prompts with at least this many uncached tokens are split.
    max_replicas: at most this many spans.
    min_span_tokens: no span is shorter (fewer replicas are used instead).
    key_cost: attention work per key relative to a token's GEMMs (``key_cost_for``).

    Worked example (``test_long_context``): 4096 tokens, block 16, two idle replicas,
    ``key_cost = 0`` -> ``[0, 2048) [2048, 4096)``; with ``key_cost = 1/4096`` the first span is
    longer (its queries read fewer keys); with replica b holding 1024 queued tokens and
    ``key_cost = 0``, a takes ``[0, 2560)`` and b ``[2560, 4096)`` (2560 = 1024 + 1536).
    """

    threshold_tokens: int
    max_replicas: int = 4
    min_span_tokens: int = 256
    key_cost: float = 0.0

    def __post_init__(self) -> None:
        if self.threshold_tokens < 2:
            raise SpecError("long_context.split_threshold_tokens", self.threshold_tokens,
                            "a prompt needs at least two tokens to split", "pass a threshold >= 2")
        if self.max_replicas < 2:
            raise SpecError("long_context.max_split_replicas", self.max_replicas,
                            "splitting needs at least two replicas", "pass max_split_replicas >= 2")
        if self.min_span_tokens < 1 or self.key_cost < 0:
            raise SpecError("long_context.min_span_tokens/key_cost", (self.min_span_tokens, self.key_cost),
                            "must be positive / non-negative", "pass min_span_tokens >= 1, key_cost >= 0")

    def plan(self, num_tokens: int, snapshots: Sequence[ReplicaSnapshot], *, block_size: int,
             num_uncached_tokens: int | None = None) -> SplitPlan | None:
        """Spans for a prompt of ``num_tokens`` over the healthy replicas in ``snapshots``, or
        ``None`` when it should run on one replica (short, mostly cached, fewer than two
        replicas, or spans would fall under ``min_span_tokens``). Never raises."""
        uncached = num_tokens if num_uncached_tokens is None else num_uncached_tokens
        healthy = [s for s in snapshots if s.healthy and s.has_seq_slot]
        if uncached < self.threshold_tokens or len(healthy) < 2:
            return None
        # Least backlog first: every later span waits on the earlier ones layer by layer.
        healthy.sort(key=lambda s: (s.num_queued_blocks, s.num_active_blocks, s.replica_id))
        for count in range(min(self.max_replicas, len(healthy)), 1, -1):
            chosen = healthy[:count]
            backlog = [float(s.num_queued_blocks * block_size) for s in chosen]
            bounds = self._balanced_bounds(num_tokens, backlog, block_size)
            spans = [SpanAssignment(str(s.replica_id), a, b)
                     for s, a, b in zip(chosen, bounds[:-1], bounds[1:]) if b > a]
            if len(spans) >= 2 and all(sp.end - sp.start >= self.min_span_tokens for sp in spans):
                finish = [q + c for q, c in zip(backlog, span_costs(bounds, key_cost=self.key_cost)) if c]
                return SplitPlan(tuple(spans), f"{len(spans)} spans, finish-time spread "
                                               f"{max(finish) - min(finish):.0f} token-units")
        return None

    def _balanced_bounds(self, num_tokens: int, backlog: list[float], block_size: int) -> list[int]:
        """Block-aligned bounds whose ``backlog + cost`` per span is about equal: bisect on the
        common finish time ``T``; each span grows while it stays within ``T``."""
        def bounds_for(target: float) -> list[int]:
            bounds, start = [0], 0
            for i, queued in enumerate(backlog):
                if i == len(backlog) - 1:
                    end = num_tokens
                else:
                    # Largest block-aligned end with queued + (end - start) * (1 + k * end) <= target.
                    lo, hi = start, num_tokens
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if queued + (mid - start) * (1.0 + self.key_cost * mid) <= target:
                            lo = mid
                        else:
                            hi = mid - 1
                    end = min(num_tokens, lo // block_size * block_size) if lo < num_tokens else num_tokens
                    end = max(end, start)
                bounds.append(end)
                start = end
            return bounds

        lo, hi = 0.0, max(backlog) + num_tokens * (1.0 + self.key_cost * num_tokens)
        for _ in range(60):
            mid = (lo + hi) / 2
            b = bounds_for(mid)
            last = backlog[-1] + span_costs(b, key_cost=self.key_cost)[-1]
            lo, hi = (mid, hi) if last > mid else (lo, mid)
        return bounds_for(hi)
