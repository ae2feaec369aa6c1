"""``PoolRouterCore``: ranks the replicas of one pool deployment for Serve's request router.

Design decisions:
- Deployed apps route without a router deployment: each pool is one Serve deployment and
  ``PoolRouterCore`` (driven by ``request_router.PrefixLoadRequestRouter`` inside the caller's
  handle) ranks that pool's replicas per call from their published routing stats
  (``ROUTING_STATS_KEYS``: a snapshot with a version; the cached block hashes as
  ``hash_log.HASH_LOG_KEYS``) and a ``RouteHint`` the caller attaches to the call (the prompt's
  block hashes, computed once by the caller; a pinned replica for calls that must reach one
  replica). Stats are a state, not an event stream, because Serve hands the same latest stats
  to every caller's router: the hashes come as a bounded log of recent events plus a periodic
  full set (``hash_log``), so an update costs O(change), not O(cached blocks).
- Between two publications the core books routed work exactly as ``router.RouterCore`` does,
  the TTFT cost's other inputs included (``prefill_outlook.PrefillOutlook``: queues drained at
  each replica's rate from the publication on, recent prefill load, later requests per prompt).
  The routed prompt's blocks are indexed on the chosen replica by ``flush_bookings``, which the
  request router runs after it has answered (off the decision path); the next ``observe`` or
  ``rank`` runs it first if it has not run.
- Plain class (no Ray, clock or I/O): ``now_s`` comes from the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rayfleet.errors import SpecError
from rayfleet.serving.routing.hash_log import HashSetMirror
from rayfleet.serving.engine.replica_state import ReplicaSnapshot, ReplicaId
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prefill_outlook import PrefillOutlook
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.recent_work import DecayedMean, PrefixWorkLedger, RecentWorkLedger
from rayfleet.serving.routing.ttft_cost import PrefillRateEstimator, TTFTPolicy

__all__ = ["Mode", "RouteHint", "PoolRouterCore", "ROUTING_STATS_KEYS", "OPTIONAL_ROUTING_STATS_KEYS", "report_time"]

Mode = Literal["prefix_aware", "round_robin"]

ROUTING_STATS_KEYS = ("version", "num_total_blocks", "num_free_blocks", "num_active_blocks", "num_queued_blocks",
                      "num_running_requests", "max_num_seqs")
"""What a replica's ``record_routing_stats`` must publish for ``PoolRouterCore`` (extra keys are
ignored): a ``version`` that changes with every publication and the ``ReplicaSnapshot`` numbers.
``OPTIONAL_ROUTING_STATS_KEYS`` may come too: the built-in engine's prefill totals (without them
a replica is priced at the pool's or the prior rate) and ``taken_at``, the replica's wall clock
(``time.time()``) when it took the numbers (without it a report is dated when the router reads it).
Its cached block hashes (any engine: only equality matters) come as ``hash_log.HASH_LOG_KEYS``
plus a periodic full ``block_hashes``, or as ``block_hashes`` alone (the whole set every time)."""
OPTIONAL_ROUTING_STATS_KEYS = ("num_prefill_tokens_total", "prefill_seconds_total", "taken_at")


@dataclass(frozen=True)
class RouteHint:
    """What a pool's router needs to know about one call (passed as the ``route`` keyword).

    ``block_hashes``/``num_prompt_blocks`` rank a prefill/colocated pool; ``num_blocks_needed``
    (prompt plus room to generate) ranks a decode pool. ``replica`` pins the call to one replica
    (KV release, abort, spans, per-replica usage); ``avoid`` names replicas that just failed
    this request (skipped while another replica exists)."""

    block_hashes: tuple[Any, ...] = ()
    num_prompt_blocks: int = 0
    num_blocks_needed: int = 0
    replica: str | None = None
    avoid: tuple[str, ...] = ()


def report_time(now_s: float | None, wall_s: float | None, taken_at: Any) -> float | None:
    """When a report's numbers were true, on the router's clock: ``now_s`` less the report's age
    (``wall_s - taken_at``, both wall clocks). Serve hands a router a replica's stats seconds
    after the replica took them (its poll, then a broadcast); dated when read, a queue that was
    long gone looked current, and a tenant's request left the replica caching its prefix (seen
    live: one of four requests of a tenant on the other replica, after a report taken while the
    previous request was queued). A report dated in the future (the replica's clock ahead) is
    dated ``now_s``. Pure."""
    if now_s is None or wall_s is None or not isinstance(taken_at, (int, float)):
        return now_s
    return now_s - max(0.0, wall_s - float(taken_at))


class PoolRouterCore:
    """Ranks the replicas of one pool (``role``: prefill, decode or colocated). Plain class."""

    def __init__(self, *, role: str, policy: TTFTPolicy | RouterPolicy = TTFTPolicy(), mode: Mode = "prefix_aware",
                 load_memory_s: float = 300.0, activity_memory_s: float = 30.0,
                 booking_grace_s: float = 10.0, tokens_per_block: int = 16) -> None:
        if role not in ("prefill", "decode", "colocated"):
            raise SpecError("request_router_kwargs.role", role, "is not a pool role",
                            "use prefill, decode or colocated")
        self.role = role
        self.policy = policy
        self.tokens_per_block = tokens_per_block  # what one routing block holds (the TTFT cost's unit)
        self.prefill_rates = PrefillRateEstimator(prior_tokens_per_s=getattr(policy, "prior_tokens_per_s", 4000.0))
        self.mode = mode
        self.index = PrefixIndex()
        # Published hashes (and bookings) per replica, in ``index``; a booking outlives publications
        # taken before its request arrived for ``booking_grace_s`` (``hash_log`` module doc).
        self.hashes = HashSetMirror(self.index, booking_grace_s=booking_grace_s)
        self.snapshots: dict[ReplicaId, ReplicaSnapshot] = {}
        self.versions: dict[ReplicaId, Any] = {}  # version of the last applied publication per replica
        self.recent_work = RecentWorkLedger(load_memory_s)
        self.activity = RecentWorkLedger(activity_memory_s)  # the same bookings, short memory
        self.own_activity = PrefixWorkLedger(activity_memory_s)  # ... and per prompt (its own turns)
        self.prompt_blocks = DecayedMean(load_memory_s)
        self.request_work = DecayedMean(load_memory_s)  # booked work per request
        self.outlook = PrefillOutlook(activity_memory_s)  # the TTFT cost's other inputs
        self._rr = itertools.count()
        # Prompt blocks booked on their replica but not yet indexed (``flush_bookings``), with when.
        self._pending_bookings: list[tuple[ReplicaId, Sequence[Any], float | None]] = []

    def observe(self, replica: str, stats: Mapping[str, Any] | None, now_s: float | None = None,
                wall_s: float | None = None) -> bool:
        """Apply ``replica``'s published stats if their version is new; True if applied.
        ``now_s`` (the clock ``rank`` gets) keeps bookings younger than the grace; ``wall_s`` (the
        caller's ``time.time()``) dates the report's queue when the stats carry ``taken_at``
        (``report_time``)."""
        rid = ReplicaId(replica)
        if rid not in self.snapshots:  # joins the pool: its ledgers start at its peers' mean
            for ledger in (self.recent_work, self.activity):
                ledger.join(rid, list(self.snapshots))
        if not stats or "version" not in stats:
            self.snapshots.setdefault(rid, self._unknown(rid))
            return False
        if rid in self.versions and self.versions[rid] == stats["version"]:
            return False
        self.flush_bookings()  # a booking must not land after the events that follow it
        self.versions[rid] = stats["version"]
        last = self.snapshots.get(rid)
        self.snapshots[rid] = snap = ReplicaSnapshot(
            rid, int(stats["num_total_blocks"]), int(stats["num_free_blocks"]), int(stats["num_active_blocks"]),
            int(stats.get("num_queued_blocks", 0)), int(stats.get("num_running_requests", 0)),
            int(stats.get("max_num_seqs", 0)), num_prefill_tokens_total=int(stats.get("num_prefill_tokens_total", 0)),
            prefill_seconds_total=float(stats.get("prefill_seconds_total", 0.0)))
        self.outlook.report(rid, snap.num_queued_blocks * self.tokens_per_block,
                            report_time(now_s, wall_s, stats.get("taken_at")))
        if last is not None and snap.num_prefill_tokens_total >= last.num_prefill_tokens_total:
            self.prefill_rates.observe(rid, snap.num_prefill_tokens_total - last.num_prefill_tokens_total,
                                       snap.prefill_seconds_total - last.prefill_seconds_total)
        self.hashes.observe(rid, stats, now_s)
        return True

    def _unknown(self, rid: ReplicaId) -> ReplicaSnapshot:
        # A replica that has not published yet (just started): as roomy as the roomiest known one.
        total = max((s.num_total_blocks for s in self.snapshots.values()), default=1 << 30)
        return ReplicaSnapshot(rid, total, total, 0)

    def retain(self, replicas: Sequence[str]) -> None:
        """Forget replicas that left the pool (Serve stopped or replaced them)."""
        keep = set(replicas)
        gone = [r for r in self.snapshots if r not in keep]
        if not gone:
            return
        self.flush_bookings()
        for rid in gone:
            self.snapshots.pop(rid, None)
            self.versions.pop(rid, None)
            self.outlook.forget(rid)
            self.hashes.forget(rid)
            self.recent_work.forget(rid)
            self.activity.forget(rid)

    def rank(self, replicas: Sequence[str], hint: RouteHint | None, *,
             now_s: float | None = None) -> list[list[str]]:
        """Ranked tiers of ``replicas`` for one call (best first, one replica per tier), and the
        routed work booked on the first (its prompt blocks are indexed by ``flush_bookings``).
        A pinned replica that is not in ``replicas`` gives ``[]``: the caller decides (Serve's
        router must not wait for it). ``now_s`` (a monotonic clock) turns on the recent-work
        ledger behind the policy's overload term."""
        hint = hint or RouteHint()
        if hint.replica is not None:
            return [[hint.replica]] if hint.replica in replicas else []
        self.flush_bookings()
        names = [n for n in replicas if n not in hint.avoid] or list(replicas)
        for n in names:
            self.snapshots.setdefault(ReplicaId(n), self._unknown(ReplicaId(n)))
        snaps = [self.snapshots[ReplicaId(n)] for n in names]
        if self.mode == "round_robin":
            start = next(self._rr) % max(1, len(names))
            return [[n] for n in names[start:] + names[:start]]
        if self.role != "decode" and not hint.block_hashes and not hint.num_prompt_blocks:
            # A control call (usage, state): no prompt to match or book, so the least loaded
            # replica; the prefill policy divides by the pool's work, which may be 0 here.
            return [[str(s.replica_id)] for s in sorted(snaps, key=lambda s: s.num_active_blocks + s.num_queued_blocks)]
        if self.role == "decode":
            ranked = [s.replica_id for s in self.policy.choose_decode(
                snaps, num_blocks_needed=hint.num_blocks_needed).ranked]
            if ranked:
                self._book_decode(ranked[0], hint.num_blocks_needed)
        else:
            ranked = self._rank_prefill(snaps, hint, now_s)
        return [[str(r)] for r in ranked]

    def _rank_prefill(self, snaps: list[ReplicaSnapshot], hint: RouteHint, now_s: float | None) -> list[ReplicaId]:
        ledgers = now_s is not None and self.policy.uses_ledgers  # the TTFT cost reads none
        recent = {s.replica_id: self.recent_work.value(s.replica_id, now_s) for s in snaps} if ledgers else None
        active = {s.replica_id: self.activity.value(s.replica_id, now_s) for s in snaps} if ledgers else None
        hashes = list(hint.block_hashes)
        matched = self.index.match_prefix(hashes)
        num_blocks = max(hint.num_prompt_blocks, len(hashes))
        tpb = self.tokens_per_block
        rates = self.prefill_rates.rates([s.replica_id for s in snaps])
        decision = self.policy.choose_prefill(snaps, hashes, self.index, matched=matched,
                                              num_prompt_blocks=num_blocks, max_ranked=1, recent_work=recent,
                                              activity=active, mean_request_blocks=(
                                                  self.prompt_blocks.value(now_s) if ledgers else None),
                                              mean_request_work=self.request_work.value(now_s) if ledgers else None,
                                              own_activity=self.own_activity.own(hashes, matched, now_s)
                                              if ledgers else None,
                                              prefill_rate=rates, tokens_per_block=tpb,
                                              **self.outlook.cost_inputs(
                                                  [(s.replica_id, s.num_queued_blocks * tpb) for s in snaps],
                                                  rates, now_s))
        ranked = list(decision.order)
        if ranked:
            hit = matched.get(ranked[0], 0)
            snap = self.snapshots[ranked[0]]
            self.outlook.book(ranked[0], uncached_tokens=(num_blocks - hit) * tpb, block_hashes=hashes,
                              cached_blocks=max(matched.values(), default=0), now_s=now_s,
                              rate=rates[ranked[0]], reported_queued_tokens=snap.num_queued_blocks * tpb)
            self.snapshots[ranked[0]] = replace(snap, num_queued_blocks=snap.num_queued_blocks + num_blocks - hit)
            if len(hashes) > hit:  # the first ``hit`` are indexed there already
                self._pending_bookings.append((ranked[0], hashes[hit:], now_s))
            if now_s is not None:  # booked whatever the cost reads (O(1); a switched policy finds them)
                self.recent_work.add(ranked[0], num_blocks - hit, now_s)
                self.activity.add(ranked[0], num_blocks - hit, now_s)
                self.own_activity.add(ranked[0], hashes, num_blocks - hit, now_s)
                self.prompt_blocks.add(num_blocks, now_s)
                self.request_work.add(num_blocks - hit, now_s)
        return ranked

    def flush_bookings(self) -> None:
        """Index the prompt blocks booked by earlier decisions on their replicas (they will
        cache them within a step). Mutates the index; cheap when nothing is pending."""
        pending, self._pending_bookings = self._pending_bookings, []
        for rid, hashes, booked_at in pending:
            if rid in self.snapshots:  # not a replica that left the pool meanwhile
                self.hashes.book(rid, hashes, booked_at)
        self.outlook.flush()

    def _book_decode(self, rid: ReplicaId, needed: int) -> None:
        d = self.snapshots[rid]
        self.snapshots[rid] = replace(d, num_free_blocks=d.num_free_blocks - needed,
                                      num_active_blocks=d.num_active_blocks + needed,
                                      num_running_requests=d.num_running_requests + 1)
