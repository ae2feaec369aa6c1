"""Bounded-cache replay: time to first token and hit rate when every replica's KV is tight.

Design decisions:
- Event-driven, in trace time. Each replica is an LRU block cache of ``cache_blocks`` trace
  blocks and a FIFO of prefills served one at a time; a prefill of ``U`` uncached tokens while
  ``n`` requests decode takes ``(U + n * max(1, U / (budget - n))) / rate`` seconds (continuous
  batching: each step carries ``budget`` tokens, one per running decode; with ``n = 0`` it is the
  issue's "prefill time proportional to uncached tokens"). A request's prefix hit is read when
  its prefill starts (the engine's own lookup; the hit blocks are touched then), its prompt
  blocks enter the cache (tail first, so LRU evicts tails before shared prefixes) when the
  prefill ends, then it decodes ``output_tokens`` at ``decode_step_s`` each. TTFT = prefill end
  minus arrival. Running requests do not pin their blocks (a prediction, as in
  ``benchmarks/_vllm_replay``).
- rayfleet's routers run as they run live: a ``RouterCore`` fed ``ReplicaSnapshot``s and KV
  events (``stored``/``removed`` from each LRU) every ``publish_interval_s`` only, so the router
  sees published state as stale as a poll period and books its own decisions in between (queued
  blocks, the routed prompt's blocks, drained at the learned rate); snapshots carry the replica's prefill backlog, running
  requests, active blocks and cumulative prefill tokens/seconds, from which the router learns
  each replica's rate.
- ``pca`` is Ray Serve 2.60's ``PrefixCacheAffinityRouter`` with Serve LLM's defaults
  (``imbalanced_threshold=inf``, ``match_rate_threshold=0.1``, no tree eviction), reimplemented
  at block granularity: a tree of every prompt routed to each replica (never evicted: it does not
  see the engines' evictions); the deepest node any replica holds decides; under a 10% match
  rate, the replicas whose tree holds the fewest blocks; among the candidates the one with the
  fewest ongoing requests (waiting, prefilling or decoding), ties in replica order. It reads
  queue lengths exact and current (Serve probes them), which favours it.
- Pure (no Ray, clock or I/O) apart from the optional ``timer`` (decision CPU time).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash, root_block_hash
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prefix_index import PrefixIndex
from rayfleet.serving.routing.router import RouterCore
from rayfleet.serving.routing.trace_replay import TRACE_BLOCK_TOKENS, TraceRequest, chain_block_hashes
from rayfleet.serving.routing.ttft_cost import TTFTPolicy

__all__ = ["ROUTERS", "BoundedReplayResult", "replay_bounded", "working_set_blocks"]

ROUTERS = ("rayfleet", "prefix_load", "pca", "round_robin")
"""``rayfleet``: the default TTFT cost; ``prefix_load``: the block-unit cost with fitted weights
(the default before); ``pca``: Ray's ``PrefixCacheAffinityRouter``; ``round_robin``."""


@dataclass(frozen=True)
class BoundedReplayResult:
    router: str
    num_replicas: int
    cache_blocks: int
    num_requests: int
    ttft_mean_s: float
    ttft_p99_s: float
    hit_rate: float  # prompt tokens found cached / prompt tokens
    requests_max_mean: float  # requests per replica, max over mean
    decision_p99_ms: float  # thread CPU per routing decision (0 without a timer)
    # Where hits go (prompt tokens / all prompt tokens): ``forgone_share`` the longer prefixes the
    # router knew of on another replica than the one it chose; ``evicted_queued_share`` the prefix it
    # knew of on its choice but that was evicted before the prefill started. ``moved_share``:
    # requests sent past a longer known prefix. The router's knowledge: its index (rayfleet,
    # prefix_load) or its tree (pca); 0 for round robin.
    moved_share: float = 0.0
    forgone_share: float = 0.0
    evicted_queued_share: float = 0.0


def working_set_blocks(requests: Sequence[TraceRequest]) -> int:
    """Distinct (chained) prompt blocks of the trace: what one infinite cache would hold."""
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        for i in range(1, len(r.block_ids) + 1):
            seen.add(r.block_ids[:i])
    return len(seen)


class _Replica:
    def __init__(self, index: int, name: ReplicaId, cache_blocks: int) -> None:
        self.index, self.name = index, name
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.cache_blocks = cache_blocks
        self.waiting: deque[int] = deque()
        self.prefilling: int | None = None
        self.prefill_start = self.prefill_end = 0.0
        self.prefill_tokens = 0  # the current prefill's uncached tokens
        self.num_decoding = 0
        self.active_blocks = 0
        self.events: list[KVCacheEvent] = []  # since the last publication
        self.prefill_tokens_total = 0
        self.prefill_seconds_total = 0.0
        self.num_requests = 0

    def cached_prefix(self, chain: Sequence[BlockHash]) -> int:
        n = 0
        for h in chain:
            if h not in self.cache:
                break
            n += 1
        return n

    def store(self, chain: Sequence[BlockHash]) -> None:
        stored = [h for h in chain if h not in self.cache]
        self.touch(chain)
        removed = []
        while len(self.cache) > self.cache_blocks:
            removed.append(self.cache.popitem(last=False)[0])
        if stored or removed:
            self.events.append(KVCacheEvent(stored=tuple(stored), removed=tuple(removed)))

    def touch(self, chain: Sequence[BlockHash]) -> None:
        # Tail first: a chain's head becomes the most recently used, so LRU evicts a sequence's
        # tail before its shared prefix (as an engine freeing a request tail-first does).
        cache = self.cache
        for h in reversed(chain):
            cache[h] = None
            cache.move_to_end(h)

    def ongoing(self) -> int:
        return len(self.waiting) + (self.prefilling is not None) + self.num_decoding


class _PrefixAffinity:
    """``PrefixCacheAffinityRouter``'s decision rule (module doc), over chained block hashes."""

    def __init__(self, names: Sequence[ReplicaId], match_rate_threshold: float = 0.1) -> None:
        self.names = list(names)
        self.tree = PrefixIndex()
        self.match_rate_threshold = match_rate_threshold

    def choose(self, chain: Sequence[BlockHash], input_tokens: int, ongoing: dict[ReplicaId, int]) -> ReplicaId:
        matched = self.tree.match_prefix(chain)
        depth = max(matched.values(), default=0)
        rate = min(input_tokens, depth * TRACE_BLOCK_TOKENS) / max(1, input_tokens)
        if rate < self.match_rate_threshold:  # the smallest tenants (fewest blocks in the tree)
            smallest = min(self.tree.num_blocks_on(r) for r in self.names)
            candidates = [r for r in self.names if self.tree.num_blocks_on(r) == smallest]
        else:
            candidates = [r for r in self.names if matched.get(r, 0) == depth]
        best = min(candidates, key=lambda r: ongoing[r])  # min keeps the first of equals
        self.tree.add_blocks(best, chain)  # on_request_routed: the whole prompt, never evicted
        return best


def replay_bounded(requests: Sequence[TraceRequest], *, router: str, num_replicas: int, cache_blocks: int,
                   utilization: float = 0.8, step_token_budget: int = 2048, decode_step_s: float = 0.02,
                   publish_interval_s: float = 0.1, timer: Callable[[], float] | None = None) -> BoundedReplayResult:
    """Replay ``requests`` (arrival order) through ``router`` (one of ``ROUTERS``) on
    ``num_replicas`` replicas of ``cache_blocks`` trace blocks each. The prefill rate (tokens/s,
    the same on every replica) is set so that the trace's prompts, prefilled with no hit at all,
    would keep the pool ``utilization`` busy. Raises ``SpecError`` for an unknown router or
    non-positive sizes."""
    if router not in ROUTERS:
        raise SpecError("router", router, "is not a replayed router", f"use one of {', '.join(ROUTERS)}")
    if num_replicas < 1 or cache_blocks < 1 or not requests:
        raise SpecError("num_replicas/cache_blocks/requests", (num_replicas, cache_blocks, len(requests)),
                        "must be positive", "pass replicas, cache blocks and at least one request")
    root = root_block_hash(model_id="trace")
    chains = [chain_block_hashes(r.block_ids, root) for r in requests]
    span_s = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
    rate = sum(r.input_tokens for r in requests) / (span_s * num_replicas * utilization)
    names = [ReplicaId(f"r{i}") for i in range(num_replicas)]
    replicas = {n: _Replica(i, n, cache_blocks) for i, n in enumerate(names)}
    core = pca = None
    if router in ("rayfleet", "prefix_load"):
        # The TTFT cost starts from its default prior and learns the replicas' rate from their
        # published totals, as it does live; the engine's step budget is its one setting.
        policy = TTFTPolicy(step_token_budget=step_token_budget) if router == "rayfleet" else RouterPolicy()
        core = RouterCore(roles={"colocated": list(names)}, policy=policy, block_size=TRACE_BLOCK_TOKENS,
                          model_id="trace", num_blocks_hint=cache_blocks)
    elif router == "pca":
        pca = _PrefixAffinity(names)
    ttft = [0.0] * len(requests)
    hit_tokens = 0
    known_hit = [0] * len(requests)  # blocks of each prompt the router knew cached on its choice
    num_moved = forgone_blocks = evicted_queued_tokens = 0
    decisions: list[float] = []
    # Events: (time, order, kind, replica index or -1, request index; a decode's blocks for kind 2).
    # Kinds: 0 arrival, 1 prefill done, 2 decode done, 3 publication tick.
    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    for i, r in enumerate(requests):
        heap.append((r.arrival_s, seq, 0, -1, i))
        seq += 1
    heapq.heapify(heap)
    if core is not None:
        heapq.heappush(heap, (requests[0].arrival_s, -1, 3, -1, -1))
    pending = len(requests)

    def start_next(rep: _Replica, now: float) -> None:
        nonlocal seq, hit_tokens, evicted_queued_tokens
        if rep.prefilling is not None or not rep.waiting:
            return
        j = rep.waiting.popleft()
        hit = rep.cached_prefix(chains[j])
        rep.touch(chains[j][:hit])
        uncached = max(0, requests[j].input_tokens - hit * TRACE_BLOCK_TOKENS)
        hit_tokens += requests[j].input_tokens - uncached
        evicted_queued_tokens += max(0, known_hit[j] - hit) * TRACE_BLOCK_TOKENS
        running = min(rep.num_decoding, step_token_budget - 1)
        seconds = (uncached + running * max(1.0, uncached / (step_token_budget - running))) / rate
        rep.prefilling, rep.prefill_start, rep.prefill_end, rep.prefill_tokens = j, now, now + seconds, uncached
        rep.prefill_tokens_total += uncached
        rep.prefill_seconds_total += seconds
        heapq.heappush(heap, (rep.prefill_end, seq, 1, rep.index, j))
        seq += 1

    while heap:
        now, _, kind, ri, j = heapq.heappop(heap)
        if kind == 0:  # arrival: route
            req, chain = requests[j], chains[j]
            known = (core.index.match_prefix(chain) if core is not None
                     else pca.tree.match_prefix(chain) if pca is not None else {})
            start = timer() if timer else 0.0
            if core is not None:
                chosen = ReplicaId(core.route(range(req.input_tokens), max_tokens=req.output_tokens,
                                              block_hashes=chain, now_s=now).first[0])
            elif pca is not None:
                chosen = pca.choose(chain, req.input_tokens, {n: replicas[n].ongoing() for n in names})
            else:
                chosen = names[j % num_replicas]
            if timer:
                decisions.append(timer() - start)
            rep = replicas[chosen]
            known_hit[j] = min(known.get(chosen, 0), rep.cached_prefix(chain))  # what it knew and was there
            best = max(known.values(), default=0)
            if best > known.get(chosen, 0):
                num_moved += 1
                forgone_blocks += best - known.get(chosen, 0)
            rep.num_requests += 1
            rep.waiting.append(j)
            start_next(rep, now)
        elif kind == 1:  # prefill done: first token; its blocks are cached; it decodes
            rep = replicas[names[ri]]
            ttft[j] = now - requests[j].arrival_s
            rep.store(chains[j])
            rep.prefilling = None
            rep.num_decoding += 1
            blocks = len(chains[j]) + -(-requests[j].output_tokens // TRACE_BLOCK_TOKENS)
            rep.active_blocks += blocks
            heapq.heappush(heap, (now + requests[j].output_tokens * decode_step_s, seq, 2, ri, blocks))
            seq += 1
            pending -= 1
            start_next(rep, now)
        elif kind == 2:  # decode done (``j`` carries its blocks)
            rep = replicas[names[ri]]
            rep.num_decoding -= 1
            rep.active_blocks -= j
        elif core is not None:  # publication tick
            for rep in replicas.values():
                backlog = sum(max(0, requests[w].input_tokens - rep.cached_prefix(chains[w]) * TRACE_BLOCK_TOKENS)
                              for w in rep.waiting)
                if rep.prefilling is not None and rep.prefill_end > rep.prefill_start:  # its part still to do
                    backlog += rep.prefill_tokens * (rep.prefill_end - now) / (rep.prefill_end - rep.prefill_start)
                snap = ReplicaSnapshot(rep.name, cache_blocks, cache_blocks, rep.active_blocks,
                                       num_queued_blocks=-(-int(backlog) // TRACE_BLOCK_TOKENS),
                                       num_running_requests=rep.num_decoding + (rep.prefilling is not None),
                                       num_prefill_tokens_total=rep.prefill_tokens_total,
                                       prefill_seconds_total=rep.prefill_seconds_total)
                core.observe(rep.name, snap, rep.events, now_s=now)
                rep.events = []
            if pending:
                heapq.heappush(heap, (now + publish_interval_s, seq, 3, -1, -1))
                seq += 1
    counts = [rep.num_requests for rep in replicas.values()]
    ordered = sorted(ttft)
    decisions.sort()
    prompt_tokens = max(1, sum(r.input_tokens for r in requests))
    return BoundedReplayResult(
        router, num_replicas, cache_blocks, len(requests), sum(ttft) / len(ttft),
        ordered[min(len(ordered) - 1, int(0.99 * (len(ordered) - 1)))],
        hit_tokens / max(1, sum(r.input_tokens for r in requests)),
        max(counts) * num_replicas / max(1, sum(counts)),
        decisions[min(len(decisions) - 1, int(0.99 * (len(decisions) - 1)))] * 1e3 if decisions else 0.0,
        num_moved / len(requests), forgone_blocks * TRACE_BLOCK_TOKENS / prompt_tokens,
        evicted_queued_tokens / prompt_tokens)
