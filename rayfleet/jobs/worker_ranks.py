"""Make a Ray Train worker's torch.distributed rank equal to its rank in the placement layout.

Design decisions:
- Ray Train v2 numbers workers by (node id, GPU id), not by the placement group bundle they
  sit in, so its world rank is unrelated to the layout's rank (whose TP/EP/DP groups the
  planner placed on purpose: TP inside a node, DP peers on one rail). Rather than teach every
  parallelizer a permutation, each worker works out its layout rank and the default process
  group is re-created with those ranks: everything downstream (device mesh, data shard,
  checkpoint shards) then sees ``dist.get_rank() == layout rank``.
- The assignment is a pure function of what every worker reports (node label, accelerator
  index Ray gave it): ranks on a node are paired with that node's workers in accelerator-index
  order, so on an idle node Ray's lowest-free-id rule hands rank r exactly its planned rail.
  When Ray put a different number of workers on a node than the layout asked for, that is a
  placement failure and raises instead of silently training with the wrong groups.
- The new group needs a rendezvous hosted by the worker that becomes rank 0: once the ranks
  are known, that worker starts a store on a port the OS picks and broadcasts the port over
  Ray's group (``platform.rendezvous``: no free-port probe whose port another process could
  take before the store binds it).
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from rayfleet.errors import RayfleetError

__all__ = ["WorkerPlace", "RankAssignment", "assign_layout_ranks", "rerank_process_group", "rerank_note"]


class PlacementMismatchError(RayfleetError):
    """Ray Train placed workers on other nodes than the layout asked for."""


@dataclass(frozen=True)
class WorkerPlace:
    """Where one Ray Train worker runs: its Ray world rank, node label, accelerator index, host."""

    ray_rank: int
    node: str
    accelerator_index: int
    host: str


@dataclass(frozen=True)
class RankAssignment:
    """``layout_rank_of[ray_rank]``; ``rail_matches`` counts workers on their planned index."""

    layout_rank_of: tuple[int, ...]
    rail_matches: int

    @property
    def world_size(self) -> int:
        return len(self.layout_rank_of)


def assign_layout_ranks(workers: Sequence[WorkerPlace],
                        layout_slots: Sequence[tuple[str, int]]) -> RankAssignment:
    """Pair workers with layout ranks node by node, in accelerator-index order.

    Args:
        workers: one entry per Ray Train worker (any order).
        layout_slots: ``layout_slots[r] = (node, accelerator index)`` of layout rank ``r``.

    Raises:
        PlacementMismatchError: a node hosts a different number of workers than layout ranks.
    """
    if len(workers) != len(layout_slots):
        raise PlacementMismatchError(f"{len(workers)} workers for a {len(layout_slots)}-rank layout")
    ranks_on: dict[str, list[int]] = defaultdict(list)
    for rank, (node, _index) in enumerate(layout_slots):
        ranks_on[node].append(rank)
    workers_on: dict[str, list[WorkerPlace]] = defaultdict(list)
    for w in workers:
        workers_on[w.node].append(w)
    if {n: len(r) for n, r in ranks_on.items()} != {n: len(w) for n, w in workers_on.items()}:
        raise PlacementMismatchError(
            "Ray Train placed workers as " + str({n: len(w) for n, w in sorted(workers_on.items())})
            + " but the layout needs " + str({n: len(r) for n, r in sorted(ranks_on.items())})
            + "; fix: check that the nodes carry rayfleet.io/node labels and are not cordoned, then resubmit")
    layout_rank_of = [0] * len(workers)
    matches = 0
    for node, ranks in ranks_on.items():
        ranks = sorted(ranks, key=lambda r: (layout_slots[r][1], r))
        placed = sorted(workers_on[node], key=lambda w: (w.accelerator_index, w.ray_rank))
        for rank, w in zip(ranks, placed):
            layout_rank_of[w.ray_rank] = rank
            matches += int(w.accelerator_index == layout_slots[rank][1])
    return RankAssignment(tuple(layout_rank_of), matches)


def rerank_note(assignment: RankAssignment) -> str | None:
    """The job log's line when Ray's worker ranks were not the layout's (None when they were)."""
    moved = [(ray_rank, rank) for ray_rank, rank in enumerate(assignment.layout_rank_of) if ray_rank != rank]
    if not moved:
        return None
    return ("rayfleet train: Ray Train's worker ranks differ from the layout's; the process group was re-formed "
            f"(Ray rank -> layout rank: {', '.join(f'{a}->{b}' for a, b in moved)}; "
            f"{assignment.rail_matches}/{assignment.world_size} workers on their planned rail)")


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray worker: this host's address
        return socket.gethostbyname(socket.gethostname())


def _local_accelerator_index() -> int:
    """The accelerator index Ray gave this worker: its slot resource, else its first GPU id."""
    from rayfleet.placement import assigned_slot_index

    slot = assigned_slot_index()
    if slot is not None:
        return slot
    try:
        import ray

        ids = ray.get_gpu_ids()
        if ids:
            return int(ids[0])
    except Exception:  # noqa: BLE001 - outside a Ray worker there are no ids to read
        pass
    return int(os.environ.get("LOCAL_RANK", "0"))


def rerank_process_group(layout_slots: Sequence[tuple[str, int]], *, node: str,
                         backend: str, timeout_s: float = 300.0) -> RankAssignment:
    """Inside every Ray Train worker (default group initialized by Ray): rebuild the default
    group so that this worker's rank is its layout rank. Collective: all workers must call it."""
    import torch.distributed as dist

    from rayfleet.platform.rendezvous import host_store, join_group

    me = WorkerPlace(ray_rank=dist.get_rank(), node=node, accelerator_index=_local_accelerator_index(),
                     host=_node_ip())
    gathered: list[WorkerPlace | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, me)
    places = [p for p in gathered if p is not None]
    assignment = assign_layout_ranks(places, layout_slots)
    if tuple(range(len(places))) == assignment.layout_rank_of:
        return assignment  # Ray's order already is the layout's: keep the group Ray built
    host_of_rank0 = next(p for p in places if assignment.layout_rank_of[p.ray_rank] == 0)
    my_rank = assignment.layout_rank_of[me.ray_rank]
    # the new rank 0 hosts the rendezvous and only then says its port: no other process can take it
    store = host_store(len(places), host=host_of_rank0.host, timeout_s=timeout_s) if my_rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=host_of_rank0.ray_rank)
    dist.barrier()
    dist.destroy_process_group()
    join_group(backend, host=host_of_rank0.host, port=port[0], rank=my_rank, world_size=len(places),
               timeout_s=timeout_s, store=store)
    return assignment
