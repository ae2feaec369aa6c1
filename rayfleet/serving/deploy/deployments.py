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
- A wide-EP pool (``ranks_per_replica > 1``) binds ``gang_replica.GangReplica`` instead: one
  Serve replica whose placement group holds its front and one bundle per rank (``gang_options``),
  so Serve places, restarts and scales the gang as one replica.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import get_accelerator
from rayfleet.serving.deploy.engine_replica import EngineReplica
from rayfleet.serving.deploy.pool_scaling import DRAIN_OPTIONS, autoscaling_config
from rayfleet.serving.spec import PoolSpec, ServeSpec

__all__ = ["EngineReplica", "bind_pool", "replica_options", "pool_deployment_options"]


def replica_options(pool: PoolSpec) -> dict[str, Any]:
    """Ray actor / placement options for one replica of ``pool`` (see module doc)."""
    accelerator = get_accelerator(pool.accelerator_type) if pool.accelerator_type else None
    resource = accelerator.ray_resource if accelerator is not None else "GPU"
    if pool.ranks_per_replica > 1:
        return gang_options(pool, resource, accelerator.name if accelerator is not None else None)
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


def rank_resources(pool: PoolSpec, resource: str) -> dict[str, float]:
    """What each rank of a wide-EP gang reserves: one accelerator, or a sliver of CPU on a
    CPU-only pool (a bundle cannot be empty)."""
    return {resource: 1.0} if pool.accelerators_per_replica else {"CPU": 0.01}


def gang_options(pool: PoolSpec, resource: str, accelerator: str | None) -> dict[str, Any]:
    """A wide-EP replica: bundle 0 for the front (CPU share only), one bundle per rank, PACK
    (see ``gang_replica``), the accelerator-type label selector on every bundle."""
    front = {"CPU": max(pool.num_cpus, 0.01)}
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": front["CPU"]},
        "placement_group_bundles": [front] + [rank_resources(pool, resource)] * pool.ranks_per_replica,
        "placement_group_strategy": "PACK"}
    if accelerator is not None:
        options["placement_group_bundle_label_selector"] = [{L.ACCELERATOR_TYPE: accelerator}] * (
            pool.ranks_per_replica + 1)
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
            **DRAIN_OPTIONS}


def bind_pool(spec: ServeSpec, role: str) -> Any:
    """``role``'s pool as a bound Serve deployment of ``EngineReplica`` (an app's node)."""
    config = spec.engine_config()
    model = {"preset": spec.model.preset if not spec.model.checkpoint else None, "seed": spec.model.seed,
             "checkpoint": spec.model.checkpoint, "dtype": spec.model.dtype, "overrides": dict(spec.model.overrides),
             "hf": spec.model.hf}
    pool = spec.pools()[role]
    if pool.ranks_per_replica > 1:
        from rayfleet.serving.deploy.gang_replica import GangReplica

        accelerator = get_accelerator(pool.accelerator_type) if pool.accelerator_type else None
        eb = spec.expert_balancing
        wide_ep = {"num_ranks": pool.ranks_per_replica, "num_redundant_experts": eb.num_redundant_experts,
                   "live_eplb": eb.enabled, "window_steps": eb.window_steps, "history_windows": eb.history_windows,
                   "percentile": eb.percentile, "rebalance_every_windows": max(1, eb.rebalance_every_windows),
                   "rank_resources": rank_resources(pool, accelerator.ray_resource if accelerator else "GPU"),
                   "timeout_s": spec.request_timeout_s}
        return serve.deployment(GangReplica).options(**pool_deployment_options(spec, role)).bind(
            role=role, model=model, config=config, transport=spec.kv_transfer.transport,
            lease_s=spec.kv_transfer.lease_s, wide_ep=wide_ep, model_name=spec.model.served_name)
    return serve.deployment(EngineReplica).options(**pool_deployment_options(spec, role)).bind(
        role=role, model=model, config=config, transport=spec.kv_transfer.transport, lease_s=spec.kv_transfer.lease_s,
        expert_balancing=spec.expert_balancing.config(), model_name=spec.model.served_name,
        kv_cache=spec.kv_cache.model_dump() if spec.kv_cache.enabled else None)
