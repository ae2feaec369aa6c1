"""The router's ledger of recent work per replica: exponentially decayed, lazily.

Design decisions:
- ``value(r, now) = sum_i work_i * exp(-(now - t_i) / memory_s)`` over the work booked on
  ``r``. Stored as (value, time of last update) per replica and decayed only when read or
  added to, so a decision costs O(replicas) and nothing runs between requests.
- Time comes from the caller (``now``), so the ledger stays pure: the live router passes a
  monotonic clock, the trace replay passes trace time.
"""

from __future__ import annotations

import math

from rayfleet.errors import SpecError

__all__ = ["RecentWorkLedger"]


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
