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
- ``PrefixWorkLedger`` keeps the same short-memory bookings per *prompt*: keyed by the hash of
  the booked prompt's last full block, so a later prompt extending it (its conversation's next
  turn, or the same prompt again) finds its last own booking on a replica (the longest earlier
  prompt it extends; repeats of one prompt add up) by walking its own hash chain up to the
  prefix that replica caches. The policy then does not count a
  conversation's own turns as competing activity on its home replica. (Before, it subtracted the
  pool's mean booked work per request: live, a 24-block prompt repeated on a 2-replica pool
  whose mean request booked ~5 blocks left its cache, because the rest of its own first turn
  counted as the home's competing activity; ``tests/unit/serving/test_pool_routing.py``.)
- ``FollowUpEstimate`` counts how many later requests a routed prompt brings (the TTFT cost's
  ``later_s``, ``ttft_cost`` module doc): a set of recent prompts' last block hashes, searched
  along each new prompt's chain after the decision.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence

from rayfleet.errors import SpecError

__all__ = ["RecentWorkLedger", "DecayedMean", "PrefixWorkLedger", "FollowUpEstimate"]


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


class PrefixWorkLedger:
    """Decayed work booked per (prompt, replica), keyed by the prompt's last full block hash
    (module doc). At most ``max_entries`` prompts are kept (the least recently booked go first):
    an evicted one only means a conversation's old turn counts as competing activity again."""

    def __init__(self, memory_s: float, max_entries: int = 1 << 16) -> None:
        if not memory_s > 0:
            raise SpecError("router.activity_memory_s", memory_s, "must be a positive number of seconds",
                            "use e.g. 30 (what a replica is doing now)")
        self.memory_s = float(memory_s)
        self.max_entries = max(1, int(max_entries))
        self._entries: OrderedDict[Hashable, dict[str, tuple[float, float]]] = OrderedDict()

    def add(self, replica: str, block_hashes: Sequence[Hashable], work: float, now: float) -> None:
        """Book ``work`` for the prompt whose full blocks hash to ``block_hashes`` on ``replica``
        at ``now`` (a prompt with no full block is not kept: nothing can extend it). Mutates."""
        if not block_hashes:
            return
        key = block_hashes[-1]
        per = self._entries.get(key)
        if per is None:
            per = self._entries[key] = {}
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        value, at = per.get(replica, (0.0, now))
        per[replica] = (value * math.exp(-max(0.0, now - at) / self.memory_s) + work, now)

    def own(self, block_hashes: Sequence[Hashable], matched: Mapping[str, int], now: float) -> dict[str, float]:
        """Per replica, the decayed work booked there for the longest earlier prompt that the
        prompt ``block_hashes`` extends within the prefix that replica caches (``matched``: cached
        prefix length per replica, the index's answer): its conversation's last turn. Only the
        last, not every earlier turn: summed, a conversation's whole recent history stayed off
        its home's activity and the 64-replica replays lost balance (max/mean +0.02 to +0.05 on
        three of five conversation traces). O(longest cached prefix) lookups. Pure."""
        out: dict[str, float] = {}
        depth = min(len(block_hashes), max(matched.values(), default=0))
        if not self._entries or not depth:
            return out
        for j in range(depth):
            per = self._entries.get(block_hashes[j])
            if not per:
                continue
            for replica, (value, at) in per.items():
                if matched.get(replica, 0) > j:
                    out[replica] = value * math.exp(-max(0.0, now - at) / self.memory_s)
        return out


class FollowUpEstimate:
    """How many later requests extend a routed prompt *and find it cached* (a conversation's next
    turns, which the cost expects to follow the prompt to its replica), learned from the routed
    prompts. A request *follows up* when an earlier routed prompt's last full block is in its hash
    chain (its conversation's last turn, or the same prompt again), and is *held* when that block
    lies within the longest prefix some replica caches. With ``p`` the decayed share of requests
    that follow up and ``q`` the share that follow up held, a prompt expects ``p / (1 - p)`` later
    requests (a geometric count: an 8-turn conversation trace gives p = 7/8, so 7; single-turn
    traffic 0), of which ``q / p`` find it cached: ``q / (1 - p)``. Where caches evict a
    conversation between its turns, its next turn is not tied to a replica and expects nothing.
    ``p`` is capped at ``max_share`` so the count stays finite. Time comes from the caller; at most
    ``max_prompts`` prompt ends are kept (least recent go first)."""

    def __init__(self, memory_s: float, *, max_prompts: int = 1 << 16, max_share: float = 63 / 64) -> None:
        self._follows = DecayedMean(memory_s)
        self._held = DecayedMean(memory_s)
        self._ends: OrderedDict[Hashable, None] = OrderedDict()
        self.max_prompts = max(1, int(max_prompts))
        self.max_share = max_share

    def add(self, block_hashes: Sequence[Hashable], cached_blocks: int, now: float) -> None:
        """Record a routed prompt (its full-block hashes) whose longest prefix cached on any
        replica was ``cached_blocks`` long when it was routed. O(blocks): the router runs it
        with its bookings, after the decision. Mutates."""
        if not block_hashes:
            return
        ends = self._ends
        last_end = -1
        for i, h in enumerate(block_hashes):
            if h in ends:
                last_end = i
        self._follows.add(1.0 if last_end >= 0 else 0.0, now)
        self._held.add(1.0 if 0 <= last_end < cached_blocks else 0.0, now)
        key = block_hashes[-1]
        ends[key] = None
        ends.move_to_end(key)
        while len(ends) > self.max_prompts:
            ends.popitem(last=False)

    def expected(self, now: float) -> float:
        """Later requests a prompt routed now expects on the replica caching it (0 before any
        sample). Pure."""
        follows, held = self._follows.value(now), self._held.value(now)
        if follows is None or held is None:
            return 0.0
        return min(held, self.max_share) / (1.0 - min(follows, self.max_share))
