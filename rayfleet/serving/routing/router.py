"""The router: ``RouterCore`` (plain class) and ``Router`` (its async shell, in-process apps),
and the registry of this process's pool request routers.

Design decisions:
- ``RouterCore`` keeps the last ``ReplicaSnapshot`` of every engine replica and a
  ``PrefixIndex`` fed by their KV events, and calls the pure ``RouterPolicy`` for each request.
  No Ray, clock or I/O: the benchmark times it with 64 replicas and 100k indexed blocks.
- Snapshots are polled (``poll_interval_s``), so between polls the router would send a burst
  to the same replica. After every decision it therefore books the work it just routed:
  the prefill replica's queued blocks grow by the blocks it must prefill, the decode replica
  loses the blocks the request will need, and the prompt's hashes are indexed on the prefill
  replica at once (it will cache them within a step; SGLang's router does the same). The next
  poll overwrites the guesses with the truth.
- The prefill cost is ``ttft_cost.TTFTPolicy`` by default (predicted TTFT in seconds;
  ``policy.RouterPolicy``, the block-unit cost, stays selectable). Each replica's prefill rate
  is learned from the growth of the prompt tokens and prefill seconds its snapshots report
  (``PrefillRateEstimator``); a snapshot whose totals fell (a restarted replica) is no sample.
  Its other inputs (each replica's queue drained at that rate between polls, the prefill load
  booked on it lately, the later requests a prompt brings) are a ``prefill_outlook.PrefillOutlook``.
- ``round_robin`` is the baseline the benchmark compares with: it ignores prefixes and load.
- Long prompts (``long_prefill``, see ``long_context``): when the uncached part of a prompt
  reaches the policy's threshold, the plan also carries spans over several first-role replicas,
  sized by their queued prefill work, and each span is booked on its replica.
- A replica reported failed (by the ingress) is unhealthy and leaves the index until a poll
  succeeds again (Serve restarts dead replicas).
- ``Router`` polls all replicas concurrently through ``PolledReplica``s (the one call it needs,
  as a protocol of its own: ``deploy.replica_client``'s clients satisfy it); one router per app,
  because KV events are consumed by whoever polls. It polls every ``poll_interval_s`` while
  there is work (a request routed since the last poll, or any replica running or queueing
  one) and every ``idle_poll_interval_s`` otherwise, woken at once by the next route: an idle
  app with ten polls a second per replica kept a core of a small machine a third busy, and an
  idle replica has nothing new to say (a dead one is still found within the idle interval).
- Deployed apps route without a router deployment: ``pool_router.PoolRouterCore`` (re-exported
  here with ``RouteHint`` and ``ROUTING_STATS_KEYS``) ranks a pool's replicas inside the
  caller's handle. The registry of this process's pool request routers stays in this module:
  ``request_router`` is pickled by value by Serve, so its own globals would be a copy per handle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash, hash_full_blocks, root_block_hash
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot, ReplicaState
from rayfleet.serving.routing.long_prefill import LongPrefillPolicy, SpanAssignment
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prefill_outlook import PrefillOutlook
from rayfleet.serving.routing.pool_router import ROUTING_STATS_KEYS, Mode, PoolRouterCore, RouteHint
from rayfleet.serving.routing.prompt_hashes import PromptHashCache
from rayfleet.serving.routing.recent_work import DecayedMean, PrefixWorkLedger, RecentWorkLedger
from rayfleet.serving.routing.ttft_cost import PrefillRateEstimator, TTFTPolicy

__all__ = ["RoutePlan", "RouterCore", "Router", "PolledReplica", "RouteHint", "PoolRouterCore",
           "ROUTING_STATS_KEYS", "register_pool_router", "pool_router"]

log = logging.getLogger(__name__)
POLL_MISSES_UNHEALTHY = 3
"""Poll deadlines a replica may miss in a row before the router stops sending to it (a failed
poll, e.g. a dead actor, makes it unhealthy at once)."""

@dataclass(frozen=True)
class RoutePlan:
    """Ranked replica names for one request: ``first`` is the prefill (or colocated) pool,
    ``decode`` is empty in colocated mode. Callers try them in order. ``spans``, when set,
    splits the prefill over replicas (``split_prefill``); colocated decode then runs on the
    last span's replica."""

    first: tuple[str, ...]
    decode: tuple[str, ...]
    reason: str
    spans: tuple[SpanAssignment, ...] = ()


class RouterCore:
    """Mutable routing state for one app. ``roles``: role -> replica names."""

    def __init__(self, *, roles: Mapping[str, Sequence[str]], policy: TTFTPolicy | RouterPolicy = TTFTPolicy(),
                 mode: Mode = "prefix_aware", block_size: int, model_id: str,
                 num_blocks_hint: int = 1 << 30, long_prefill: LongPrefillPolicy | None = None,
                 load_memory_s: float = 300.0, activity_memory_s: float = 30.0) -> None:
        self.long_prefill = long_prefill
        # Measured prefill tokens/s per replica, from the growth of its reported totals.
        self.prefill_rates = PrefillRateEstimator(prior_tokens_per_s=getattr(policy, "prior_tokens_per_s", 4000.0))
        self._prefill_totals: dict[ReplicaId, tuple[int, float]] = {}
        self.outlook = PrefillOutlook(activity_memory_s)  # the TTFT cost's other inputs
        self.recent_work = RecentWorkLedger(load_memory_s)
        self.activity = RecentWorkLedger(activity_memory_s)  # the same bookings, short memory
        self.own_activity = PrefixWorkLedger(activity_memory_s)  # ... and per prompt (its own turns)
        self.prompt_blocks = DecayedMean(load_memory_s)
        self.request_work = DecayedMean(load_memory_s)  # booked work per request
        self.roles = {role: [ReplicaId(n) for n in names] for role, names in roles.items()}
        self.first_role = "colocated" if "colocated" in self.roles else "prefill"
        self.policy = policy
        self.mode = mode
        self.block_size = block_size
        self.model_id = model_id
        self.index = PrefixIndex()
        self.snapshots: dict[ReplicaId, ReplicaSnapshot] = {
            ReplicaId(n): ReplicaSnapshot(ReplicaId(n), num_blocks_hint, num_blocks_hint, 0)
            for names in self.roles.values() for n in names}
        self._rr = {role: itertools.count() for role in self.roles}
        # Prompt blocks booked on their prefill replica but not yet indexed (``flush_bookings``).
        self._pending_bookings: list[tuple[ReplicaId, Sequence[BlockHash]]] = []

    # -- observations ---------------------------------------------------------------------------

    def observe(self, replica: str, snapshot: ReplicaSnapshot, events: Sequence[Any] = (),
                now_s: float | None = None) -> None:
        """A successful poll: its snapshot replaces our guesses; its KV events update the index.
        ``now_s`` (the clock ``route`` gets) dates its queue, which then drains between polls."""
        self.flush_bookings()  # a booking must not land after the eviction events that follow it
        rid = ReplicaId(replica)
        was_healthy = self.snapshots.get(rid, snapshot).healthy
        if rid not in self.snapshots or not was_healthy:  # (re)joins: its ledgers start at its peers' mean
            peers = [r for r, s in self.snapshots.items() if s.healthy]
            for ledger in (self.recent_work, self.activity):
                ledger.join(rid, peers)
        # Keyed and named by the caller's name for it: a replica's engine may name itself otherwise
        # (``role/replica``), and a plan must name replicas as ``snapshots`` keys them.
        self.snapshots[rid] = replace(snapshot, replica_id=rid, healthy=True)
        self.outlook.report(rid, snapshot.num_queued_blocks * self.block_size, now_s)
        self._learn_prefill_rate(rid, snapshot)
        if not was_healthy:  # its cache was lost with it: start its index afresh
            self.index.remove_replica(rid)
        self.index.apply_events(rid, events)

    def _learn_prefill_rate(self, rid: ReplicaId, snapshot: ReplicaSnapshot) -> None:
        totals = (snapshot.num_prefill_tokens_total, snapshot.prefill_seconds_total)
        last = self._prefill_totals.get(rid)
        self._prefill_totals[rid] = totals
        if last is not None and totals[0] >= last[0]:  # lower totals: a restarted replica
            self.prefill_rates.observe(rid, totals[0] - last[0], totals[1] - last[1])

    def mark_unhealthy(self, replica: str) -> None:
        self.flush_bookings()
        rid = ReplicaId(replica)
        if rid in self.snapshots:
            self.snapshots[rid] = replace(self.snapshots[rid], healthy=False)
        self.index.remove_replica(rid)
        self.recent_work.forget(rid)
        self.activity.forget(rid)
        self.outlook.forget(rid)

    def set_mode(self, mode: Mode) -> None:
        if mode not in ("prefix_aware", "round_robin"):
            raise SpecError("router.policy", mode, "unknown routing policy", "use prefix_aware or round_robin")
        self.mode = mode

    # -- decisions ------------------------------------------------------------------------------

    def route(self, prompt_token_ids: Sequence[int], *, max_tokens: int, cache_salt: str | None = None,
              exclude: Sequence[str] = (), block_hashes: Sequence[BlockHash] | None = None,
              now_s: float | None = None) -> RoutePlan:
        """Rank replicas for one request and book the routed work (see module doc).

        ``block_hashes`` are the prompt's full-block hashes when the caller already has them
        (they are then not recomputed); ``now_s`` (a monotonic clock) turns on the recent-work
        ledger that the policy's overload term reads. One bounded prefix walk per decision
        (``PrefixIndex.match_prefix``); the blocks the chosen replica does not hold yet are
        indexed by ``flush_bookings``, which the async shell runs after the decision is
        returned (off the decision path) and the next decision runs first if it was not."""
        self.flush_bookings()
        hashes = list(block_hashes) if block_hashes is not None else hash_full_blocks(
            list(prompt_token_ids), block_size=self.block_size,
            root=root_block_hash(model_id=self.model_id, cache_salt=cache_salt))
        num_prompt_blocks = -(-len(prompt_token_ids) // self.block_size)
        excluded = set(exclude)
        first_snaps = [s for n in self.roles[self.first_role]
                       if (s := self.snapshots[n]).healthy and n not in excluded]
        # The ledger goes to the policy as a map: a copied snapshot per replica per decision
        # (``dataclasses.replace``) was a third of a 64-replica decision.
        ledgers = now_s is not None and self.policy.uses_ledgers  # the TTFT cost reads none
        recent = ({s.replica_id: self.recent_work.value(s.replica_id, now_s) for s in first_snaps}
                  if ledgers else None)
        active = ({s.replica_id: self.activity.value(s.replica_id, now_s) for s in first_snaps}
                  if ledgers else None)
        matched = self.index.match_prefix(hashes) if self.mode == "prefix_aware" else {}
        bs = self.block_size
        rates = self.prefill_rates.rates([s.replica_id for s in first_snaps])
        spans: tuple[SpanAssignment, ...] = ()
        if self.mode == "prefix_aware" and self.long_prefill is not None:
            hit = max(matched.values(), default=0)
            split = self.long_prefill.plan(len(prompt_token_ids), first_snaps, block_size=self.block_size,
                                           num_uncached_tokens=len(prompt_token_ids) - hit * self.block_size)
            spans = split.spans if split is not None else ()
        if spans:
            for span in spans:
                snap = self.snapshots[ReplicaId(span.replica_id)]
                self.snapshots[snap.replica_id] = replace(snap, num_queued_blocks=snap.num_queued_blocks + -(
                    -(span.end - span.start) // self.block_size))
                self.outlook.queued.book(snap.replica_id, span.end - span.start, now_s,
                                         self.prefill_rates.rate(snap.replica_id), snap.num_queued_blocks * bs)
            first = (spans[-1].replica_id,)
            reason = f"split prefill: {split.reason}"
        elif self.mode == "round_robin":
            first = self._round_robin(self.first_role, first_snaps)
            reason = "round robin"
        else:
            decision = self.policy.choose_prefill(first_snaps, hashes, self.index, matched=matched,
                                                  num_prompt_blocks=num_prompt_blocks, max_ranked=1,
                                                  recent_work=recent, activity=active,
                                                  mean_request_blocks=self.prompt_blocks.value(now_s)
                                                  if ledgers else None,
                                                  mean_request_work=self.request_work.value(now_s)
                                                  if ledgers else None,
                                                  own_activity=self.own_activity.own(hashes, matched, now_s)
                                                  if ledgers else None,
                                                  prefill_rate=rates, tokens_per_block=bs,
                                                  num_prompt_tokens=len(prompt_token_ids),
                                                  **self.outlook.cost_inputs(
                                                      [(s.replica_id, s.num_queued_blocks * bs) for s in first_snaps],
                                                      rates, now_s))
            first = decision.order
            reason = decision.reason
        if first and not spans:
            chosen = self.snapshots[ReplicaId(first[0])]
            hit = matched.get(chosen.replica_id, 0)
            self.outlook.book(chosen.replica_id, uncached_tokens=max(0, len(prompt_token_ids) - hit * bs),
                              block_hashes=hashes, cached_blocks=max(matched.values(), default=0), now_s=now_s,
                              rate=self.prefill_rates.rate(chosen.replica_id),
                              reported_queued_tokens=chosen.num_queued_blocks * bs)
            self.snapshots[chosen.replica_id] = replace(
                chosen, num_queued_blocks=chosen.num_queued_blocks + num_prompt_blocks - hit)
            if len(hashes) > hit:  # its first ``hit`` are indexed there already
                self._pending_bookings.append((chosen.replica_id, hashes[hit:]))
            if now_s is not None:  # booked whatever the cost reads (O(1); a switched policy finds them)
                work = num_prompt_blocks - hit + -(-max_tokens // self.block_size)
                self.recent_work.add(chosen.replica_id, work, now_s)
                self.activity.add(chosen.replica_id, work, now_s)
                self.own_activity.add(chosen.replica_id, hashes, work, now_s)
                self.prompt_blocks.add(num_prompt_blocks, now_s)
                self.request_work.add(work, now_s)
        decode: tuple[str, ...] = ()
        if "decode" in self.roles:
            needed = -(-(len(prompt_token_ids) + max_tokens) // self.block_size)
            decode_snaps = [s for n in self.roles["decode"] if (s := self.snapshots[n]).healthy and n not in excluded]
            if self.mode == "round_robin":
                decode = self._round_robin("decode", decode_snaps)
            else:
                decode = tuple(s.replica_id for s in
                               self.policy.choose_decode(decode_snaps, num_blocks_needed=needed).ranked)
            if decode:
                d = self.snapshots[ReplicaId(decode[0])]
                self.snapshots[d.replica_id] = replace(
                    d, num_free_blocks=d.num_free_blocks - needed, num_active_blocks=d.num_active_blocks + needed,
                    num_running_requests=d.num_running_requests + 1)
        return RoutePlan(first=tuple(first), decode=decode, reason=reason, spans=spans)

    def flush_bookings(self) -> None:
        """Index the prompt blocks booked by earlier decisions (their replicas will cache them
        within a step). Mutates the index; cheap when nothing is pending."""
        pending, self._pending_bookings = self._pending_bookings, []
        for rid, hashes in pending:
            self.index.add_blocks(rid, hashes)
        self.outlook.flush()

    def _round_robin(self, role: str, snaps: list[ReplicaSnapshot]) -> tuple[str, ...]:
        if not snaps:
            return ()
        start = next(self._rr[role]) % len(snaps)
        return tuple(s.replica_id for s in snaps[start:] + snaps[:start])


class PolledReplica(Protocol):
    """What the router asks of a replica: its state (``AsyncEngine.poll_state``, consumed)."""

    async def poll_state(self) -> ReplicaState: ...


class Router:
    """Async shell: polls replicas, answers ``route``/``report_failure``. In-process apps
    construct it with ``deploy.replica_client.LocalReplicaClient``s."""

    def __init__(self, clients: Mapping[str, PolledReplica], core: RouterCore, *,
                 poll_interval_s: float = 0.1, idle_poll_interval_s: float = 1.0) -> None:
        self.clients = dict(clients)
        self.core = core
        # Hashing is the ingress's, once per prompt, never inside the decision (``prompt_hashes``).
        self.hash_cache = PromptHashCache(block_size=core.block_size, model_id=core.model_id)
        self.poll_interval_s = poll_interval_s
        self.idle_poll_interval_s = max(idle_poll_interval_s, poll_interval_s)
        self.states: dict[str, ReplicaState] = {}
        self._missed: dict[str, int] = {}  # polls in a row a replica let time out (_poll_one)
        self.num_polls = 0  # poll rounds so far (tests, debugging)
        self._task: asyncio.Task | None = None
        self._routed_since_poll = False
        self._wake: asyncio.Event | None = None

    def _ensure_polling(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_one(self, name: str, client: PolledReplica) -> None:
        try:
            state = await asyncio.wait_for(client.poll_state(), timeout=max(2.0, 10 * self.poll_interval_s))
        except asyncio.TimeoutError:
            # Slow, not failed: a replica in a long step on a loaded host can miss a poll's deadline
            # (seen: one missed poll made the only replica unhealthy and a normal request got a 503
            # at load 30). Unhealthy after POLL_MISSES_UNHEALTHY in a row; its last state stands.
            self._missed[name] = self._missed.get(name, 0) + 1
            log.info("router: replica %s did not answer a poll in time (%d in a row)", name, self._missed[name])
            if self._missed[name] >= POLL_MISSES_UNHEALTHY:
                self.core.mark_unhealthy(name)
                self.states.pop(name, None)
            return
        except Exception as exc:  # noqa: BLE001 - any failure to answer makes it unhealthy
            log.info("router: replica %s did not answer a poll (%s)", name, type(exc).__name__)
            self.core.mark_unhealthy(name)
            self.states.pop(name, None)
            return
        self._missed.pop(name, None)
        self.states[name] = state
        self.core.observe(name, state.snapshot, state.events, now_s=time.monotonic())

    async def poll_once(self) -> None:
        self.num_polls += 1
        await asyncio.gather(*(self._poll_one(n, c) for n, c in self.clients.items()))

    def _busy(self) -> bool:
        return any(s.snapshot.num_running_requests or s.snapshot.num_queued_blocks for s in self.states.values())

    async def _poll_forever(self) -> None:
        self._wake = asyncio.Event()
        while True:
            routed, self._routed_since_poll = self._routed_since_poll, False
            self._wake.clear()
            await self.poll_once()
            if routed or self._routed_since_poll or self._busy():
                await asyncio.sleep(self.poll_interval_s)
                continue
            try:  # idle: sleep long, but the next route wakes the loop at once
                await asyncio.wait_for(self._wake.wait(), timeout=self.idle_poll_interval_s)
            except asyncio.TimeoutError:
                pass

    async def route(self, prompt_token_ids: list[int], max_tokens: int, cache_salt: str | None = None,
                    exclude: tuple[str, ...] = ()) -> RoutePlan:
        self._ensure_polling()
        self._routed_since_poll = True
        if self._wake is not None:
            self._wake.set()
        hashes = self.hash_cache.hashes(prompt_token_ids, cache_salt)
        plan = self.core.route(prompt_token_ids, max_tokens=max_tokens, cache_salt=cache_salt, exclude=exclude,
                               block_hashes=hashes, now_s=time.monotonic())
        # Index the routed prompt after the answer is on its way, not before (decision path).
        asyncio.get_running_loop().call_soon(self.core.flush_bookings)
        return plan

    async def report_failure(self, replica: str) -> None:
        self.core.mark_unhealthy(replica)

    async def replica_states(self) -> dict[str, ReplicaState]:
        """Latest polled state per replica (for /metrics and leak checks)."""
        self._ensure_polling()
        return dict(self.states)

    def check_health(self) -> None:
        """Serve health check: the poll loop must be alive once started."""
        if self._task is not None and self._task.done() and self._task.exception() is not None:
            raise RuntimeError(f"router poll loop died: {self._task.exception()!r}")


# -- pools as Serve deployments: ``pool_router``; the registry stays here (request_router's doc) ---

_POOL_ROUTERS: "weakref.WeakValueDictionary[tuple[str, str], Any]" = weakref.WeakValueDictionary()


def register_pool_router(app_name: str, deployment: str, request_router: Any) -> None:
    """This process's request router of a pool deployment (``request_router`` registers itself)."""
    _POOL_ROUTERS[(app_name, deployment)] = request_router


def pool_router(app_name: str, deployment: str) -> Any:
    """The registered request router of ``app_name``/``deployment`` in this process, or None."""
    return _POOL_ROUTERS.get((app_name, deployment))
