"""``EngineReplica``: the Serve replica class of an engine pool (any role), a thin shell around
the Ray-free ``AsyncEngine`` (see ``deployments`` for the pools' deployment options and
``gang_replica`` for the wide-EP replica built on the same class).

Design decisions: those of ``deployments`` (replicas name themselves, honour only pins that name
them, publish their routing state through ``record_routing_stats``; one intra-op torch thread).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray import serve

from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle
from rayfleet.serving.engine.loading import load_engine, replica_device
from rayfleet.serving.engine.replica_output import GenerationChunk, PrefillReply
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaState
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.errors import ReplicaUnavailableError
from rayfleet.serving.experts.balancer import ExpertBalanceStats, ExpertBalancingConfig, ExpertLoadBalancer
from rayfleet.serving.kv.transfer import make_transport
from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.routing.split_prefill import SpanPrefillWorker, SpanReply, SpanWork

__all__ = ["EngineReplica", "own_replica_id"]


def own_replica_id() -> str:
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
        self.replica_id = own_replica_id()
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
                             kv_tiers=self.kv_tiers, hf=model.get("hf"), device=replica_device())
        self.balancer = ExpertLoadBalancer(engine.model, expert_balancing) if expert_balancing else None
        self._attach(AsyncEngine(engine, name=name, transport=make_transport(transport, owner=name, lease_s=lease_s),
                                 after_step=self.balancer.after_step if self.balancer is not None else None),
                     model_name=model_name)
        self.spans = SpanPrefillWorker(self.engine)

    def _attach(self, engine: Any, *, model_name: str) -> None:
        """The replica's runtime (``AsyncEngine``, or ``GangEngine`` for a wide-EP gang) and the
        state every replica publishes around it."""
        self.engine = engine
        self._hash_log = HashLogPublisher()  # cached block hashes, published as a log + periodic full set
        self._stats: dict[str, Any] = {}
        self._stats_key: tuple | None = None
        self._versions = itertools.count()
        self._engine_metrics = None
        if model_name:
            from rayfleet.serving.deploy.serving_metrics import RayEngineMetrics

            self._engine_metrics = RayEngineMetrics(model_name=model_name, role=self.role, replica=self.replica_id)

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
                           "prefill_seconds_total": snap.prefill_seconds_total, "taken_at": time.time(),
                           **self._hash_log.fields(now_s), "state": replace(state, events=())}
        else:  # the same numbers, confirmed now: a router that reads them first dates them now
            self._stats["taken_at"] = time.time()
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
