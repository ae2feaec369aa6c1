"""The global KV index: which block hash lives where (node, replica, tier), fleet-wide.

Design decisions:
- ``hash -> set of KVLocation`` plus ``location -> hashes`` (for dropping a location in
  O(its blocks)). A location is ``(node_id, tier, replica_id)``; node-level tiers (host, disk)
  have ``replica_id == ""`` because every replica on the node shares them.
- Fed by events, never by probing: engines' ``KVCacheEvent``s (``apply_engine_events``) and
  node tiers' ``TierEvent``s (``apply_tier_events``). It is therefore a hint that can be stale;
  a stale entry costs one failed load (the loader then drops it with ``discard`` and the request
  recomputes), never a wrong answer, because every load is keyed by the chained hash and the
  disk tier checks a checksum.
- Loss is explicit: ``remove_node`` (a node died: its engines and pools with it),
  ``remove_replica`` (an engine replica died or drained), ``remove_location`` (one node's host
  pool was lost but the node lives). ``check_consistency`` verifies the two maps agree; tests
  call it after every kind of loss.
- Plain class, no Ray, clock or I/O: the router, a simulator, the benchmark and the
  ``KVIndexActor`` shell own one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.kv_events import KVEvent, is_cleared
from rayfleet.serving.kv.tiers import Tier, TierEvent

__all__ = ["KVLocation", "GlobalKVIndex"]

_TIER_ORDER = {Tier.ENGINE: 0, Tier.HOST: 1, Tier.DISK: 2}


class KVLocation(NamedTuple):
    node_id: str
    tier: Tier
    replica_id: str = ""  # set for Tier.ENGINE only


class GlobalKVIndex:
    """Mutable, event-fed map of block hashes to the places holding them."""

    def __init__(self) -> None:
        self._hash_to_locations: dict[BlockHash, set[KVLocation]] = {}
        self._location_to_hashes: dict[KVLocation, set[BlockHash]] = {}

    # -- updates --------------------------------------------------------------------------------

    def add(self, location: KVLocation, block_hashes: Iterable[BlockHash]) -> None:
        held = self._location_to_hashes.setdefault(location, set())
        for h in block_hashes:
            held.add(h)
            self._hash_to_locations.setdefault(h, set()).add(location)

    def discard(self, location: KVLocation, block_hashes: Iterable[BlockHash]) -> None:
        """Forget these hashes at ``location`` (unknown ones are ignored)."""
        held = self._location_to_hashes.get(location)
        if held is None:
            return
        for h in block_hashes:
            if h not in held:
                continue
            held.discard(h)
            places = self._hash_to_locations[h]
            places.discard(location)
            if not places:
                del self._hash_to_locations[h]
        if not held:
            del self._location_to_hashes[location]

    def apply_tier_events(self, events: Iterable[TierEvent]) -> None:
        """Replay a node's tier events in order."""
        for event in events:
            location = KVLocation(event.node_id, event.tier)
            if event.stored:
                self.add(location, event.stored)
            if event.removed:
                self.discard(location, event.removed)

    def apply_engine_events(self, node_id: str, replica_id: str, events: Iterable[KVEvent | KVCacheEvent]) -> None:
        """Replay an engine replica's block-pool events in order (``engine.kv_events``'
        ``AllBlocksCleared`` drops everything at that replica's engine location)."""
        location = KVLocation(node_id, Tier.ENGINE, replica_id)
        for event in events:
            if is_cleared(event):
                self.remove_location(location)
                continue
            if event.stored:
                self.add(location, event.stored)
            if event.removed:
                self.discard(location, event.removed)

    def remove_location(self, location: KVLocation) -> int:
        """Drop everything at one location; returns how many entries went."""
        held = self._location_to_hashes.get(location)
        if not held:
            self._location_to_hashes.pop(location, None)
            return 0
        n = len(held)
        self.discard(location, list(held))
        return n

    def remove_replica(self, replica_id: str) -> int:
        return sum(self.remove_location(loc) for loc in self.locations() if loc.replica_id == replica_id)

    def remove_node(self, node_id: str) -> int:
        return sum(self.remove_location(loc) for loc in self.locations() if loc.node_id == node_id)

    # -- queries (pure) -------------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return sum(len(h) for h in self._location_to_hashes.values())

    def locations(self) -> list[KVLocation]:
        return list(self._location_to_hashes)

    def num_blocks_at(self, location: KVLocation) -> int:
        return len(self._location_to_hashes.get(location, ()))

    def locate(self, block_hash: BlockHash) -> list[KVLocation]:
        """Places holding ``block_hash``, fastest tier first (engine, host, disk)."""
        places = self._hash_to_locations.get(block_hash, ())
        return sorted(places, key=lambda loc: (_TIER_ORDER[loc.tier], loc.node_id, loc.replica_id))

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[KVLocation, int]:
        """Length in blocks of the longest leading run of ``block_hashes`` held at each location
        (locations without a match are absent). A router scores replicas with the engine-tier
        entries and a node's host/disk entries; an engine plans loads with them."""
        matched: dict[KVLocation, int] = {}
        alive: set[KVLocation] | None = None
        for i, h in enumerate(block_hashes):
            places = self._hash_to_locations.get(h, set())
            current = set(places) if alive is None else alive & places
            for gone in (alive or set()) - current:
                matched[gone] = i
            alive = current
            if not alive:
                return matched
        for loc in alive or ():
            matched[loc] = len(block_hashes)
        return matched

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` if the two maps disagree (an internal invariant)."""
        forward = {(h, loc) for h, locs in self._hash_to_locations.items() for loc in locs}
        backward = {(h, loc) for loc, hs in self._location_to_hashes.items() for h in hs}
        assert forward == backward, f"index maps disagree on {len(forward ^ backward)} entries"
        assert all(self._hash_to_locations.values()) and all(self._location_to_hashes.values()), \
            "empty sets left in the index"
