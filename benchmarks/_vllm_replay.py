"""Pure parts of ``serving_vllm.py`` (no Ray, no vLLM): the infinite-cache hit bound, the
pressure regime's KV size rule, and the replays of routing decisions (rayfleet's vLLM pool
router core, and a model of Ray 2.60's ``PrefixCacheAffinityRouter``) that predict a regime
before it is run live. A helper module, not a benchmark (the leading underscore keeps it out of
``common.benchmark_scripts``)."""

from __future__ import annotations

import os

__all__ = ["hit_bound", "pressure_kv_blocks", "replay_decisions", "replay_pressure"]


def hit_bound(before: list[list[int]], prompts: list[list[int]], *, block: int) -> float:
    """The prefix-cache hit rate a perfect router with an infinite cache reaches on ``prompts``
    (token ids, in arrival order) after ``before`` (the warm-up): each request hits the longest
    prefix it shares with any earlier request, in whole blocks and short of its last token (vLLM
    computes at least one token), over all prompt tokens. Both routers' hit rates are read
    against it: on a workload whose every prefix is shared, "beating" a router that is already
    at the bound is not possible, and the share says how close each one is.

    >>> hit_bound([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 9], [7, 7]], block=2)
    0.5714285714285714
    """
    seen = list(before)
    hits = total = 0
    for ids in prompts:
        common = max((len(os.path.commonprefix([ids, s])) for s in seen), default=0)
        hits += min(common, len(ids) - 1) // block * block
        total += len(ids)
        seen.append(ids)
    return hits / total if total else float("nan")


def pressure_kv_blocks(items: list[dict], token_ids: list[list[int]], *, block_size: int,
                       max_model_len: int) -> dict:
    """The pressure regime's KV blocks per replica, by the rule declared in the module doc:
    ``N = max(ceil(W_hot / 2), ceil(max_model_len / block_size) + 1)`` with ``W_hot`` the distinct
    full ``block_size``-token blocks over the hot tenant's prompts (``token_ids[i]`` is
    ``items[i]``'s prompt). Pure.

    >>> items = [{"tenant": 0}, {"tenant": 0}, {"tenant": 1}]
    >>> pressure_kv_blocks(items, [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]], block_size=2, max_model_len=4)
    {'hot_tenant': 0, 'hot_requests': 2, 'hot_working_set_blocks': 3, 'all_working_set_blocks': 4, 'kv_blocks': 3}
    """
    by_tenant: dict[int, set[tuple[int, ...]]] = {}
    requests: dict[int, int] = {}
    for item, ids in zip(items, token_ids):
        tenant = item["tenant"]
        requests[tenant] = requests.get(tenant, 0) + 1
        blocks = by_tenant.setdefault(tenant, set())
        blocks.update(tuple(ids[:k * block_size]) for k in range(1, len(ids) // block_size + 1))
    hot = max(requests, key=lambda t: (requests[t], -t))
    floor = -(-max_model_len // block_size) + 1  # one max-length request + vLLM's null block
    return {"hot_tenant": hot, "hot_requests": requests[hot], "hot_working_set_blocks": len(by_tenant[hot]),
            "all_working_set_blocks": sum(len(b) for b in by_tenant.values()),
            "kv_blocks": max(-(-len(by_tenant[hot]) // 2), floor)}


def replay_decisions(items: list[dict], *, policy, block_chars: int = 128, service_s: float = 1.0,
                     first_chunk_s: float = 0.1) -> dict:
    """Replay ``items`` through rayfleet's vLLM pool router core (``PoolRouterCore``, pure, no Ray)
    on 2 replicas that publish before every arrival: a request is queued for its first
    ``first_chunk_s`` and decoding until ``service_s`` (this machine's order of magnitude), text
    blocks as the live router computes them, no eviction (1 GiB of KV holds every prompt here).
    Returns the text-block hit rate, requests per replica, and ``off_prefix``: requests sent to a
    replica caching fewer blocks of them than another did (``turn`` > 0: a conversation moved)."""
    from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
    from rayfleet.serving.vllm.text_blocks import ServedBlocks, text_block_hashes

    core, names = PoolRouterCore(role="colocated", policy=policy), ("r0", "r1")
    served = {r: ServedBlocks(1 << 20) for r in names}
    inflight: dict[str, list[tuple[float, int]]] = {r: [] for r in names}
    hits = total = 0
    off_prefix, counts = [], dict.fromkeys(names, 0)
    for n, item in enumerate(items):
        now = item["at"]
        for r in names:
            inflight[r] = [(t, b) for t, b in inflight[r] if now - t < service_s]
            queued = sum(b for t, b in inflight[r] if now - t < first_chunk_s)
            active = sum(b for _, b in inflight[r]) - queued
            core.observe(r, {"version": n, "num_total_blocks": 1 << 20, "num_free_blocks": (1 << 20) - queued - active,
                             "num_active_blocks": active, "num_queued_blocks": queued,
                             "num_running_requests": len(inflight[r]), "max_num_seqs": 16,
                             "block_hashes": served[r].hashes()}, now)
        hashes = text_block_hashes(item["prompt"], block_chars=block_chars)
        chosen = core.rank(list(names), RouteHint(block_hashes=hashes, num_prompt_blocks=len(hashes) + 1),
                           now_s=now)[0][0]
        core.flush_bookings()
        cached = {r: next((i for i, h in enumerate(hashes) if h not in served[r].hashes()), len(hashes))
                  for r in names}
        if cached[chosen] < max(cached.values()):
            off_prefix.append({"request": n, "turn": item.get("turn", 0), "cached": cached, "chosen": chosen})
        hits, total = hits + cached[chosen], total + len(hashes) + 1
        counts[chosen] += 1
        served[chosen].add(hashes)
        inflight[chosen].append((now, len(hashes) + 1))
    return {"hit_rate": hits / total, "requests_per_replica": counts, "off_prefix": off_prefix}


class _TokenBlockLRU:
    """One replica's vLLM prefix cache, modelled: chained full blocks of token ids, least recently
    used out past ``capacity`` (the engine's blocks less its null block). It ignores that running
    requests pin their blocks (the real cache evicts only free ones), so it is a prediction."""

    def __init__(self, capacity: int, block: int) -> None:
        from collections import OrderedDict

        self.capacity, self.block, self.evicted = capacity, block, 0
        self.blocks: OrderedDict[tuple, None] = OrderedDict()

    def keys(self, ids: list[int]) -> list[tuple]:
        return [tuple(ids[:k * self.block]) for k in range(1, len(ids) // self.block + 1)]

    def hit_tokens(self, ids: list[int]) -> int:
        """Tokens vLLM would find cached: whole blocks, short of the last token."""
        keys = self.keys(ids[:len(ids) - 1])
        return next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys)) * self.block

    def use(self, keys: list[tuple]) -> None:
        for k in keys:
            self.blocks[k] = None
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            self.evicted += 1


def _pca_choice(text: str, trees: dict[str, list[str]], inflight: dict[str, int]) -> str:
    """Ray 2.60's ``PrefixCacheAffinityRouter`` as configured by Serve LLM (imbalanced_threshold
    inf: never balances; match_rate_threshold 0.1; no tree eviction), modelled on whole prompt
    strings: the replicas holding the longest character prefix, or under a 10% match those whose
    tree holds the fewest characters; then the shorter queue (ties by name)."""
    lcp = {r: max((len(os.path.commonprefix([text, t])) for t in ts), default=0) for r, ts in trees.items()}
    best = max(lcp.values())
    if best / max(1, len(text)) < 0.1:
        size = {r: _tree_chars(ts) for r, ts in trees.items()}
        candidates = [r for r in trees if size[r] == min(size.values())]
    else:
        candidates = [r for r in trees if lcp[r] == best]
    return min(candidates, key=lambda r: (inflight[r], r))


def _tree_chars(texts: list[str]) -> int:
    """Characters of a prefix tree holding ``texts`` (each one's part beyond its longest shared prefix)."""
    return sum(len(t) - max((len(os.path.commonprefix([t, u])) for u in texts[:i]), default=0)
               for i, t in enumerate(texts))


def replay_pressure(items: list[dict], token_ids: list[list[int]], *, router: str, kv_blocks: int,
                    policy=None, block: int = 32, service_s: float = 1.0, first_chunk_s: float = 0.1) -> dict:
    """Replay ``items`` through ``router`` (``rayfleet``: ``PoolRouterCore`` fed as
    ``replay_decisions`` feeds it, its served blocks capped at ``kv_blocks`` as the live server caps
    them; ``pca``: ``_pca_choice``) on 2 replicas whose prefix caches are ``_TokenBlockLRU`` of
    ``kv_blocks - 1`` blocks (a request's prompt and output blocks enter at its arrival). Returns
    the token hit rate as vLLM counts it, requests (and the hot tenant's) per replica, and evictions."""
    from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
    from rayfleet.serving.vllm.text_blocks import ServedBlocks, text_block_hashes

    names = ("r0", "r1")
    caches = {r: _TokenBlockLRU(kv_blocks - 1, block) for r in names}
    core = PoolRouterCore(role="colocated", policy=policy) if router == "rayfleet" else None
    served = {r: ServedBlocks(kv_blocks) for r in names}
    trees: dict[str, list[str]] = {r: [] for r in names}
    inflight: dict[str, list[tuple[float, int]]] = {r: [] for r in names}
    hot = max({i["tenant"] for i in items}, key=lambda t: (sum(i["tenant"] == t for i in items), -t))
    hits = total = 0
    counts, hot_counts = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for n, (item, ids) in enumerate(zip(items, token_ids)):
        now = item["at"]
        for r in names:
            inflight[r] = [(t, b) for t, b in inflight[r] if now - t < service_s]
        hashes = text_block_hashes(item["prompt"], block_chars=block * 4)
        if core is None:
            chosen = _pca_choice(item["prompt"], trees, {r: len(v) for r, v in inflight.items()})
            trees[chosen].append(item["prompt"])
        else:
            for r in names:
                queued = min(kv_blocks, sum(b for t, b in inflight[r] if now - t < first_chunk_s))
                active = min(kv_blocks - queued, sum(b for _, b in inflight[r]) - queued)
                core.observe(r, {"version": n, "num_total_blocks": kv_blocks,
                                 "num_free_blocks": kv_blocks - queued - active, "num_active_blocks": active,
                                 "num_queued_blocks": queued, "num_running_requests": len(inflight[r]),
                                 "max_num_seqs": 16, "block_hashes": served[r].hashes()}, now)
            chosen = core.rank(list(names), RouteHint(block_hashes=hashes, num_prompt_blocks=len(hashes) + 1),
                               now_s=now)[0][0]
            core.flush_bookings()
            served[chosen].add(hashes)
        hits, total = hits + caches[chosen].hit_tokens(ids), total + len(ids)
        # its output is never reused (the next turn's answer text is synthesized), but it fills the cache
        caches[chosen].use(caches[chosen].keys(ids + [-1 - n] * item["max_tokens"]))
        counts[chosen] += 1
        hot_counts[chosen] += item["tenant"] == hot
        inflight[chosen].append((now, len(hashes) + 1))
    return {"hit_rate": hits / total, "requests_per_replica": counts, "hot_tenant_per_replica": hot_counts,
            "evicted_blocks": {r: c.evicted for r, c in caches.items()}}
