"""What the TTFT cost knows about each replica's prefill beyond its last report: the queue drained
in time, the prefill load booked on it lately, and how many later requests a routed prompt brings.

Design decisions (issue 30; the held-out bounded replay is where the cost lost to Ray's
``PrefixCacheAffinityRouter``, at 1/64-50% of the working set per replica):
- **The queue drains between reports** (``QueuedWork``). A replica reports its queued prefill
  tokens every poll and the router adds what it routes there; left at that, a booked prompt
  stayed "queued" until the next report, although the replica works through it at its prefill
  rate. With prefills about as long as a poll period, a conversation's home that had finished its
  last turn still looked busy: at 1/64 of the working set per replica, 55% of the cost's 597 moves
  off a conversation's cache were slower for the moved request itself (the home's queue read 49 ms
  too long on average). Each queue is a fluid ``(tokens, as_of)``; at ``now`` the tokens still
  ahead are ``max(0, tokens - rate * (now - as_of))``, ``rate`` the replica's measured prefill rate
  (``ttft_cost.PrefillRateEstimator``: it times prefills in steps shared with decodes, so the
  decode slowdown is in it). A report resets the fluid; a booking drains it to ``now`` first. A
  report without a time is not drained until the router books there with one.
- **Later requests follow a prompt** (``FollowUpEstimate``, ``recent_work``). Draining alone made
  things worse (held-out 1/64: TTFT mean 0.1021 -> 0.1053 s, PCA 0.0996 s): the measurement
  behind it is that rayfleet's *first* turns waited 0.9 ms on average and its later turns 19.8 ms,
  PCA's 15.3 ms and 13.7 ms. The cost sent each new conversation wherever it started soonest,
  blind to the turns it would bring there (and to those of the conversations already there), so
  conversations piled up (requests max/mean 2.28) and the later turns queued. PCA's fewest
  ongoing requests balances exactly that. The cost now prices it in seconds (``ttft_cost``):
  the prompt expects ``follow_up_requests`` later requests on the replica that caches it, each of
  which will wait behind that replica's prefill load. The router books every routed prompt's
  uncached tokens per replica (short memory, ``RecentWorkLedger``) and their pool mean; this
  module hands both to the cost.
- Plain classes: no Ray, clock or I/O (time comes from the caller). ``RouterCore`` and
  ``pool_router.PoolRouterCore`` each keep one ``PrefillOutlook``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from rayfleet.serving.routing.recent_work import DecayedMean, FollowUpEstimate, RecentWorkLedger

__all__ = ["QueuedWork", "PrefillOutlook"]


class QueuedWork:
    """Prefill tokens queued per replica, drained at its rate between reports. Mutable."""

    def __init__(self) -> None:
        self._queues: dict[str, tuple[float, float | None]] = {}  # replica -> (tokens, as of)

    def report(self, replica: str, tokens: float, now_s: float | None) -> None:
        """The replica's own figure at ``now_s`` (None: unknown time, not drained). Mutates."""
        self._queues[replica] = (float(tokens), now_s)

    def ahead(self, replica: str, now_s: float | None, rate: float, default: float = 0.0) -> float:
        """Tokens still queued on ``replica`` at ``now_s`` (``default`` if never reported). Pure."""
        entry = self._queues.get(replica)
        if entry is None:
            return default
        tokens, as_of = entry
        if as_of is None or now_s is None or now_s <= as_of:
            return tokens
        left = tokens - rate * (now_s - as_of)
        return left if left > 0.0 else 0.0

    def book(self, replica: str, tokens: float, now_s: float | None, rate: float, default: float = 0.0) -> None:
        """Add ``tokens`` routed to ``replica`` at ``now_s``, after draining to then. Mutates."""
        as_of = now_s if now_s is not None else self._queues.get(replica, (0.0, None))[1]
        self._queues[replica] = (self.ahead(replica, now_s, rate, default) + tokens, as_of)

    def forget(self, replica: str) -> None:
        self._queues.pop(replica, None)


class PrefillOutlook:
    """The TTFT cost's inputs beyond the snapshots (module doc). ``memory_s``: how far back the
    booked prefill load and the follow-up share look (the router's activity memory). Mutable."""

    def __init__(self, memory_s: float) -> None:
        self.queued = QueuedWork()
        self.booked = RecentWorkLedger(memory_s)  # uncached prefill tokens routed per replica
        self.prefill_per_request = DecayedMean(memory_s)
        self.follow_ups = FollowUpEstimate(memory_s)
        self._pending: list[tuple[Sequence[Hashable], int, float]] = []  # routed prompts, for ``follow_ups``

    def report(self, replica: str, queued_tokens: float, now_s: float | None) -> None:
        """A replica's reported queue (``num_queued_blocks`` in tokens) at ``now_s``. Mutates."""
        self.queued.report(replica, queued_tokens, now_s)

    def cost_inputs(self, replicas: Sequence[tuple[str, float]], rates: dict[str, float],
                    now_s: float | None) -> dict[str, Any]:
        """Keywords for ``TTFTPolicy.choose_prefill`` at ``now_s`` (``{}`` without a clock):
        ``replicas`` are (name, reported queued tokens) pairs, ``rates`` their tokens/s. Pure."""
        if now_s is None:
            return {}
        return {"queued_tokens": {r: self.queued.ahead(r, now_s, rates[r], q) for r, q in replicas},
                "booked_prefill_tokens": {r: self.booked.value(r, now_s) for r, _ in replicas},
                "booked_memory_s": self.booked.memory_s,
                "mean_prefill_tokens": self.prefill_per_request.value(now_s),
                "follow_up_requests": self.follow_ups.expected(now_s)}

    def book(self, replica: str, *, uncached_tokens: float, block_hashes: Sequence[Hashable], cached_blocks: int,
             now_s: float | None, rate: float, reported_queued_tokens: float) -> None:
        """A prompt routed to ``replica`` at ``now_s`` with ``uncached_tokens`` to prefill there;
        ``cached_blocks``: the longest prefix of it any replica cached. The follow-up search runs
        in ``flush`` (after the decision). Mutates."""
        self.queued.book(replica, uncached_tokens, now_s, rate, reported_queued_tokens)
        if now_s is None:
            return
        self.booked.add(replica, uncached_tokens, now_s)
        self.prefill_per_request.add(uncached_tokens, now_s)
        self._pending.append((block_hashes, cached_blocks, now_s))

    def flush(self) -> None:
        """Record the prompts booked since the last flush in ``follow_ups`` (O(their blocks)). Mutates."""
        pending, self._pending = self._pending, []
        for hashes, cached_blocks, now_s in pending:
            self.follow_ups.add(hashes, cached_blocks, now_s)

    def forget(self, replica: str) -> None:
        self.queued.forget(replica)
        self.booked.forget(replica)
