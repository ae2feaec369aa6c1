"""``KVTierConnector``: joins one engine's block pool to its node's KV tiers and the global index.

Design decisions:
- Two hooks, both on the engine thread, so the engine stays single-threaded:
  * write-back: the block pool calls ``_on_evict`` synchronously inside ``get_new_blocks``,
    *before* the caller writes into the evicted blocks, so copying ``k[:, id]`` there is safe;
    the copies go to the node's host pool (which writes its own evictions back to disk).
  * load and prefetch: ``before_schedule`` (called by the engine before ``schedule()``) asks the
    pure ``KVTierPolicy`` what to do for the queued requests, copies the chosen blocks from
    host/disk (or another node's tiers, found through the global index) into free pool blocks
    and registers them under their hashes. The scheduler's normal prefix lookup then hits them:
    neither the scheduler nor the KV manager knows tiers exist.
- Loaded blocks are released right away (referenced only while being written), tail first, so
  they sit at the most-recently-used end of the free list with the chain's head evicted last.
  While a run is loaded the run's blocks already in the pool are referenced, so the allocation
  for the loads cannot evict them.
- Failure is a miss: a node store that raises ``KVTierUnavailableError`` (its pool or node was
  lost), a block that vanished since the index said it was there, or a corrupt disk block ends
  the run at that block; the request recomputes the rest. The connector drops what it learned
  from the index (``discard``/``remove_location``), so the index heals itself.
- ``node``/``peers`` are ``NodeKVStore``s: ``NodeKVTiers`` in one process, or a client of the
  node's actor (``tier_actors.RemoteNodeKVTiers``) on a fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from rayfleet.models import PagedKVCache
from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.block_pool import BlockId, BlockPool, KVBlock
from rayfleet.serving.kv.global_index import GlobalKVIndex, KVLocation
from rayfleet.serving.kv.tier_policy import KVTierPolicy
from rayfleet.serving.kv.tiers import KVBlockData, KVTierUnavailableError, LoadedBlock, Tier
from rayfleet.serving.engine.request import Request

__all__ = ["NodeKVStore", "KVTierConnector", "ConnectorStats"]


class NodeKVStore(Protocol):
    """A node's host/disk tiers as an engine uses them (``NodeKVTiers`` or an actor client).
    Every method may raise ``KVTierUnavailableError``."""

    node_id: str

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier | None]: ...

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock | None]: ...

    def put_many(self, blocks: Sequence[tuple[BlockHash, KVBlockData]]) -> None: ...

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> Future | None: ...


@dataclass(frozen=True)
class ConnectorStats:
    loaded_from_host: int
    loaded_from_disk: int
    loaded_from_peers: int
    written_back: int
    load_failures: int
    prefetched_requested: int


class KVTierConnector:  # implements engine.kv_connector.KVTierHooks
    """One per engine. ``attach`` it to the engine's pool and KV tensors (``LLMEngine`` does)."""

    def __init__(self, node: NodeKVStore | None, *, index: GlobalKVIndex | None = None,
                 peers: Callable[[str], NodeKVStore | None] | None = None,
                 policy: KVTierPolicy = KVTierPolicy()) -> None:
        self.node = node
        self.node_id = node.node_id if node is not None else ""
        self.index = index
        self.peers = peers
        self.policy = policy
        self.pool: BlockPool | None = None
        self.kv_cache: PagedKVCache | None = None
        self.block_size = 0
        self._pending_prefetch: dict[BlockHash, Future] = {}
        self.loaded_from_host = self.loaded_from_disk = self.loaded_from_peers = 0
        self.written_back = self.load_failures = self.prefetched_requested = 0

    def attach(self, *, block_pool: BlockPool, kv_cache: PagedKVCache, block_size: int) -> None:
        """Hook into an engine (once). Mutates ``block_pool.eviction_listener``."""
        assert self.pool is None, "a connector serves one engine"
        self.pool, self.kv_cache, self.block_size = block_pool, kv_cache, block_size
        block_pool.eviction_listener = self._on_evict

    def stats(self) -> ConnectorStats:
        return ConnectorStats(self.loaded_from_host, self.loaded_from_disk, self.loaded_from_peers,
                              self.written_back, self.load_failures, self.prefetched_requested)

    # -- write-back -----------------------------------------------------------------------------

    def _on_evict(self, evicted: Sequence[tuple[BlockId, BlockHash]]) -> None:
        if self.node is None or not evicted:
            return
        ids = torch.tensor([b for b, _ in evicted], dtype=torch.long)
        k = self.kv_cache.k[:, ids].to("cpu", copy=True)
        v = self.kv_cache.v[:, ids].to("cpu", copy=True)
        blocks = [(h, KVBlockData(k[:, i], v[:, i])) for i, (_, h) in enumerate(evicted)]
        try:
            self.node.put_many(blocks)
        except KVTierUnavailableError:
            self._lose_node(self.node.node_id)
            return
        self.written_back += len(blocks)

    # -- load and prefetch ----------------------------------------------------------------------

    def before_schedule(self, waiting: Sequence[Request], *, admit_window: int, num_reserved_blocks: int) -> None:
        """Load the admittable requests' blocks from lower tiers into the pool and prefetch
        further ones (see module doc). Mutates the pool and the KV tensors."""
        if not waiting or admit_window <= 0 and self.policy.prefetch_window == 0:
            return
        requests = list(waiting)[:admit_window + self.policy.prefetch_window]
        runs = [r.block_hashes[:(r.num_tokens - 1) // self.block_size] for r in requests]
        tiers, sources = self._locate(runs)
        if all(t is Tier.ENGINE for ts in tiers for t in ts):
            return
        decision = self.policy.decide(tiers, num_free_blocks=self.pool.num_free_blocks,
                                      num_reserved_blocks=num_reserved_blocks, admit_window=admit_window)
        for load in decision.loads:
            self._load_run(runs[load.request_index][:load.num_blocks], sources)
        if decision.prefetch and self.node is not None:
            self._prefetch([runs[i][j] for i, j in decision.prefetch])

    def _locate(self, runs: list[list[BlockHash]]) -> tuple[list[list[Tier | None]], dict[BlockHash, str]]:
        """Fastest tier per block (engine pool, this node, another node via the index) and, for
        blocks outside the pool, the node to read them from."""
        tiers = [[Tier.ENGINE if self.pool.get_cached_block(h) is not None else None for h in run] for run in runs]
        missing = list(dict.fromkeys(h for run, ts in zip(runs, tiers) for h, t in zip(run, ts) if t is None))
        found: dict[BlockHash, Tier] = {}
        sources: dict[BlockHash, str] = {}
        if missing and self.node is not None:
            try:
                for h, t in zip(missing, self.node.lookup(missing)):
                    if t is not None:
                        found[h], sources[h] = t, self.node_id
            except KVTierUnavailableError:
                self._lose_node(self.node_id)
        if self.index is not None and self.peers is not None:
            for h in missing:
                if h in found:
                    continue
                for loc in self.index.locate(h):
                    if loc.tier is not Tier.ENGINE and loc.node_id != self.node_id:
                        found[h], sources[h] = loc.tier, loc.node_id
                        break
        for run, ts in zip(runs, tiers):
            for j, h in enumerate(run):
                if ts[j] is None:
                    ts[j] = found.get(h)
        return tiers, sources

    def _load_run(self, run: list[BlockHash], sources: dict[BlockHash, str]) -> None:
        pool = self.pool
        chain: list[KVBlock | None] = [pool.get_cached_block(h) for h in run]  # re-read: earlier loads
        pool.touch([b for b in chain if b is not None])  # protect them from this allocation's evictions
        try:
            fetched = iter(self._fetch([h for h, b in zip(run, chain) if b is None], sources))
            budget = pool.num_free_blocks
            loads: list[tuple[int, LoadedBlock]] = []
            for i, b in enumerate(chain):  # the run stays a chain: stop at the first unreadable block
                if b is None:
                    loaded = next(fetched)
                    if loaded is None or len(loads) == budget:
                        break
                    loads.append((i, loaded))
            if loads:
                new = pool.get_new_blocks(len(loads))  # may evict (written back by _on_evict)
                ids = torch.tensor([b.block_id for b in new], dtype=torch.long)
                cache = self.kv_cache
                for dst, src in ((cache.k, [lb.block.k for _, lb in loads]), (cache.v, [lb.block.v for _, lb in loads])):
                    dst[:, ids] = torch.stack(src, dim=1).to(dst.device, dst.dtype)
                pool.cache_full_blocks(new, [run[i] for i, _ in loads])
                for (i, _), block in zip(loads, new):
                    chain[i] = block
        finally:
            pool.free_blocks(reversed([b for b in chain if b is not None]))  # tail first: head evicted last

    def _fetch(self, wanted: list[BlockHash], sources: dict[BlockHash, str]) -> list[LoadedBlock | None]:
        """Read blocks, grouped by source node; ``None`` for any that could not be read."""
        out: dict[BlockHash, LoadedBlock | None] = {}
        by_node: dict[str, list[BlockHash]] = {}
        for h in wanted:
            by_node.setdefault(sources.get(h, ""), []).append(h)
        for node_id, hashes in by_node.items():
            store = self.node if node_id == self.node_id else (self.peers(node_id) if self.peers and node_id else None)
            results: list[LoadedBlock | None] = [None] * len(hashes)
            if store is not None:
                try:
                    results = store.get_many(hashes)
                except KVTierUnavailableError:
                    self._lose_node(node_id)
            for h, lb in zip(hashes, results):
                if lb is not None and not self._fits(lb.block):
                    lb = None
                out[h] = lb
                if lb is None:
                    self.load_failures += 1
                    if self.index is not None:
                        for loc in self.index.locate(h):
                            if loc.node_id == node_id and loc.tier is not Tier.ENGINE:
                                self.index.discard(loc, [h])
                elif node_id != self.node_id:
                    self.loaded_from_peers += 1
                elif lb.tier is Tier.HOST:
                    self.loaded_from_host += 1
                else:
                    self.loaded_from_disk += 1
        return [out[h] for h in wanted]

    def _fits(self, block: KVBlockData) -> bool:
        k = self.kv_cache.k
        return tuple(block.k.shape) == (k.shape[0], *k.shape[2:]) and block.k.shape == block.v.shape

    def _prefetch(self, hashes: list[BlockHash]) -> None:
        self._pending_prefetch = {h: f for h, f in self._pending_prefetch.items() if not f.done()}
        todo = [h for h in dict.fromkeys(hashes) if h not in self._pending_prefetch]
        if not todo:
            return
        try:
            future = self.node.prefetch(todo)
        except KVTierUnavailableError:
            self._lose_node(self.node_id)
            return
        if future is not None:
            self.prefetched_requested += len(todo)
            self._pending_prefetch.update(dict.fromkeys(todo, future))

    def wait_for_prefetch(self) -> None:
        """Block until every prefetch issued so far has finished (tests, benchmarks)."""
        for future in set(self._pending_prefetch.values()):
            future.result()
        self._pending_prefetch.clear()

    def _lose_node(self, node_id: str) -> None:
        """A node's tiers are gone: forget them in the index; this engine recomputes instead."""
        if self.index is not None:
            for tier in (Tier.HOST, Tier.DISK):
                self.index.remove_location(KVLocation(node_id, tier))
