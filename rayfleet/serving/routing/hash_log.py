"""A replica's cached block hashes, published as a bounded log plus a periodic full set.

Pool routers (``pool_router.PoolRouterCore``, one in every process holding a handle) learn what
each replica caches from the stats the replica publishes with ``record_routing_stats``.

Design decisions:
- Serve hands each router only the LATEST stats dict of a replica (missed ones are gone), and a
  router in a new process starts from nothing, so a publication must let a consumer catch up
  from any point. ``HashLogPublisher`` (replica side) publishes ``HASH_LOG_KEYS``:
  ``hash_epoch`` (a fresh token per replica process and per emptied cache), ``hash_seq`` (events
  applied in this epoch), ``hash_log_start`` (the seq just before the oldest logged event) and
  ``hash_log``, the newest events as ``(seq, stored, removed)``: every event since the previous
  publication, and older ones while the log holds at most ``max_log_hashes`` hashes (so a
  consumer that reads every publication never falls behind; the size is bounded by
  ``max_log_hashes`` plus one stats period of change, never the cache). The full set, ``block_hashes`` (as of ``hash_seq``), rides
  along only every ``full_period_s`` and in the first publication.
- ``HashSetMirror`` (router side) applies the events after the last seq it saw, and is then
  exact. A consumer that fell behind the log (``last seq < hash_log_start``: Serve pushed
  publications it never read) drops what it knew of that replica and keeps only what the log
  says, a subset of the truth, until the next full set makes it exact again. So the index never
  claims a block the replica evicted (beyond one stats period and the bookings below); the
  price of falling behind is missed hits on older blocks until it reads a full set (one every
  ``full_period_s``; an idle replica's latest publication always carries one). Rejected:
  keeping the old entries until the next full set: a router that routes rarely may never read a
  publication that carries one, and would keep evicted blocks indefinitely.
- An emptied cache (``reset_prefix_cache`` is one event removing everything) starts a new epoch
  instead of logging a cache-sized event: consumers drop the replica's entries at once.
- Bookings (prompt blocks the router sent to a replica, indexed before the replica reports them)
  are dropped by a publication whose set does not hold them, but only once they are
  ``booking_grace_s`` old on the router's clock (callers that pass no clock: at the next
  publication). Serve hands a router the replica's latest stats some time after the replica
  took them (its poll, then a long-poll broadcast), so a publication taken before the routed
  request reached the replica can arrive after the booking; dropping the booking then sent the
  tenant's next request elsewhere (seen live: one of four requests of a tenant on the wrong
  replica). A booking the replica never caches (the request failed) lingers for the grace only.
- Rejected: the full set in every publication (what pools did first): 100k hashes per replica
  pickled every stats period for every router and diffed by each, O(cache) instead of O(change).
- Publications without ``hash_epoch`` but with ``block_hashes`` (engines that publish their whole
  set, e.g. the Serve LLM pools' text blocks) are read as a full set each time.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.kv_events import KVEvent, is_cleared
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.engine.replica_state import ReplicaId

__all__ = ["HASH_LOG_KEYS", "HashLogPublisher", "HashSetMirror"]

HASH_LOG_KEYS = ("hash_epoch", "hash_seq", "hash_log_start", "hash_log")
"""Keys a replica's stats carry for its cached hashes (plus ``block_hashes`` when full)."""

LogEntry = tuple[int, tuple[Any, ...], tuple[Any, ...]]  # (seq, stored, removed)


class HashLogPublisher:
    """Replica side: the cached set, the epoch, the seq and the bounded event log. Plain class;
    the caller passes the clock (``now_s``, monotonic seconds)."""

    def __init__(self, *, max_log_hashes: int = 4096, full_period_s: float = 10.0) -> None:
        if max_log_hashes < 1:
            raise SpecError("max_log_hashes", max_log_hashes, "must be at least 1", "use e.g. 4096")
        if full_period_s <= 0:
            raise SpecError("full_period_s", full_period_s, "must be positive", "use e.g. 10")
        self.max_log_hashes = max_log_hashes
        self.full_period_s = full_period_s
        self.cached: set = set()
        self._token = uuid.uuid4().hex[:12]  # a restarted replica never reuses an epoch
        self._num_epochs = 0
        self.epoch = f"{self._token}:0"
        self.seq = 0
        self.log_start = 0
        self._log: deque[LogEntry] = deque()
        self._log_hashes = 0
        self._last_full_s: float | None = None
        self._published_seq = 0  # events up to here were in an earlier publication

    def apply(self, events: Iterable[KVEvent | KVCacheEvent]) -> bool:
        """Apply the engine's KV events in order; True if the cached set changed."""
        changed = False
        for event in events:
            if is_cleared(event):  # AllBlocksCleared: consumers drop everything at once
                changed = changed or bool(self.cached)
                if self.cached:
                    self.cached.clear()
                    self._new_epoch()
                continue
            if not event.stored and not event.removed:
                continue
            changed = True
            self.cached.update(event.stored)
            self.cached.difference_update(event.removed)
            if not self.cached and event.removed:
                self._new_epoch()  # emptied (a reset): consumers drop everything at once
                continue
            self.seq += 1
            self._log.append((self.seq, tuple(event.stored), tuple(event.removed)))
            self._log_hashes += len(event.stored) + len(event.removed)
        return changed

    def _new_epoch(self) -> None:
        self._num_epochs += 1
        self.epoch = f"{self._token}:{self._num_epochs}"
        self.seq = self.log_start = self._log_hashes = self._published_seq = 0
        self._log.clear()

    def full_due(self, now_s: float) -> bool:
        """Whether the next publication carries the full set (first one, or a period passed)."""
        return self._last_full_s is None or now_s - self._last_full_s >= self.full_period_s

    def fields(self, now_s: float) -> dict[str, Any]:
        """The hash keys of one publication (``HASH_LOG_KEYS``, plus ``block_hashes`` when
        ``full_due``). Size: O(``max_log_hashes`` + the events since the last publication)
        except in full publications."""
        # Trim only events an earlier publication carried: a consumer reading every
        # publication never falls behind, however many events one stats period brings.
        while self._log_hashes > self.max_log_hashes and self._log and self._log[0][0] <= self._published_seq:
            seq, stored, removed = self._log.popleft()
            self._log_hashes -= len(stored) + len(removed)
            self.log_start = seq
        self._published_seq = self.seq
        out: dict[str, Any] = {"hash_epoch": self.epoch, "hash_seq": self.seq, "hash_log_start": self.log_start,
                               "hash_log": tuple(self._log)}
        if self.full_due(now_s):
            self._last_full_s = now_s
            out["block_hashes"] = tuple(self.cached)
        return out


@dataclass
class _Mirrored:
    epoch: Any = None
    seq: int = 0
    in_step: bool = False  # every event since the last full set applied: the mirror is exact
    published: set = field(default_factory=set)  # the replica's set as far as we know
    # Indexed by bookings, not (yet) published: hash -> when booked (router clock; None: no clock).
    booked: dict = field(default_factory=dict)


class HashSetMirror:
    """Router side: every replica's published set, kept in ``index`` (``PrefixIndex``) together
    with the bookings. Plain class; mutates ``index``."""

    def __init__(self, index: PrefixIndex, *, booking_grace_s: float = 10.0) -> None:
        if booking_grace_s < 0:
            raise SpecError("booking_grace_s", booking_grace_s, "must not be negative",
                            "use a few stats periods, e.g. 10")
        self.index = index
        self.booking_grace_s = booking_grace_s
        self._replicas: dict[ReplicaId, _Mirrored] = {}

    def in_step(self, rid: ReplicaId) -> bool:
        """True when this mirror of ``rid`` is exact (no missed events since its last full set)."""
        m = self._replicas.get(rid)
        return m is not None and m.in_step

    def observe(self, rid: ReplicaId, stats: Mapping[str, Any], now_s: float | None = None) -> None:
        """Apply one new publication of ``rid`` (see module doc for the catch-up rules and for
        ``now_s``, the router's monotonic clock that keeps young bookings)."""
        m = self._replicas.setdefault(rid, _Mirrored())
        full = stats.get("block_hashes")
        if "hash_epoch" not in stats:  # a publisher of its whole set every time
            if full is not None:
                self._reset(rid, m, full, now_s)
                m.epoch, m.seq = None, 0
            self._drop_unconfirmed(rid, m, now_s)
            return
        epoch, seq, start = stats["hash_epoch"], int(stats["hash_seq"]), int(stats["hash_log_start"])
        if epoch != m.epoch:  # a reset cache, a restarted replica, or first sight
            self._reset(rid, m, (), now_s)
            m.epoch, m.seq, m.in_step = epoch, 0, True
        if m.seq < start:  # events we never saw left the log: what we knew may be stale
            self._reset(rid, m, (), now_s)
            m.seq, m.in_step = start, False
        if full is not None and not m.in_step:
            self._reset(rid, m, full, now_s)
            m.seq, m.in_step = seq, True
        else:
            self._apply_log(rid, m, stats["hash_log"])
            m.seq = max(m.seq, seq)
        self._drop_unconfirmed(rid, m, now_s)

    def book(self, rid: ReplicaId, hashes: Sequence[Any], now_s: float | None = None) -> None:
        """Index ``hashes`` on ``rid`` ahead of its publication (routed there at ``now_s``)."""
        m = self._replicas.setdefault(rid, _Mirrored())
        m.booked.update((h, now_s) for h in hashes if h not in m.published)
        self.index.add_blocks(rid, hashes)

    def forget(self, rid: ReplicaId) -> None:
        self._replicas.pop(rid, None)
        self.index.remove_replica(rid)

    def _apply_log(self, rid: ReplicaId, m: _Mirrored, log: Sequence[LogEntry]) -> None:
        for seq, stored, removed in log:
            if seq <= m.seq:
                continue
            if stored:
                m.published.update(stored)
                self.index.add_blocks(rid, stored)
            if removed:
                m.published.difference_update(removed)
                self.index.remove_blocks(rid, removed)

    def _young(self, booked_at: float | None, now_s: float | None) -> bool:
        return booked_at is not None and now_s is not None and now_s - booked_at < self.booking_grace_s

    def _reset(self, rid: ReplicaId, m: _Mirrored, full: Iterable[Any], now_s: float | None) -> None:
        new = set(full)
        keep = {h: t for h, t in m.booked.items() if h not in new and self._young(t, now_s)}
        old = m.published | set(m.booked)
        self.index.remove_blocks(rid, old - new - set(keep))
        self.index.add_blocks(rid, new - old)
        m.published, m.booked = new, keep

    def _drop_unconfirmed(self, rid: ReplicaId, m: _Mirrored, now_s: float | None) -> None:
        if not m.booked:
            return
        drop = {h for h, t in m.booked.items() if h not in m.published and not self._young(t, now_s)}
        self.index.remove_blocks(rid, drop)
        m.booked = {h: t for h, t in m.booked.items() if h not in m.published and h not in drop}
