"""The router's default cost: predicted time to first token (seconds) on each prefill replica.

Design decisions:
- One cost with units, no weights trading hit rate against load. For replica ``r``:

      work(r)      = queued_tokens(r) + uncached_tokens(r)             [tokens]
      prefill_s(r) = work(r) / rate(r)                                 [s]
      decode_s(r)  = running(r) * max(1, work(r) / (budget - running(r))) / rate(r)   [s]
      ttft(r)      = prefill_s(r) + decode_s(r)
      busy(r)      = min(0.95, (booked(r) + uncached_tokens(r)) / (memory_s * rate(r)))
      later_s(r)   = follow_ups * min(mean_prefill * busy(r) / (1 - busy(r)), prompt_tokens) / rate(r)
      cost(r)      = ttft(r) + later_s(r)                                  [s]

  ``queued_tokens`` is the prefill work ahead of the request (the replica's last report plus what
  the router booked there since); ``uncached_tokens`` the prompt beyond the prefix ``r`` caches
  (exact when the replica publishes KV events); ``rate(r)`` the replica's *measured* prefill
  rate in tokens/s (``PrefillRateEstimator``, learned from its own completed prefills).
  ``decode_s`` is continuous batching: each engine step carries ``budget`` tokens
  (``max_num_batched_tokens``), one per running decode, so the prefill advances by
  ``budget - running`` tokens a step and spans ``work / (budget - running)`` steps (at least
  one); the decode tokens those steps carry are priced at the same rate. The one knob,
  ``step_token_budget``, is the engine's own setting, not a fitted weight; every term is seconds.
  ``queued_tokens`` is the router's estimate *drained* at ``rate(r)`` since the last report
  (``prefill_outlook.QueuedWork``): undrained, a home that had finished its last turn looked busy.
- ``later_s`` prices what ``ttft`` alone is blind to: the request is not the last one of its
  prompt. ``follow_ups`` later requests will extend it (a conversation's next turns) and go where
  it is cached, and each waits behind that replica's prefill load: ``booked(r)`` is the uncached
  prefill the router sent ``r`` in the last ``memory_s`` (decayed; with this request's), so
  ``busy(r)`` is its utilisation, and ``mean_prefill * busy / (1 - busy)`` the M/M/1 wait in
  tokens of one request of the pool's mean prefill ``mean_prefill``. Without it, a new
  conversation went wherever it started soonest, blind to the turns the conversations already
  there would bring, and conversations piled up (held-out bounded replay, 1/64 of the working set
  per replica: first turns waited 0.9 ms, later turns 19.8 ms; PCA, which balances ongoing
  requests, 15.3 and 13.7 ms; requests max/mean 2.28). Two bounds keep the steady-state formula
  physical: a later request never waits longer than prefilling its whole context elsewhere
  (``prompt_tokens``: the router would move it), which is what binds where caches evict (at 1/320
  of the working set per replica, developed-on trace, 7 later requests: TTFT mean 0.846 s without
  the term, 0.989 s with it uncapped, a load balancer that gave up hits; 0.886 s capped); the
  pooled replicas keep real waits far below a lone M/M/1's. And ``busy`` stops at 0.95, where the
  queue itself (``queued_tokens``, exact) says more than a steady state. ``follow_ups``,
  ``booked`` and ``mean_prefill`` are learned by the router (``prefill_outlook``:
  ``recent_work.FollowUpEstimate`` counts only follow-ups that find their prompt still cached);
  without them (no clock) ``later_s`` is 0.
- Hit rate is not a goal of its own here: a cached prefix is worth exactly the prefill seconds it
  saves, and a queue exactly the seconds it makes the request wait. A hot prefix therefore fans
  out once its replica's queue costs more than prefilling the prefix elsewhere.
- Requests that cannot fit now (too few free KV blocks, no sequence slot) rank after all others;
  equal costs go to the longer cached prefix, then the replica caching fewer blocks, then by
  name (``policy.RouterPolicy``'s rules: a by-name tie sent every new prefix to one replica).
- ``PrefillRateEstimator``: ``rate = T / S`` with ``T``, ``S`` the observed prefill tokens and
  seconds, each decayed by ``exp(-tokens / memory_tokens)`` per observation (a ratio of decayed
  sums, not a mean of ratios: a 16-token prefill timed at one scheduler tick must not swing the
  rate). A replica with no observation is priced at the pool's pooled rate, or the prior before
  anything was observed; the prior enters as ``prior_tokens`` of pseudo-observation, so the
  first real prefills move it quickly. Plain classes: no Ray, clock or I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.policy import ReplicaScore, RouteDecision, RouterPolicy
from rayfleet.serving.routing.prefix_index import PrefixIndex

__all__ = ["PrefillRateEstimator", "TTFTPolicy", "PREFILL_POLICIES", "prefill_policy"]

MAX_BUSY = 0.95  # the utilisation ``later_s`` stops at (module doc)


class PrefillRateEstimator:
    """Per-replica prefill rate (tokens/s) learned online (module doc). Mutable, plain class."""

    def __init__(self, *, prior_tokens_per_s: float = 4000.0, memory_tokens: float = 65536.0,
                 prior_tokens: float = 2048.0) -> None:
        for name, value in (("prior_tokens_per_s", prior_tokens_per_s), ("memory_tokens", memory_tokens),
                            ("prior_tokens", prior_tokens)):
            if not value > 0:
                raise SpecError(f"router.{name}", value, "must be a positive number",
                                "use e.g. prior_tokens_per_s=4000, memory_tokens=65536, prior_tokens=2048")
        self.prior_tokens_per_s = float(prior_tokens_per_s)
        self.memory_tokens = float(memory_tokens)
        self.prior_tokens = float(prior_tokens)
        self._sums: dict[str, tuple[float, float]] = {}  # replica -> (decayed tokens, decayed seconds)
        self._pooled: float | None = None

    def observe(self, replica: str, num_tokens: float, seconds: float) -> None:
        """One completed prefill (or a report's totals since the last one): ``num_tokens``
        computed in ``seconds`` of prefill time. Samples without both positive are ignored."""
        if not (num_tokens > 0 and seconds > 0):
            return
        tokens, secs = self._sums.get(replica, (self.prior_tokens, self.prior_tokens / self.rate(replica)))
        keep = math.exp(-num_tokens / self.memory_tokens)
        self._sums[replica] = (tokens * keep + num_tokens, secs * keep + seconds)
        self._pooled = sum(t for t, _ in self._sums.values()) / sum(s for _, s in self._sums.values())

    def rate(self, replica: str) -> float:
        """Tokens/s of ``replica``: its own estimate, else the pool's pooled one, else the prior."""
        sums = self._sums.get(replica)
        if sums is not None:
            return sums[0] / sums[1]
        return self._pooled if self._pooled is not None else self.prior_tokens_per_s

    def rates(self, replicas: Sequence[str]) -> dict[str, float]:
        return {r: self.rate(r) for r in replicas}

    def forget(self, replica: str) -> None:
        self._sums.pop(replica, None)


@dataclass(frozen=True)
class TTFTPolicy:
    """Prefill choice by predicted TTFT in seconds (module doc). ``step_token_budget``: tokens one
    engine step carries (the engine's ``max_num_batched_tokens``); ``prior_tokens_per_s``: the
    rate assumed for a replica when the caller passes no measured rates."""

    step_token_budget: int = 2048
    prior_tokens_per_s: float = 4000.0
    name: ClassVar[str] = "predicted_ttft"
    uses_ledgers: ClassVar[bool] = False  # reads no recent-work ledger (callers may skip them)

    def __post_init__(self) -> None:
        if self.step_token_budget < 2:
            raise SpecError("router.step_token_budget", self.step_token_budget, "must be at least 2 tokens",
                            "use the engine's max_num_batched_tokens, e.g. 2048")
        if not self.prior_tokens_per_s > 0:
            raise SpecError("router.prior_tokens_per_s", self.prior_tokens_per_s, "must be positive",
                            "use e.g. 4000 (tokens/s)")

    def predicted_ttft_s(self, snap: ReplicaSnapshot, *, uncached_tokens: float, tokens_per_block: int,
                         rate: float) -> float:
        """The module doc's ``ttft(r)`` for one replica, in seconds. Pure."""
        work = snap.num_queued_blocks * tokens_per_block + uncached_tokens
        running = min(snap.num_running_requests, self.step_token_budget - 1)
        steps = max(1.0, work / (self.step_token_budget - running))
        return (work + running * steps) / rate

    def choose_prefill(self, snapshots: Sequence[ReplicaSnapshot], block_hashes: Sequence[BlockHash],
                       index: PrefixIndex, *, num_prompt_blocks: int | None = None, max_ranked: int = 8,
                       matched: Mapping[ReplicaId, int] | None = None,
                       prefill_rate: Mapping[str, float] | None = None, tokens_per_block: int = 16,
                       num_prompt_tokens: int | None = None, queued_tokens: Mapping[ReplicaId, float] | None = None,
                       booked_prefill_tokens: Mapping[ReplicaId, float] | None = None, booked_memory_s: float = 30.0,
                       mean_prefill_tokens: float | None = None, follow_up_requests: float | None = None,
                       **_ledgers: Any) -> RouteDecision:
        """Rank healthy replicas by predicted TTFT plus later requests' wait, lowest first. ``prefill_rate``: measured
        tokens/s per replica (missing: ``prior_tokens_per_s``); ``num_prompt_tokens`` (default
        ``num_prompt_blocks * tokens_per_block``) prices a partial last block exactly;
        ``queued_tokens`` (the router's drained estimate) replaces a replica's reported
        ``num_queued_blocks`` where it has an entry; ``booked_prefill_tokens`` (per replica, over
        ``booked_memory_s``), ``mean_prefill_tokens`` and ``follow_up_requests`` price the later
        requests (module doc; ``prefill_outlook.PrefillOutlook.cost_inputs`` gives all four); other
        keywords (the block-cost policy's ledgers) are accepted and ignored, so callers can
        swap policies. Same ``RouteDecision`` shape as ``RouterPolicy.choose_prefill``; its
        ``cost`` is seconds. Pure (reads the index); never raises."""
        num_blocks = len(block_hashes) if num_prompt_blocks is None else num_prompt_blocks
        num_tokens = num_blocks * tokens_per_block if num_prompt_tokens is None else num_prompt_tokens
        cached = index.match_prefix(block_hashes) if matched is None else matched
        rates = prefill_rate or {}
        prior = self.prior_tokens_per_s
        budget = self.step_token_budget
        follow_ups = (follow_up_requests or 0.0) if booked_prefill_tokens is not None and mean_prefill_tokens else 0.0
        rows = []
        for snap in snapshots:
            if not snap.healthy:
                continue
            rid = snap.replica_id
            hit = cached.get(rid, 0)
            uncached = max(0, num_tokens - hit * tokens_per_block)
            # predicted_ttft_s inlined: this loop runs for every replica of every decision.
            queued = snap.num_queued_blocks * tokens_per_block
            if queued_tokens is not None:
                queued = queued_tokens.get(rid, queued)
            work = queued + uncached
            running = min(snap.num_running_requests, budget - 1)
            steps = work / (budget - running)
            rate = rates.get(rid, prior)
            cost = (work + running * (steps if steps > 1.0 else 1.0)) / rate
            if follow_ups:  # later_s (module doc)
                busy = (booked_prefill_tokens.get(rid, 0.0) + uncached) / (booked_memory_s * rate)
                busy = busy if busy < MAX_BUSY else MAX_BUSY
                wait = mean_prefill_tokens * busy / (1.0 - busy)
                cost += follow_ups * (wait if wait < num_tokens else num_tokens) / rate
            to_prefill = num_blocks - hit
            fits = snap.num_free_blocks >= to_prefill and (
                not snap.max_num_seqs or snap.num_running_requests < snap.max_num_seqs)
            rows.append((not fits, cost, -hit, index.num_blocks_on(rid), rid, snap.load_blocks))
        if not rows:
            return RouteDecision(None, (), "no healthy prefill replica")
        rows.sort()
        ranked = tuple(ReplicaScore(rid, cost, -neg_hit, num_blocks + neg_hit, load, not no_fit)
                       for no_fit, cost, neg_hit, _, rid, load in rows[:max(1, max_ranked)])
        best = ranked[0]
        top_hit = min(rows, key=lambda r: (r[2], r[1]))
        if not best.fits:
            why = "no replica has room now; least costly queue"
        elif best.cached_blocks and best.replica_id == top_hit[4]:
            why = "longest cached prefix"
        elif -top_hit[2] > best.cached_blocks:
            why = f"{top_hit[4]} caches {-top_hit[2]} blocks but its queue makes it {top_hit[1] * 1e3:.1f} ms"
        else:
            why = "no cached prefix; soonest free"
        return RouteDecision(best.replica_id, ranked,
                             f"{best.replica_id}: {why} ({best.cached_blocks}/{num_blocks} blocks cached, "
                             f"predicted TTFT + later requests' wait {best.cost * 1e3:.1f} ms)",
                             tuple(row[4] for row in rows))

    def choose_decode(self, snapshots: Sequence[ReplicaSnapshot], *, num_blocks_needed: int) -> RouteDecision:
        """Decode choice is unchanged (most free KV blocks): ``RouterPolicy.choose_decode``."""
        return _DECODE.choose_decode(snapshots, num_blocks_needed=num_blocks_needed)


_DECODE = RouterPolicy()

PREFILL_POLICIES = ("predicted_ttft", "prefix_load")
"""Names of the prefill costs: ``predicted_ttft`` (default, this module) and ``prefix_load``
(``policy.RouterPolicy``'s block-unit cost with fitted weights, kept for comparison)."""


def prefill_policy(name: str = "predicted_ttft", **params: Any) -> TTFTPolicy | RouterPolicy:
    """The prefill cost called ``name`` with its parameters. Raises ``SpecError`` for an unknown
    name (the message lists the known ones)."""
    if name == "predicted_ttft":
        return TTFTPolicy(**params)
    if name == "prefix_load":
        return RouterPolicy(**params)
    raise SpecError("router.cost", name, "is not a known prefill cost", f"use one of {', '.join(PREFILL_POLICIES)}")
