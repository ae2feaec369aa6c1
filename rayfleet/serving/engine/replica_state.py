"""What an engine replica publishes about itself: the router's, the metrics' and the autoscaler's input.

Design decisions:
- These types live with the engine that produces them (``LLMEngine.replica_snapshot``,
  ``AsyncEngine.poll_state``), not with their readers: the router, the ingress's ``/metrics``
  and the Serve shell all read them, and the engine never imports any of its readers.
- Frozen values that pickle: they cross Ray from each replica to the callers' request routers
  (``record_routing_stats``) and the ingress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from rayfleet.serving.engine.block_pool import KVCacheEvent
from rayfleet.serving.engine.kv_cache_manager import KVCacheStats

__all__ = ["ReplicaId", "ReplicaSnapshot", "BlockUsage", "ReplicaState"]

ReplicaId = NewType("ReplicaId", str)


@dataclass(frozen=True)
class ReplicaSnapshot:
    """One engine replica's state as last reported (blocks are KV blocks of its pool)."""

    replica_id: ReplicaId
    num_total_blocks: int
    num_free_blocks: int
    # Sum of running requests' block-table lengths: a block shared by n requests counts n times,
    # because each of them reads it every decode step (decode work, not pool occupancy).
    num_active_blocks: int
    num_queued_blocks: int = 0  # prompt blocks waiting to be prefilled
    num_running_requests: int = 0
    max_num_seqs: int = 0  # 0: no limit
    healthy: bool = True
    # The router's decayed ledger of work it assigned here (blocks); 0 when it keeps none.
    recent_work_blocks: float = 0.0
    # Cumulative prefill tokens computed and the engine time they took (seconds, this replica's
    # clock): the router learns the replica's prefill rate from their growth between reports
    # (``routing.ttft_cost.PrefillRateEstimator``). 0 from engines that do not count them.
    num_prefill_tokens_total: int = 0
    prefill_seconds_total: float = 0.0

    @property
    def load_blocks(self) -> int:
        return self.num_active_blocks + self.num_queued_blocks

    @property
    def has_seq_slot(self) -> bool:
        return not self.max_num_seqs or self.num_running_requests < self.max_num_seqs


@dataclass(frozen=True)
class BlockUsage:
    """Leak check: after all requests end, ``num_free_blocks == num_blocks`` and the rest is 0."""

    num_blocks: int
    num_free_blocks: int
    num_requests: int
    num_reserved: int
    num_leases: int


@dataclass(frozen=True)
class ReplicaState:
    """What the router polls: a routing snapshot, KV events since the last poll, counters, and
    where the engine runs (``device``: its model's and KV cache's torch device, ``"cuda:0"`` or
    ``"cpu"``; ``""`` from a runtime that does not report one)."""

    snapshot: ReplicaSnapshot
    events: tuple[KVCacheEvent, ...]
    kv: KVCacheStats
    usage: BlockUsage
    max_model_len: int
    num_waiting: int
    device: str = ""
