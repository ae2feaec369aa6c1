"""Ray Serve deployments of the engine pools (prefill, decode, colocated).

Design decisions:
- A thin shell around the Ray-free engine: ``EngineReplica`` owns an ``AsyncEngine`` (model
  loaded in ``__init__``). The ingress that fronts the pools (``openai_api.serve_app``) sits a
  room higher and binds these pools into its application (``bind_pool``).
- Each pool is ONE Serve deployment named after its role (``colocated``, ``prefill``,
  ``decode``) with N replicas: Serve starts, health-checks, restarts, rolls and autoscales them
  (``pool_scaling``: Serve's rule within bounds the shared autoscaler moves). Requests are routed
  by ``routing.request_router.PrefixLoadRequestRouter`` inside the ingress's handles, from the
  state each replica publishes with ``record_routing_stats`` (its snapshot, and its cached
  block hashes as a bounded log plus a periodic full set: ``routing.hash_log``). No router
  deployment sits in the request path: a router hop (ask a router deployment, then call the
  chosen replica) doubled the p50 latency of an engine call on a 2-replica pool
  (``benchmarks/serve_routing_hop.py``: 16.6 ms against 8.0 ms in-handle on the shared 2-core
  machine), and the old router also polled every replica ten times a second while busy.
- Replicas name themselves (Serve's replica id) in their answers, and honour a pinned
  ``RouteHint`` only if it names them (``ReplicaUnavailableError`` otherwise): Serve's router has
  no "this replica or fail", so a pin to a replica that left the pool reaches another one,
  which refuses.
- Placement: a replica reserves ``accelerators_per_replica`` accelerators of its pool's type as
  the catalogue's Ray resource (``GPU`` for NVIDIA, ``XPU`` for Kunlun, ``NPU`` for Ascend;
  ``GPU`` when the pool names no type) and a small CPU share, on nodes whose topology label
  ``rayfleet.io/accelerator-type`` matches. A replica with more than one accelerator gets one
  STRICT_PACK placement group, so its accelerators share a node (its tensor-parallel group).
- Engines set one intra-op torch thread: replicas share the node's cores.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray import serve

from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import get_accelerator
from rayfleet.serving.deploy.pool_scaling import autoscaling_config
from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.replica_output import GenerationChunk, PrefillReply
from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaState
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.errors import ReplicaUnavailableError
from rayfleet.serving.experts.balancer import ExpertBalanceStats, ExpertBalancingConfig, ExpertLoadBalancer
from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle
from rayfleet.serving.kv.transfer import make_transport
from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.routing.split_prefill import SpanPrefillWorker, SpanReply, SpanWork
from rayfleet.serving.spec import PoolSpec, ServeSpec

__all__ = ["EngineReplica", "bind_pool", "replica_options", "pool_deployment_options"]


def _own_replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (direct construction in tests)
        import uuid

        return uuid.uuid4().hex[:8]


class EngineReplica:
    """One replica of a pool (any role). Streaming methods are async generators (``stream=True``).
    Every request method takes the caller's ``RouteHint`` as ``route`` (read by Serve's router
    in the caller; here only a pin is checked)."""

    def __init__(self, *, role: str, model: dict[str, Any], config: EngineConfig, transport: str,
                 lease_s: float, expert_balancing: ExpertBalancingConfig | None = None,
                 model_name: str = "", kv_cache: dict[str, Any] | None = None) -> None:
        import torch

        torch.set_num_threads(1)
        self.replica_id = _own_replica_id()
        self.role = role
        name = f"{role}/{self.replica_id}"
        # ``kv_cache`` (ServeSpec.kv_cache, dumped): this node's host/disk tiers actor and the
        # fleet's KV index, joined to the engine's pool by a connector (``kv.tier_actors``).
        self.kv_tiers = self._kv_index = None
        if kv_cache is not None:
            from rayfleet.serving.kv.tier_actors import connector_for_replica, get_kv_index

            self.kv_tiers = connector_for_replica(host_blocks=kv_cache["host_blocks"], disk=kv_cache.get("disk"),
                                                  prefetch_window=kv_cache["prefetch_window"])
            self._kv_index = get_kv_index()
        engine = load_engine(preset_name=model["preset"], seed=model["seed"], checkpoint=model["checkpoint"],
                             dtype=model["dtype"], overrides=model["overrides"], config=config,
                             kv_tiers=self.kv_tiers, hf=model.get("hf"))
        self.balancer = ExpertLoadBalancer(engine.model, expert_balancing) if expert_balancing else None
        self.engine = AsyncEngine(engine, name=name, transport=make_transport(transport, owner=name, lease_s=lease_s),
                                  after_step=self.balancer.after_step if self.balancer is not None else None)
        self.spans = SpanPrefillWorker(self.engine)
        self._hash_log = HashLogPublisher()  # cached block hashes, published as a log + periodic full set
        self._stats: dict[str, Any] = {}
        self._stats_key: tuple | None = None
        self._versions = itertools.count()
        self._engine_metrics = None
        if model_name:
            from rayfleet.serving.deploy.serving_metrics import RayEngineMetrics

            self._engine_metrics = RayEngineMetrics(model_name=model_name, role=role, replica=self.replica_id)

    def check_health(self) -> None:
        """Serve's health check: raises when the engine loop died, a step is wedged or steps
        keep failing (``AsyncEngine.check_health``), so Serve replaces this replica."""
        self.engine.check_health()

    def _check(self, route: RouteHint | None) -> None:
        if route is not None and route.replica is not None and route.replica != self.replica_id:
            raise ReplicaUnavailableError(route.replica, f"left the {self.role} pool (the call reached "
                                                         f"{self.replica_id} instead)")

    async def _tagged(self, chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        """The chunks, the first one naming this replica by its Serve id (the engine names itself
        ``role/replica``): the ingress's pool client pins the request's later calls with it."""
        first = True
        async for chunk in chunks:
            if first:
                chunk, first = replace(chunk, replica=self.replica_id), False
            yield chunk

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None,
                       *, route: RouteHint | None = None):
        self._check(route)
        async for chunk in self._tagged(self.engine.generate(request_id, prompt, params, cache_salt=cache_salt)):
            yield chunk

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None,
                      *, route: RouteHint | None = None) -> tuple[PrefillReply, str]:
        """The reply and this replica's id (the KV lease lives here until released)."""
        self._check(route)
        return await self.engine.prefill(request_id, prompt, params, cache_salt=cache_salt), self.replica_id

    async def decode(self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams,
                     handle: KVHandle, cache_salt: str | None, *, route: RouteHint | None = None):
        self._check(route)
        async for chunk in self._tagged(self.engine.decode(request_id, prompt, first_token_id, params, handle,
                                                           self.engine.transport, cache_salt=cache_salt)):
            yield chunk

    def release_kv(self, handoff_id: HandoffId, *, route: RouteHint | None = None) -> bool:
        self._check(route)
        return self.engine.release_kv(handoff_id)

    async def abort(self, request_id: str, *, route: RouteHint | None = None) -> None:
        self._check(route)
        await self.engine.abort(request_id)

    async def block_usage(self, *, route: RouteHint | None = None) -> tuple[str, BlockUsage]:
        self._check(route)
        return self.replica_id, await self.engine.block_usage()

    def tokenizer(self, *, route: RouteHint | None = None) -> Any:
        """The served model's tokenizer: the ingress's OpenAI app encodes and decodes with it."""
        self._check(route)
        return self.engine.tokenizer()

    async def reset_prefix_cache(self, *, route: RouteHint | None = None) -> bool:
        self._check(route)
        return await self.engine.reset_prefix_cache()

    async def replica_state(self, *, route: RouteHint | None = None) -> tuple[str, ReplicaState]:
        """This replica's last published state (KV events are consumed by the stats, not here)."""
        self._check(route)
        state = self._stats.get("state")
        if state is None:
            await self.record_routing_stats()
            state = self._stats["state"]
        return self.replica_id, state

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this every ``request_routing_stats_period_s`` and hands the result to every
        caller's request router (schema: ``routing.pool_router.ROUTING_STATS_KEYS`` and
        ``routing.hash_log.HASH_LOG_KEYS``, plus ``state`` for the ingress's /metrics and
        /health). The version changes only when the state did or the full hash set is due
        (``HashLogPublisher``: recent hash events every time, the whole set every period), so an
        idle pool causes no updates once its last publication carries the full set."""
        state = await self.engine.poll_state()
        self._hash_log.apply(state.events)
        if self._kv_index is not None and state.events:  # the global index: fire and forget (a hint)
            self._kv_index.apply_engine_events.remote(self.kv_tiers.node_id, self.replica_id, list(state.events))
        snap = state.snapshot
        key = (snap.num_total_blocks, snap.num_free_blocks, snap.num_active_blocks, snap.num_queued_blocks,
               snap.num_running_requests, state.num_waiting, state.kv.prefix_query_tokens,
               self._hash_log.epoch, self._hash_log.seq)
        if self._engine_metrics is not None:
            self._engine_metrics.observe(state)
        now_s = time.monotonic()
        if key != self._stats_key or not self._stats or (
                "block_hashes" not in self._stats and self._hash_log.full_due(now_s)):
            self._stats_key = key
            self._stats = {"version": next(self._versions), "num_total_blocks": snap.num_total_blocks,
                           "num_free_blocks": snap.num_free_blocks, "num_active_blocks": snap.num_active_blocks,
                           "num_queued_blocks": snap.num_queued_blocks,
                           "num_running_requests": snap.num_running_requests, "max_num_seqs": snap.max_num_seqs,
                           "num_prefill_tokens_total": snap.num_prefill_tokens_total,
                           "prefill_seconds_total": snap.prefill_seconds_total,
                           **self._hash_log.fields(now_s), "state": replace(state, events=())}
        return self._stats

    async def prefill_span(self, work: SpanWork, *, route: RouteHint | None = None) -> SpanReply:
        """One layer of one span of a split prefill (``split_prefill``)."""
        self._check(route)
        return await self.spans.run(work)

    def release_span(self, job_id: str, *, route: RouteHint | None = None) -> int:
        self._check(route)
        return self.spans.release(job_id)

    def kv_tier_stats(self, *, route: RouteHint | None = None):
        """This replica's connector counters (loads from host/disk, write-backs), or None when
        the spec has no ``kv_cache`` tiers."""
        self._check(route)
        return self.kv_tiers.stats() if self.kv_tiers is not None else None

    async def expert_balance_stats(self, *, route: RouteHint | None = None) -> ExpertBalanceStats | None:
        """Windows, placement updates and device balance of the expert balancer (if enabled)."""
        self._check(route)
        return await self.engine.call(self.balancer.stats) if self.balancer is not None else None


def replica_options(pool: PoolSpec) -> dict[str, Any]:
    """Ray actor / placement options for one replica of ``pool`` (see module doc)."""
    accelerator = get_accelerator(pool.accelerator_type) if pool.accelerator_type else None
    resource = accelerator.ray_resource if accelerator is not None else "GPU"
    actor: dict[str, Any] = {"num_cpus": pool.num_cpus}
    if pool.accelerators_per_replica >= 1:  # the replica process drives (at least) the first accelerator
        if resource == "GPU":
            actor["num_gpus"] = 1
        else:
            actor["resources"] = {resource: 1}
    selector = {L.ACCELERATOR_TYPE: accelerator.name} if accelerator is not None else {}
    if selector:
        actor["label_selector"] = dict(selector)
    options: dict[str, Any] = {"ray_actor_options": actor}
    if pool.accelerators_per_replica > 1:
        # Bundle 0 hosts the replica actor (its accelerator and CPU share); the rest are its TP peers.
        first = {resource: 1.0, **({"CPU": pool.num_cpus} if pool.num_cpus else {})}
        options["placement_group_bundles"] = [first] + [{resource: 1.0}] * (pool.accelerators_per_replica - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
        if actor.pop("label_selector", None):
            options["placement_group_bundle_label_selector"] = [dict(selector)] * pool.accelerators_per_replica
    return options


def pool_deployment_options(spec: ServeSpec, role: str) -> dict[str, Any]:
    """``Deployment.options`` of ``role``'s pool: replicas, placement, request router, autoscaling."""
    from ray.serve.config import RequestRouterConfig

    from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter

    pool = spec.pools()[role]
    router = RequestRouterConfig(
        request_router_class=PrefixLoadRequestRouter,
        request_router_kwargs={"role": role, "load_weight": spec.router.load_weight, "mode": spec.router.policy,
                               "cost": spec.router.cost, "tokens_per_block": spec.engine.block_size,
                               "step_token_budget": max(2, spec.engine.max_num_batched_tokens)},
        # Replicas publish their state this often (Serve's controller collects and broadcasts it);
        # between publications the router books what it routed.
        request_routing_stats_period_s=max(0.5, spec.router.poll_interval_s), request_routing_stats_timeout_s=5.0)
    return {"name": role, **replica_options(pool), "request_router_config": router,
            "autoscaling_config": autoscaling_config(replicas=pool.replicas,
                                                     target_ongoing_requests=pool.target_ongoing_requests),
            "health_check_period_s": 2, "health_check_timeout_s": 10, "max_ongoing_requests": 1000,
            # Scale-down drains: Serve stops routing to the replica and waits for its requests.
            "graceful_shutdown_timeout_s": 20, "graceful_shutdown_wait_loop_s": 0.5}


def bind_pool(spec: ServeSpec, role: str) -> Any:
    """``role``'s pool as a bound Serve deployment of ``EngineReplica`` (an app's node)."""
    config = spec.engine_config()
    model = {"preset": spec.model.preset if not spec.model.checkpoint else None, "seed": spec.model.seed,
             "checkpoint": spec.model.checkpoint, "dtype": spec.model.dtype, "overrides": dict(spec.model.overrides),
             "hf": spec.model.hf}
    return serve.deployment(EngineReplica).options(**pool_deployment_options(spec, role)).bind(
        role=role, model=model, config=config, transport=spec.kv_transfer.transport, lease_s=spec.kv_transfer.lease_s,
        expert_balancing=spec.expert_balancing.config(), model_name=spec.model.served_name,
        kv_cache=spec.kv_cache.model_dump() if spec.kv_cache.enabled else None)
