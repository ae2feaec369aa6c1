"""A wide-EP replica as a Ray Serve deployment: one Serve replica fronting a gang of rank actors.

Design decisions:
- Serve owns the gang's placement group: a wide-EP pool's deployment asks for bundle 0 (the
  front: this Serve replica, a small CPU share and no accelerator) plus one bundle per rank (one
  accelerator each, the pool's ``rayfleet.io/accelerator-type`` label selector on every bundle),
  PACK strategy: ranks fill a node (its fast domain) before they spill over, as the planner places
  expert parallelism for training. Serve starts, health-checks, restarts and scales whole
  replicas, so a gang is lent, reclaimed and replaced as one unit, and removing the replica
  removes its placement group and with it every rank.
- Each rank is a Ray actor (``WideEPRankActor``) scheduled into its bundle; rank 0 hosts the
  store of the gloo (``nccl`` when the ranks see CUDA devices) process group on a port the OS
  chose (``platform.rendezvous``: the port is listening before it is handed out, so no other
  process can take it in between) and all ranks then join it. The actors run the Ray-free
  ``WideEPRank``; this module only moves its two messages (``StepCommand`` in, ``StepReport``
  out) as actor calls.
- ``RayGang.step`` waits for the ranks' replies with ``ray.wait`` and raises ``GangError`` at the
  first rank that failed or died, without waiting for the others (they may be blocked in a
  collective with the dead rank until the gloo timeout). ``close`` kills every rank actor, so a
  broken gang's survivors release their bundles at once; ``GangEngine`` then forms a new gang in
  the same bundles and resumes the requests in flight.
- Each rank reads prefilled KV itself through its own reader of the pool's KV transport
  (``kv_reader``), so a handoff goes from the prefill replica (or rank) to the decode rank.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import ray

from rayfleet.serving.deploy.engine_replica import EngineReplica, own_replica_id
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.wide_ep_async import GangEngine
from rayfleet.serving.engine.wide_ep_local import GangError
from rayfleet.serving.engine.wide_ep_rank import ModelRecipe, StepCommand, StepReport
from rayfleet.serving.engine.wide_ep_replica import WideEPReplica
from rayfleet.serving.experts.eplb import ExpertPlacement, rebalance_experts
from rayfleet.serving.experts.live_eplb import LiveEPLBConfig, LiveEPLBPolicy
from rayfleet.serving.kv.transfer import make_transport

__all__ = ["GangReplica", "RayGang", "WideEPRankActor"]


class WideEPRankActor:
    """One rank of a gang (a Ray actor; see the module doc)."""

    def __init__(self, rank: int, num_ranks: int, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.rank, self.num_ranks, self.worker = rank, num_ranks, None
        self.store = None  # rank 0: the group's store, hosted by ``rendezvous``

    def rendezvous(self, timeout_s: float) -> tuple[str, int, bool]:
        """Rank 0: host the process group's store; its address and port, whether CUDA is visible."""
        import torch

        from rayfleet.platform.rendezvous import host_store

        address = ray.util.get_node_ip_address()
        self.store = host_store(self.num_ranks, host=address, timeout_s=timeout_s)
        return address, self.store.port, torch.cuda.is_available()

    def start(self, address: str, port: int, backend: str, timeout_s: float, recipe: ModelRecipe,
              config: EngineConfig, placement: ExpertPlacement, routing: str, transport: str, lease_s: float) -> int:
        import torch.distributed as dist

        from rayfleet.platform.rendezvous import join_group
        from rayfleet.serving.engine.wide_ep_rank import WideEPRank

        join_group(backend, host=address, port=port, rank=self.rank, world_size=self.num_ranks, timeout_s=timeout_s,
                   store=self.store)
        self.worker = WideEPRank(rank=self.rank, num_ranks=self.num_ranks, group=dist.group.WORLD, recipe=recipe,
                                 engine_config=config, placement=placement, routing=routing,
                                 device="cuda" if backend == "nccl" else "cpu",
                                 kv_reader=make_transport(transport, owner=f"rank-{self.rank}", lease_s=lease_s))
        return self.rank

    def step(self, command: StepCommand) -> StepReport:
        return self.worker.step(command)


class RayGang:
    """``num_ranks`` rank actors in bundles ``first_bundle ..`` of ``placement_group``."""

    def __init__(self, *, num_ranks: int, recipe: ModelRecipe, engine_config: EngineConfig,
                 placement: ExpertPlacement, placement_group: Any, first_bundle: int = 1,
                 rank_resources: dict[str, float] | None = None, routing: str = "balanced",
                 transport: str = "ray_object_store", lease_s: float = 30.0, threads_per_rank: int = 1,
                 timeout_s: float = 120.0, name: str = "wide-ep") -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.num_ranks, self.timeout_s = num_ranks, timeout_s
        actor = ray.remote(WideEPRankActor)
        resources = dict(rank_resources or {})
        gpus = resources.pop("GPU", 0)
        self.actors = [actor.options(
            name=f"{name}-rank-{uuid.uuid4().hex[:8]}-{r}", num_cpus=0, num_gpus=gpus, resources=resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=first_bundle + r,
                placement_group_capture_child_tasks=False) if placement_group is not None else None,
        ).remote(r, num_ranks, threads_per_rank) for r in range(num_ranks)]
        try:
            address, port, cuda = self._get([self.actors[0].rendezvous.remote(timeout_s)])[0]
            backend = "nccl" if cuda else "gloo"
            self._get([a.start.remote(address, port, backend, timeout_s, recipe, engine_config, placement, routing,
                                      transport, lease_s) for a in self.actors])
        except BaseException:
            self.close()
            raise

    def _get(self, refs: list) -> list:
        """Every reply, or ``GangError`` at the first rank that failed (not waiting for the rest)."""
        index = {ref: r for r, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GangError(f"ranks {sorted(index[p] for p in pending)} sent nothing for {self.timeout_s:.0f} s")
            try:
                ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - RayActorError (died) or RayTaskError (raised)
                raise GangError(f"rank {index[ready[0]]}: {type(exc).__name__}: {exc}") from exc
        return ray.get(refs)

    def step(self, commands: list[StepCommand]) -> list[StepReport]:
        assert len(commands) == self.num_ranks
        return self._get([a.step.remote(c) for a, c in zip(self.actors, commands)])

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                continue


def live_eplb_for(wide_ep: dict[str, Any], *, num_layers: int, num_experts: int) -> tuple[ExpertPlacement,
                                                                                           LiveEPLBPolicy | None]:
    """The gang's initial placement (uniform demand) and its live EPLB policy (or ``None``)."""
    import torch

    ranks, slots = wide_ep["num_ranks"], num_experts + wide_ep["num_redundant_experts"]
    initial = rebalance_experts(torch.ones(num_layers, num_experts), num_physical_experts=slots, num_groups=1,
                                num_nodes=1, num_devices=ranks, policy="global")
    if not wide_ep["live_eplb"]:
        return initial, None
    config = LiveEPLBConfig(num_devices=ranks, num_physical_experts=slots, policy="global",
                            window_steps=wide_ep["window_steps"], history_windows=wide_ep["history_windows"],
                            percentile=wide_ep["percentile"], rebalance_every_windows=wide_ep["rebalance_every_windows"])
    return initial, LiveEPLBPolicy(config, num_layers=num_layers, num_experts=num_experts, initial=initial)


class GangReplica(EngineReplica):
    """One replica of a wide-EP pool (``ranks_per_replica > 1``): the same methods as
    ``EngineReplica`` over a ``GangEngine``, plus ``wide_ep_stats``."""

    def __init__(self, *, role: str, model: dict[str, Any], config: EngineConfig, transport: str, lease_s: float,
                 wide_ep: dict[str, Any], model_name: str = "") -> None:
        import torch

        from rayfleet.models import ByteTokenizer, preset

        torch.set_num_threads(1)
        self.replica_id = own_replica_id()
        self.role = role
        self.kv_tiers = self._kv_index = self.balancer = self.spans = None  # no host tiers, no slot balancer
        name = f"{role}/{self.replica_id}"
        recipe = ModelRecipe(model["preset"] or "tiny", tuple(sorted(model["overrides"].items())), seed=model["seed"],
                             dtype=model["dtype"])
        shape = preset(recipe.name, **dict(recipe.overrides))
        initial, eplb = live_eplb_for(wide_ep, num_layers=shape.num_moe_layers, num_experts=shape.num_experts)
        pg = ray.util.get_current_placement_group()
        ranks = wide_ep["num_ranks"]

        def make_front(placement: ExpertPlacement | None) -> WideEPReplica:
            gang = RayGang(num_ranks=ranks, recipe=recipe, engine_config=config, placement=placement or initial,
                           placement_group=pg, rank_resources=wide_ep["rank_resources"], transport=transport,
                           lease_s=lease_s, timeout_s=wide_ep["timeout_s"], name=f"wide-ep-{role}")
            return WideEPReplica(gang, num_ranks=ranks, block_size=config.block_size, eplb=eplb, max_history=4096)

        engine = GangEngine(make_front, name=name, tokenizer=ByteTokenizer(),
                            transport=make_transport(transport, owner=name, lease_s=lease_s))
        self._attach(engine, model_name=model_name)

    async def wide_ep_stats(self, *, route=None):
        """Steps, re-forms, resumed requests, expert moves and per-rank load (``GangFigures``)."""
        self._check(route)
        return await self.engine.figures()

    async def prefill_span(self, work, *, route=None):
        from rayfleet.errors import SpecError

        raise SpecError("long_context.split_threshold_tokens", None, "a wide-EP replica takes no split-prefill "
                        "spans", "leave long_context unset for pools with ranks_per_replica > 1")
