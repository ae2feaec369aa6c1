"""Which replicas hold which KV block hashes: the router's prefix index.

Design decisions:
- ``hash -> bitmask of replicas`` (Python ints as bitsets), plus ``replica -> hashes`` for
  removal. A lookup walks the request's hashes once and ANDs masks, so it costs
  O(matched prefix length), independent of the number of indexed blocks and nearly
  independent of the number of replicas (64 replicas fit in one machine word).
- Matches are *contiguous* prefixes per replica: a replica that misses block i does not count
  block i+1 even if it holds it (an engine may evict a parent before its child, and a hit
  after a hole is useless: the engine's own lookup stops at the first miss too).
- Fed by the engines' KV events (``BlockPool.take_events``: vLLM's ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared``, ``engine.kv_events``), so it holds each replica's
  exact cache as of its last report, evictions included, and is eventually consistent:
  a stale entry costs one suboptimal routing choice, never a wrong answer (the engine does its
  own lookup). Plain class, no Ray, clock or I/O: the router actor owns one and so can a test
  or a simulator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.kv_events import KVEvent, is_cleared
from rayfleet.serving.engine.replica_state import ReplicaId

__all__ = ["PrefixIndex"]

EXACT_WALK_BLOCKS = 64  # blocks walked one by one before bisection (``match_prefix``)


class PrefixIndex:
    """Mutable index of cached block hashes per replica."""

    def __init__(self) -> None:
        self._hash_to_mask: dict[BlockHash, int] = {}
        self._replica_to_bit: dict[ReplicaId, int] = {}
        self._bit_to_replica: dict[int, ReplicaId] = {}
        self._replica_to_hashes: dict[ReplicaId, set[BlockHash]] = {}
        self._free_bits: list[int] = []

    @property
    def num_indexed_blocks(self) -> int:
        return len(self._hash_to_mask)

    def replicas(self) -> list[ReplicaId]:
        return list(self._replica_to_bit)

    def num_blocks_on(self, replica_id: ReplicaId) -> int:
        """How many block hashes the replica is known to cache (0 if unknown). O(1)."""
        held = self._replica_to_hashes.get(replica_id)
        return len(held) if held is not None else 0

    def _bit(self, replica_id: ReplicaId) -> int:
        bit = self._replica_to_bit.get(replica_id)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._replica_to_bit)
            self._replica_to_bit[replica_id] = bit
            self._bit_to_replica[bit] = replica_id
            self._replica_to_hashes[replica_id] = set()
        return bit

    def add_blocks(self, replica_id: ReplicaId, block_hashes: Iterable[BlockHash]) -> None:
        """Record that the replica holds these hashes. Mutates the index."""
        flag = 1 << self._bit(replica_id)
        held = self._replica_to_hashes[replica_id]
        for h in block_hashes:
            self._hash_to_mask[h] = self._hash_to_mask.get(h, 0) | flag
            held.add(h)

    def remove_blocks(self, replica_id: ReplicaId, block_hashes: Iterable[BlockHash]) -> None:
        """Record that the replica evicted these hashes (unknown ones are ignored)."""
        bit = self._replica_to_bit.get(replica_id)
        if bit is None:
            return
        keep = ~(1 << bit)
        held = self._replica_to_hashes[replica_id]
        for h in block_hashes:
            if h in held:
                held.discard(h)
                mask = self._hash_to_mask[h] & keep
                if mask:
                    self._hash_to_mask[h] = mask
                else:
                    del self._hash_to_mask[h]

    def apply_events(self, replica_id: ReplicaId, events: Iterable[KVEvent | KVCacheEvent]) -> None:
        """Replay a replica's KV events in order (``AllBlocksCleared`` drops all it held)."""
        for event in events:
            if is_cleared(event):
                held = self._replica_to_hashes.get(replica_id)
                if held:
                    self.remove_blocks(replica_id, list(held))
                continue
            if event.stored:
                self.add_blocks(replica_id, event.stored)
            if event.removed:
                self.remove_blocks(replica_id, event.removed)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Forget a replica (it died or was drained); its bit is reused later."""
        held = self._replica_to_hashes.get(replica_id)
        if held is None:
            return
        self.remove_blocks(replica_id, list(held))
        bit = self._replica_to_bit.pop(replica_id)
        del self._bit_to_replica[bit]
        del self._replica_to_hashes[replica_id]
        self._free_bits.append(bit)

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Length in blocks of the longest cached prefix of ``block_hashes`` per replica
        (replicas with no match are absent). Pure.

        Bounded walk: the first ``EXACT_WALK_BLOCKS`` blocks are walked one by one (a hole there,
        an evicted parent, ends a replica's match exactly); past them the end of each replica's
        match is found by bisection, O(log n) lookups per distinct match length, assuming a
        replica that holds block j holds the blocks before it (engines evict a chain's leaves
        first, LRU). A 100k-token prompt (6k blocks of 16) then costs ~100 lookups, not 6k; a
        hole past the exact part can only overstate one replica's match, which costs one
        suboptimal choice, never a wrong answer (the engine does its own lookup)."""
        matched: dict[ReplicaId, int] = {}
        num = len(block_hashes)
        if not num:
            return matched
        index = self._hash_to_mask
        alive = -1  # every bit set: all replicas still match
        for i in range(min(num, EXACT_WALK_BLOCKS)):
            mask = index.get(block_hashes[i], 0)
            dropped = alive & ~mask
            if dropped and i:
                self._record(matched, dropped, i)
            alive &= mask
            if not alive:
                return matched
        if num <= EXACT_WALK_BLOCKS:
            self._record(matched, alive, num)
            return matched
        # Bisection over [lo, hi]: every bit in ``alive`` holds block lo and none holds hi + 1.
        stack = [(EXACT_WALK_BLOCKS - 1, num - 1, alive)]
        while stack:
            lo, hi, bits = stack.pop()
            if lo == hi:
                self._record(matched, bits, lo + 1)
                continue
            held = bits & index.get(block_hashes[hi], 0)
            if held:
                self._record(matched, held, hi + 1)
            rest = bits & ~held
            if not rest:
                continue
            if hi == lo + 1:
                self._record(matched, rest, lo + 1)
                continue
            mid = (lo + hi) // 2
            up = rest & index.get(block_hashes[mid], 0)
            if up:
                stack.append((mid, hi - 1, up))
            if rest & ~up:
                stack.append((lo, mid - 1, rest & ~up))
        return matched

    def _record(self, matched: dict[ReplicaId, int], mask: int, length: int) -> None:
        while mask:
            low = mask & -mask
            replica = self._bit_to_replica.get(low.bit_length() - 1)
            if replica is not None:
                matched[replica] = length
            mask ^= low
