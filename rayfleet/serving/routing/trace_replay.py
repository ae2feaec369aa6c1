"""Replaying a request trace through the routing policy: hit rate, its bound, balance, decision time.

Design decisions:
- Traces come in the Mooncake JSONL format (``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids``: one id per 512-token block, equal ids meaning equal content
  at that position). A request's routing blocks are the chained hashes of its ids
  (``hash_block(parent, [id])``), so two requests share block *i* only if they share blocks
  0..i, exactly as the engines' chained block hashes behave.
- The *bound* is the hit rate of one infinite cache that has seen every earlier request: no
  router over finite replicas can beat it. ``hit_rate`` is the share of prompt blocks found in
  the chosen replica's cache when the request arrives.
- Each replica is modelled as an LRU cache of ``cache_blocks`` blocks (its KV events feed the
  router's ``PrefixIndex`` at once) and a FIFO server whose outstanding work is the policy's load
  signal. Work is counted in prefill-token equivalents: uncached prompt tokens plus
  ``decode_token_cost`` per output token. The service rate is set so that the trace, served with
  no cache hits at all, keeps the pool ``utilization`` busy: the replay is neither idle (where any
  policy balances) nor saturated (where queues only grow).
- The router's ledger of recent work (``ReplicaSnapshot.recent_work_blocks``) decays with
  ``load_memory_s``, as ``RouterCore`` keeps it live.
- What the router sees is what the live router sees (``book_running``, the default): each
  replica publishes its state every ``publish_interval_s`` (a poll period), and between
  publications the router books its own decisions, as ``RouterCore.route`` does. A publication
  carries the replica's queued prompt blocks (requests not yet in service: their uncached
  blocks), its running requests and their KV blocks (``num_active_blocks``: in service from the
  start of their prefill until ``decode_step_s`` per output token after its end, continuous
  batching) and the KV events (stored / evicted) since the previous one; the index sees an
  eviction only then. The TTFT cost also gets the inputs ``RouterCore`` keeps for it
  (``prefill_outlook.PrefillOutlook``: queues drained between publications, booked prefill load,
  later requests per prompt); without them the replay measured a router the live one no longer
  was (64 replicas, C=200 T=10: requests max/mean 3.00 vs 1.62). ``book_running=False`` is the
  replay before issue 30: the FIFO's outstanding work as queued blocks, no running requests, state
  current at every decision.
- ``load_max_mean`` is max/mean over replicas of the work each was assigned over the whole trace
  (what a replica actually had to compute), so stickiness that overloads one replica shows.
- Pure apart from the optional ``timer``: no Ray, no I/O beyond reading the trace file.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash, hash_block, root_block_hash
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.replica_state import ReplicaSnapshot, ReplicaId
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prefill_outlook import PrefillOutlook
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.recent_work import DecayedMean, PrefixWorkLedger, RecentWorkLedger

__all__ = ["TraceRequest", "ReplayResult", "read_mooncake_trace", "chain_block_hashes", "replay_routing",
           "infinite_cache_bound", "multi_turn_trace"]

TRACE_BLOCK_TOKENS = 512
LOAD_MEMORY_S = 300.0  # the live router's defaults (``RouterCore``)
ACTIVITY_MEMORY_S = 30.0


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    num_replicas: int
    num_requests: int
    cache_blocks: int
    hit_rate: float
    bound: float
    load_max_mean: float
    route_p50_ms: float
    route_p99_ms: float

    @property
    def share_of_bound(self) -> float:
        return self.hit_rate / self.bound if self.bound else 1.0


def read_mooncake_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace. Raises ``SpecError`` naming the line and field."""
    out: list[TraceRequest] = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = TraceRequest(float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                                   int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
            except (KeyError, ValueError, TypeError) as exc:
                raise SpecError(f"{path}:{lineno}", line.strip()[:80], f"not a Mooncake trace row ({exc!r})",
                                "each line needs timestamp (ms), input_length, output_length, hash_ids") from None
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise SpecError("trace", str(path), "holds no requests", "pass a Mooncake JSONL file with at least one row")
    return out


def chain_block_hashes(block_ids: Sequence[int], root: BlockHash) -> list[BlockHash]:
    """Chained routing hashes of one request's block ids (block i depends on ids 0..i)."""
    hashes, parent = [], root
    for block_id in block_ids:
        parent = hash_block(parent, (block_id,))
        hashes.append(parent)
    return hashes


def infinite_cache_bound(chains: Iterable[Sequence[BlockHash]]) -> float:
    """Share of blocks found in one infinite cache that has seen every earlier request."""
    seen: set[BlockHash] = set()
    hits = total = 0
    for chain in chains:
        for h in chain:
            hits += h in seen
        total += len(chain)
        seen.update(chain)
    return hits / total if total else 0.0


class _ReplicaModel:
    """One replica in the replay: an LRU block cache and a FIFO server (work in token units)."""

    def __init__(self, name: ReplicaId, cache_blocks: int) -> None:
        self.name = name
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.cache_blocks = cache_blocks
        self.busy_until = 0.0
        self.assigned_work = 0.0
        # Routed requests as (service start, end of decode, uncached prompt blocks, KV blocks), and
        # KV events since the last publication (``book_running``).
        self.inflight: list[tuple[float, float, int, int]] = []
        self.events: list[KVCacheEvent] = []

    def publish(self, now: float, cache_blocks: int) -> ReplicaSnapshot:
        """What the engine reports at ``now``: queued prompt blocks, running requests and their
        KV blocks (module doc). Drops requests that ended."""
        self.inflight = [f for f in self.inflight if f[1] > now]
        queued = sum(f[2] for f in self.inflight if f[0] > now)
        running = [f for f in self.inflight if f[0] <= now]
        return ReplicaSnapshot(self.name, cache_blocks, cache_blocks, sum(f[3] for f in running),
                               num_queued_blocks=queued, num_running_requests=len(running))

    def cached_prefix(self, chain: Sequence[BlockHash]) -> int:
        n = 0
        for h in chain:
            if h not in self.cache:
                break
            n += 1
        return n

    def admit(self, chain: Sequence[BlockHash]) -> list[BlockHash]:
        """Touch/insert the request's blocks; returns the evicted hashes (its KV events)."""
        for h in chain:
            self.cache[h] = None
            self.cache.move_to_end(h)
        evicted = []
        while len(self.cache) > self.cache_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        return evicted


def replay_routing(requests: Sequence[TraceRequest], *, policy: RouterPolicy | None, num_replicas: int,
                   cache_blocks: int, utilization: float = 0.8, decode_token_cost: float = 8.0,
                   load_memory_s: float = LOAD_MEMORY_S, activity_memory_s: float = ACTIVITY_MEMORY_S,
                   label: str = "", own_ledger: bool = True, book_running: bool = True,
                   publish_interval_s: float = 0.1, decode_step_s: float = 0.02,
                   timer: Callable[[], float] | None = None) -> ReplayResult:
    """Route every request in arrival order; ``policy=None`` is round robin (the baseline).

    ``cache_blocks`` is each replica's cache size in trace blocks; ``policy`` may be any prefill
    cost (``RouterPolicy``, ``ttft_cost.TTFTPolicy``: it gets the replicas' rate in tokens/s).
    Raises ``SpecError`` for a non-positive replica count or cache size.
    """
    if num_replicas < 1 or cache_blocks < 1:
        raise SpecError("num_replicas/cache_blocks", (num_replicas, cache_blocks), "must be positive",
                        "pass at least one replica and one cache block")
    root = root_block_hash(model_id="trace")
    chains = [chain_block_hashes(r.block_ids, root) for r in requests]
    work_no_hits = sum(r.input_tokens + decode_token_cost * r.output_tokens for r in requests)
    span_s = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
    rate = work_no_hits / (span_s * num_replicas * utilization)  # token units per second per replica
    replicas = [_ReplicaModel(ReplicaId(f"r{i}"), cache_blocks) for i in range(num_replicas)]
    by_name = {r.name: r for r in replicas}
    index = PrefixIndex()
    hits = total = 0
    times: list[float] = []
    ledger, activity = RecentWorkLedger(load_memory_s), RecentWorkLedger(activity_memory_s)
    own_activity = PrefixWorkLedger(activity_memory_s)
    prompt_blocks, request_work = DecayedMean(load_memory_s), DecayedMean(load_memory_s)
    rates = {r.name: rate for r in replicas}
    # The TTFT cost's other inputs, as ``RouterCore`` keeps them (drained queues, booked prefill
    # load, later requests per prompt); off without ``book_running`` (state current at every
    # decision: nothing to drain, the replay before issue 30).
    outlook = PrefillOutlook(activity_memory_s)
    published: dict[ReplicaId, ReplicaSnapshot] = {}
    next_publication = requests[0].arrival_s if requests else 0.0
    for n, (req, chain) in enumerate(zip(requests, chains)):
        now = req.arrival_s
        if policy is not None and book_running and now >= next_publication:
            tick = now - (now - next_publication) % publish_interval_s if publish_interval_s > 0 else now
            for r in replicas:
                published[r.name] = r.publish(tick, cache_blocks)
                outlook.report(r.name, published[r.name].num_queued_blocks * TRACE_BLOCK_TOKENS, tick)
                index.apply_events(r.name, r.events)
                r.events = []
            next_publication = tick + publish_interval_s
        if policy is None:
            chosen = replicas[n % num_replicas]
        else:
            snaps = ([published[r.name] for r in replicas] if book_running else
                     [ReplicaSnapshot(r.name, cache_blocks, cache_blocks, 0, num_queued_blocks=int(
                         max(0.0, r.busy_until - now) * rate / TRACE_BLOCK_TOKENS)) for r in replicas])
            start = timer() if timer else 0.0
            matched = index.match_prefix(chain)
            decision = policy.choose_prefill(
                snaps, chain, index, max_ranked=1, matched=matched, recent_work={r.name: ledger.value(r.name, now) for r in replicas},
                activity={r.name: activity.value(r.name, now) for r in replicas},
                mean_request_blocks=prompt_blocks.value(now), mean_request_work=request_work.value(now),
                own_activity=own_activity.own(chain, matched, now) if own_ledger else None,
                prefill_rate=rates, tokens_per_block=TRACE_BLOCK_TOKENS, num_prompt_tokens=req.input_tokens,
                **(outlook.cost_inputs([(s.replica_id, s.num_queued_blocks * TRACE_BLOCK_TOKENS) for s in snaps],
                                       rates, now) if book_running else {}))
            index.add_blocks(decision.replica_id, chain)  # the router books the prompt at once
            if timer:
                times.append(timer() - start)
            chosen = by_name[decision.replica_id]
        hit = chosen.cached_prefix(chain)
        hits += hit
        total += len(chain)
        uncached_tokens = max(0, req.input_tokens - hit * TRACE_BLOCK_TOKENS)
        work = uncached_tokens + decode_token_cost * req.output_tokens
        chosen.assigned_work += work
        if policy is not None and book_running:
            outlook.book(chosen.name, uncached_tokens=uncached_tokens, block_hashes=chain,
                         cached_blocks=max(matched.values(), default=0), now_s=now, rate=rate,
                         reported_queued_tokens=published[chosen.name].num_queued_blocks * TRACE_BLOCK_TOKENS)
            outlook.flush()
        ledger.add(chosen.name, work / TRACE_BLOCK_TOKENS, now)
        activity.add(chosen.name, work / TRACE_BLOCK_TOKENS, now)
        own_activity.add(chosen.name, chain, work / TRACE_BLOCK_TOKENS, now)
        prompt_blocks.add(len(chain), now)
        request_work.add(work / TRACE_BLOCK_TOKENS, now)
        start = max(chosen.busy_until, now)
        chosen.busy_until = start + work / rate
        evicted = chosen.admit(chain)
        if book_running and policy is not None:
            prompt_blocks_uncached = -(-uncached_tokens // TRACE_BLOCK_TOKENS)
            chosen.inflight.append((start, start + uncached_tokens / rate + req.output_tokens * decode_step_s,
                                    prompt_blocks_uncached, len(chain) + -(-req.output_tokens // TRACE_BLOCK_TOKENS)))
            chosen.events.append(KVCacheEvent(stored=tuple(chain), removed=tuple(evicted)))
            # The router books its decision until the next publication (``RouterCore.route``).
            snap = published[chosen.name]
            published[chosen.name] = replace(snap, num_queued_blocks=snap.num_queued_blocks + prompt_blocks_uncached)
        elif policy is not None:
            index.add_blocks(chosen.name, chain)
            index.remove_blocks(chosen.name, evicted)
    loads = [r.assigned_work for r in replicas]
    mean = sum(loads) / len(loads)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * (len(times) - 1)))] * 1e3 if times else 0.0  # noqa: E731
    return ReplayResult(label or ("round_robin" if policy is None else "prefix_load"), num_replicas, len(requests),
                        cache_blocks, hits / total if total else 0.0, infinite_cache_bound(chains),
                        max(loads) / mean if mean else 1.0, pick(0.5), pick(0.99))


def multi_turn_trace(*, num_conversations: int, turns: int, seed: int = 0, system_blocks: int = 2,
                     turn_blocks: tuple[int, int] = (1, 6), mean_gap_s: float = 0.5,
                     num_system_prompts: int = 8) -> list[TraceRequest]:
    """A synthetic multi-turn chat trace in the Mooncake shape: each turn's prompt is the
    conversation so far (system prompt + earlier turns) plus new blocks, so it extends the
    previous turn's block ids. Conversations start at random times and interleave."""
    import random

    rng = random.Random(seed)
    next_id = 1_000_000
    systems = [tuple(range(i * system_blocks, (i + 1) * system_blocks)) for i in range(num_system_prompts)]
    events: list[tuple[float, int, tuple[int, ...], int]] = []
    horizon = num_conversations * mean_gap_s
    for c in range(num_conversations):
        t = rng.uniform(0.0, horizon)
        context = systems[rng.randrange(num_system_prompts)]
        for _ in range(turns):
            new = rng.randint(*turn_blocks)
            context = context + tuple(range(next_id, next_id + new))
            next_id += new
            out_tokens = rng.randint(16, 400)
            events.append((t, c, context, out_tokens))
            context = context + (next_id,)  # the answer becomes part of the next turn's prompt
            next_id += 1
            t += rng.expovariate(1.0 / (8 * mean_gap_s)) + 1.0
    events.sort(key=lambda e: e[0])
    return [TraceRequest(t, len(ctx) * TRACE_BLOCK_TOKENS, out, ctx) for t, _, ctx, out in events]
