"""The router's ledger of recent work per replica: exponentially decayed, lazily.

Design decisions:
- ``value(r, now) = sum_i work_i * exp(-(now - t_i) / memory_s)`` over the work booked on
  ``r``. Stored as (value, time of last update) per replica and decayed only when read or
  added to, so a decision costs O(replicas) and nothing runs between requests.
- Time comes from the caller (``now``), so the ledger stays pure: the live router passes a
  monotonic clock, the trace replay passes trace time.
- The router keeps two ledgers of the same bookings: a long one (minutes: what each replica
  has done) and a short one (tens of seconds: what it is doing now, a forecast of the work its
  running conversations will still bring), plus a ``DecayedMean`` of prompt sizes that gives
  the policy its unit of work (``RouterPolicy`` module doc).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rayfleet.errors import SpecError

__all__ = ["RecentWorkLedger", "DecayedMean"]


class RecentWorkLedger:
    """Decayed work per replica (any unit; the router uses KV blocks)."""

    def __init__(self, memory_s: float) -> None:
        if not memory_s > 0:
            raise SpecError("router.load_memory_s", memory_s, "must be a positive number of seconds",
                            "use e.g. 300 (five minutes of routing history)")
        self.memory_s = float(memory_s)
        self._entries: dict[str, tuple[float, float]] = {}

    def value(self, replica: str, now: float) -> float:
        """Decayed work of ``replica`` at ``now`` (0 if it never got any). Pure."""
        entry = self._entries.get(replica)
        if entry is None:
            return 0.0
        value, at = entry
        return value * math.exp(-max(0.0, now - at) / self.memory_s)

    def add(self, replica: str, work: float, now: float) -> None:
        """Book ``work`` on ``replica`` at ``now``. Mutates the ledger."""
        self._entries[replica] = (self.value(replica, now) + work, now)

    def forget(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def join(self, replica: str, peers: Iterable[str]) -> None:
        """A replica joining a pool whose peers have a history starts at their mean, not at 0:
        the ledger then balances the work assigned from now on, not history the newcomer was not
        there for. (A restarted replica at 0 drew every request, cached elsewhere or not, until
        the ledgers met.) No-op when it has an entry or no peer has one. Mutates the ledger."""
        if replica in self._entries:
            return
        known = [self._entries[p] for p in peers if p != replica and p in self._entries]
        if not known:
            return
        at = max(t for _, t in known)
        mean = sum(v * math.exp(-(at - t) / self.memory_s) for v, t in known) / len(known)
        self._entries[replica] = (mean, at)


class DecayedMean:
    """Exponentially weighted mean of recent samples (the pool's mean prompt size, in blocks)."""

    def __init__(self, memory_s: float) -> None:
        self._sum = RecentWorkLedger(memory_s)
        self._count = RecentWorkLedger(memory_s)

    def add(self, sample: float, now: float) -> None:
        """Record one sample at ``now``. Mutates."""
        self._sum.add("", sample, now)
        self._count.add("", 1.0, now)

    def value(self, now: float) -> float | None:
        """The decayed mean at ``now``, or None before the first sample. Pure."""
        count = self._count.value("", now)
        return self._sum.value("", now) / count if count > 0 else None
