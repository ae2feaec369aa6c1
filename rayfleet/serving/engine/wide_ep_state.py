"""A wide-EP replica's state as one replica: the ranks' reports merged, and the gang's figures.

Design decisions:
- The router, the leak checks and the metrics see a gang as ONE replica: its KV pool is the sum
  of the ranks' pools, its running and queued work the sum of theirs, its context limit the
  smallest rank's. Pure functions of the latest ``StepReport``s (every rank reports its state
  after every step), so they are unit-testable without a gang.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.serving.engine.kv_cache_manager import KVCacheStats
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaId, ReplicaSnapshot, ReplicaState
from rayfleet.serving.engine.wide_ep_rank import StepReport

__all__ = ["GangFigures", "gang_figures", "merge_state", "merge_usage"]


@dataclass(frozen=True)
class GangFigures:
    """What the gang did (``GangReplica.wide_ep_stats``)."""

    num_ranks: int
    num_steps: int
    num_reforms: int
    num_resumed: int
    moves: tuple[tuple[int, str, int, float], ...]  # (step, reason, slots received, seconds)
    requests_per_rank: tuple[int, ...]
    busy_s_per_rank: tuple[float, ...]
    empty_forwards_per_rank: tuple[int, ...]
    p99_queue_depth_per_rank: tuple[int, ...]


def _p99(values: list[int]) -> int:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else 0


def gang_figures(front, *, num_reforms: int, num_resumed: int) -> GangFigures:
    """``front`` (a ``WideEPReplica``) and the engine's fault counters as ``GangFigures``."""
    ranks = front.ranks
    return GangFigures(num_ranks=front.num_ranks, num_steps=front.num_steps, num_reforms=num_reforms,
                       num_resumed=num_resumed, moves=tuple(front.moves),
                       requests_per_rank=tuple(f.num_requests for f in ranks),
                       busy_s_per_rank=tuple(f.busy_s for f in ranks),
                       empty_forwards_per_rank=tuple(f.empty_forwards for f in ranks),
                       p99_queue_depth_per_rank=tuple(_p99(f.queue_depth) for f in ranks))


def merge_usage(reports: list[StepReport], *, num_leases: int) -> BlockUsage:
    states = [r.state for r in reports]
    return BlockUsage(num_blocks=sum(s.kv.num_blocks for s in states),
                      num_free_blocks=sum(s.kv.num_free_blocks for s in states),
                      num_requests=sum(s.num_requests for s in states),
                      num_reserved=sum(s.num_reserved for s in states), num_leases=num_leases)


def merge_state(reports: list[StepReport], *, name: str, events: tuple, usage: BlockUsage,
                prefill_seconds_total: float) -> ReplicaState:
    """The gang as one replica for the router (see the module doc)."""
    snaps = [r.state.snapshot for r in reports]
    kvs = [r.state.kv for r in reports]
    total, free = sum(k.num_blocks for k in kvs), sum(k.num_free_blocks for k in kvs)
    snapshot = ReplicaSnapshot(replica_id=ReplicaId(name), num_total_blocks=total, num_free_blocks=free,
                               num_active_blocks=sum(s.num_active_blocks for s in snaps),
                               num_queued_blocks=sum(s.num_queued_blocks for s in snaps),
                               num_running_requests=sum(s.num_running_requests for s in snaps),
                               max_num_seqs=sum(s.max_num_seqs for s in snaps),
                               num_prefill_tokens_total=sum(s.num_prefill_tokens_total for s in snaps),
                               prefill_seconds_total=prefill_seconds_total)
    kv = KVCacheStats(num_blocks=total, num_free_blocks=free, num_cached_blocks=sum(k.num_cached_blocks for k in kvs),
                      usage=1.0 - free / total if total else 0.0,
                      prefix_query_tokens=sum(k.prefix_query_tokens for k in kvs),
                      prefix_hit_tokens=sum(k.prefix_hit_tokens for k in kvs))
    return ReplicaState(snapshot=snapshot, events=events, kv=kv, usage=usage,
                        max_model_len=min(r.state.max_model_len for r in reports),
                        num_waiting=sum(r.num_waiting for r in reports))
