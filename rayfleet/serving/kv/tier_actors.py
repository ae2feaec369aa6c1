"""Ray shells of the KV tiers: one named host-pool actor per node, one global index actor.

Design decisions:
- ``NodeKVTiersActor`` owns a ``NodeKVTiers`` and nothing else; it is named by node
  (``rayfleet-kv-tiers-<node id>``), detached, and pinned to its node with a hard node-affinity
  strategy, so every engine replica on the node finds the same pool with ``get_if_exists`` and
  the pool's memory is that node's host memory. It dies with its node, which is the point: the
  index then drops the node and engines recompute.
- It is a threaded actor (``max_concurrency``): replicas' calls interleave under the
  ``NodeKVTiers`` lock instead of queueing behind a long disk read.
- After every call that changes what the node holds it pushes its tier events to the index actor
  (fire and forget): the index is a hint (``kv_index``), so a lost push costs a miss at most.
- ``RemoteNodeKVTiers`` is the engine's ``NodeKVStore`` over the actor: blocking ``ray.get`` on
  the engine thread (never on the replica's event loop), and any Ray failure of the actor becomes
  ``KVTierUnavailableError`` so that the connector recomputes. ``prefetch`` is fire and forget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.kv.global_index import GlobalKVIndex, KVLocation
if TYPE_CHECKING:
    from rayfleet.serving.kv.tier_connector import KVTierConnector
from rayfleet.serving.kv.tiers import KVBlockData, KVTierStats, KVTierUnavailableError, LoadedBlock, NodeKVTiers, Tier

__all__ = ["NodeKVTiersActor", "KVIndexActor", "RemoteNodeKVTiers", "node_tiers_actor_name", "get_node_kv_tiers",
           "get_kv_index", "connector_for_replica", "KV_INDEX_NAME", "NAMESPACE"]

NAMESPACE = "rayfleet"
KV_INDEX_NAME = "rayfleet-kv-index"


def node_tiers_actor_name(node_id: str) -> str:
    return f"rayfleet-kv-tiers-{node_id}"


def node_disk_uri(uri: str, node_id: str) -> str:
    """Each node gets its own directory (nodes on one machine must not share a catalogue)."""
    return uri.replace("{node}", node_id) if "{node}" in uri else f"{uri.rstrip('/')}/{node_id}"


class KVIndexActor:
    """``GlobalKVIndex`` behind a named actor: node actors and the router feed it, anyone asks."""

    def __init__(self) -> None:
        self.index = GlobalKVIndex()

    def apply_tier_events(self, events: list) -> None:
        self.index.apply_tier_events(events)

    def apply_engine_events(self, node_id: str, replica_id: str, events: list) -> None:
        self.index.apply_engine_events(node_id, replica_id, events)

    def remove_node(self, node_id: str) -> int:
        return self.index.remove_node(node_id)

    def remove_replica(self, replica_id: str) -> int:
        return self.index.remove_replica(replica_id)

    def remove_location(self, node_id: str, tier: str, replica_id: str = "") -> int:
        return self.index.remove_location(KVLocation(node_id, Tier(tier), replica_id))

    def match_prefix(self, block_hashes: list[BlockHash]) -> dict[KVLocation, int]:
        return self.index.match_prefix(block_hashes)

    def locate(self, block_hash: BlockHash) -> list[KVLocation]:
        return self.index.locate(block_hash)

    def num_entries(self) -> int:
        self.index.check_consistency()
        return self.index.num_entries


class NodeKVTiersActor:
    """One node's host pool (+ disk tier); see module doc."""

    def __init__(self, node_id: str, *, host_blocks: int, disk_uri: str | None, disk_blocks: int,
                 index: Any | None = None) -> None:
        self.tiers = NodeKVTiers(node_id, host_blocks=host_blocks,
                                 disk_uri=node_disk_uri(disk_uri, node_id) if disk_uri else None,
                                 disk_blocks=disk_blocks)
        self.index = index
        self._publish()

    def _publish(self) -> None:
        events = self.tiers.take_events()
        if events and self.index is not None:
            self.index.apply_tier_events.remote(events)

    def lookup(self, block_hashes: list[BlockHash]) -> list[Tier | None]:
        return self.tiers.lookup(block_hashes)

    def get_many(self, block_hashes: list[BlockHash]) -> list[LoadedBlock | None]:
        try:
            return self.tiers.get_many(block_hashes)
        finally:
            self._publish()

    def put_many(self, blocks: list[tuple[BlockHash, KVBlockData]]) -> None:
        self.tiers.put_many(blocks)
        self._publish()

    def prefetch(self, block_hashes: list[BlockHash]) -> bool:
        future = self.tiers.prefetch(block_hashes)
        if future is not None:
            future.add_done_callback(lambda _: self._publish())
        return future is not None

    def stats(self) -> KVTierStats:
        return self.tiers.stats()

    def node_id(self) -> str:
        return self.tiers.node_id


def get_kv_index() -> Any:
    """The fleet's index actor (created on first use, detached, on the caller's cluster)."""
    return ray.remote(KVIndexActor).options(name=KV_INDEX_NAME, namespace=NAMESPACE, get_if_exists=True,
                                            lifetime="detached", num_cpus=0).remote()


def get_node_kv_tiers(node_id: str, *, host_blocks: int, disk_uri: str | None, disk_blocks: int,
                      index: Any | None = None) -> Any:
    """The tiers actor of ``node_id``, created there on first use (later callers share it; the
    sizes of the first caller win: every replica of one spec passes the same ones)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(NodeKVTiersActor).options(
        name=node_tiers_actor_name(node_id), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, host_blocks=host_blocks, disk_uri=disk_uri, disk_blocks=disk_blocks, index=index)


class RemoteNodeKVTiers:
    """``NodeKVStore`` over a ``NodeKVTiersActor`` handle (see module doc)."""

    def __init__(self, handle: Any, node_id: str, *, timeout_s: float = 10.0) -> None:
        self.handle = handle
        self.node_id = node_id
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=self.timeout_s)
        except KVTierUnavailableError:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError) as exc:
            raise KVTierUnavailableError(f"KV tiers of node {self.node_id} unreachable "
                                         f"({type(exc).__name__}); recompute") from None

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier | None]:
        return self._call("lookup", list(block_hashes))

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock | None]:
        return self._call("get_many", list(block_hashes))

    def put_many(self, blocks: Sequence[tuple[BlockHash, KVBlockData]]) -> None:
        self._call("put_many", list(blocks))

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        try:
            self.handle.prefetch.remote(list(block_hashes))
        except ray.exceptions.RayActorError:
            raise KVTierUnavailableError(f"KV tiers of node {self.node_id} are gone") from None
        return None


def connector_for_replica(*, host_blocks: int, disk: dict | None, prefetch_window: int) -> "KVTierConnector":
    """The ``KVTierConnector`` an engine replica (a Ray actor) builds from ``ServeSpec.kv_cache``
    (``model_dump()``): its node's tiers actor, publishing to the fleet's index actor."""
    from rayfleet.serving.kv.tier_connector import KVTierConnector
    from rayfleet.serving.kv.tier_policy import KVTierPolicy

    node_id = ray.get_runtime_context().get_node_id()
    handle = get_node_kv_tiers(node_id, host_blocks=host_blocks, disk_uri=disk["uri"] if disk else None,
                               disk_blocks=disk["blocks"] if disk else 0, index=get_kv_index())
    ray.get(handle.node_id.remote(), timeout=120)  # first use starts a worker: wait here, not mid-step
    return KVTierConnector(RemoteNodeKVTiers(handle, node_id), policy=KVTierPolicy(prefetch_window=prefetch_window))
