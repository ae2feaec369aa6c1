"""Ray Serve deployments: engine replicas (prefill, decode, colocated), the router, the ingress.

Design decisions:
- Thin shells around the Ray-free classes: ``EngineReplica`` owns an ``AsyncEngine`` (model
  loaded in ``__init__``), ``RouterDeployment`` a ``Router`` over ``ServeReplicaClient``s,
  ``OpenAIIngress`` an ``InferenceService`` and the FastAPI app from ``openai_app``.
- Each engine replica is its own one-replica deployment (``prefill-0``, ...; see ``spec``) so
  that the router addresses replicas by name; Serve still restarts a dead one (health checks),
  and the router re-admits it when its polls succeed again.
- Placement: a replica reserves ``accelerators_per_replica`` accelerators as Ray ``num_gpus``
  (fake GPUs on the local fleet, real ones on a cluster) and a small CPU share; with
  ``accelerator_type`` it is pinned by the node label ``ray.io/accelerator-type``. A replica
  with more than one accelerator gets one STRICT_PACK placement group of ``GPU: 1`` bundles, so
  its accelerators share a node (its tensor-parallel group). ``rayfleet.placement``'s
  ``serve_replica_options`` pins ranks to exact rails from a training layout; a serving
  replica has no such layout, so the plain resource request is the right tool here.
- Engines set one intra-op torch thread: replicas share the node's cores.
- The shared autoscaler adds replicas while the app serves: each is its own Serve application
  (``engine_application``, pinned to the node the autoscaler freed) that the router and the
  ingress are told about (``add_replica``), and it is drained (``drain_replica``: no new routes,
  wait until its requests finish) before it is deleted. Rejected: re-running the app with one
  more replica, because Serve gives every deployment of an imperatively run app a new random
  code version, which restarts every engine (model reload, cut streams) and the router.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from rayfleet.platform import labels as L
from rayfleet.serving.engine.llm_engine import EngineConfig
from rayfleet.serving.engine.async_engine import AsyncEngine, BlockUsage, PrefillReply, ReplicaState, load_engine
from rayfleet.serving.experts.balancer import ExpertBalanceStats, ExpertBalancingConfig, ExpertLoadBalancer
from rayfleet.serving.kv.transfer import HandoffId, KVHandle, make_transport
from rayfleet.serving.routing.long_prefill import LongPrefillPolicy
from rayfleet.serving.deploy.replica_client import ServeReplicaClient
from rayfleet.serving.routing.router import RoutePlan, Router, RouterCore
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.spec import PoolSpec, ServeSpec
from rayfleet.serving.routing.split_prefill import SpanPrefillWorker, SpanReply, SpanWork

__all__ = ["EngineReplica", "RouterDeployment", "OpenAIIngress", "build_app", "app_builder", "serve_config",
           "replica_options", "engine_application"]


class EngineReplica:
    """One engine replica (any role). Streaming methods are async generators (``stream=True``)."""

    def __init__(self, *, name: str, model: dict[str, Any], config: EngineConfig, transport: str,
                 lease_s: float, expert_balancing: ExpertBalancingConfig | None = None) -> None:
        import torch

        torch.set_num_threads(1)
        engine = load_engine(preset_name=model["preset"], seed=model["seed"], checkpoint=model["checkpoint"],
                             dtype=model["dtype"], overrides=model["overrides"], config=config)
        self.balancer = ExpertLoadBalancer(engine.model, expert_balancing) if expert_balancing else None
        self.engine = AsyncEngine(engine, name=name, transport=make_transport(transport, owner=name, lease_s=lease_s),
                                  after_step=self.balancer.after_step if self.balancer is not None else None)
        self.spans = SpanPrefillWorker(self.engine)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None):
        async for chunk in self.engine.generate(request_id, prompt, params, cache_salt=cache_salt):
            yield chunk

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      cache_salt: str | None) -> PrefillReply:
        return await self.engine.prefill(request_id, prompt, params, cache_salt=cache_salt)

    async def decode(self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams,
                     handle: KVHandle, cache_salt: str | None):
        async for chunk in self.engine.decode(request_id, prompt, first_token_id, params, handle,
                                              self.engine.transport, cache_salt=cache_salt):
            yield chunk

    def release_kv(self, handoff_id: HandoffId) -> bool:
        return self.engine.release_kv(handoff_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def block_usage(self) -> BlockUsage:
        return await self.engine.block_usage()

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def poll_state(self) -> ReplicaState:
        return await self.engine.poll_state()

    async def prefill_span(self, work: SpanWork) -> SpanReply:
        """One layer of one span of a split prefill (``split_prefill``)."""
        return await self.spans.run(work)

    def release_span(self, job_id: str) -> int:
        return self.spans.release(job_id)

    async def expert_balance_stats(self) -> ExpertBalanceStats | None:
        """Windows, placement updates and device balance of the expert balancer (if enabled)."""
        return await self.engine.call(self.balancer.stats) if self.balancer is not None else None


class RouterDeployment:
    """The app's single router: polls every engine replica, ranks replicas per request."""

    def __init__(self, handles: dict[str, Any], *, roles: dict[str, list[str]], mode: str, load_weight: float,
                 block_size: int, model_id: str, num_blocks: int, poll_interval_s: float,
                 idle_poll_interval_s: float = 1.0, long_prefill: LongPrefillPolicy | None = None) -> None:
        clients = {name: ServeReplicaClient(name, h) for name, h in handles.items()}
        core = RouterCore(roles=roles, policy=RouterPolicy(load_weight=load_weight), mode=mode,
                          block_size=block_size, model_id=model_id, num_blocks_hint=num_blocks,
                          long_prefill=long_prefill)
        self.router = Router(clients, core, poll_interval_s=poll_interval_s, idle_poll_interval_s=idle_poll_interval_s)

    async def route(self, prompt: list[int], max_tokens: int, cache_salt: str | None = None,
                    exclude: tuple[str, ...] = ()) -> RoutePlan:
        return await self.router.route(prompt, max_tokens, cache_salt, exclude)

    async def report_failure(self, replica: str) -> None:
        await self.router.report_failure(replica)

    async def replica_states(self) -> dict[str, ReplicaState]:
        return await self.router.replica_states()

    async def set_policy(self, mode: str) -> None:
        """Switch between ``prefix_aware`` and ``round_robin`` live (operators, benchmarks)."""
        self.router.core.set_mode(mode)

    def check_health(self) -> None:
        self.router.check_health()

    # -- replicas added and removed by the shared autoscaler ---------------------------------------
    async def add_replica(self, role: str, name: str, app_name: str) -> bool:
        """Route to ``name`` (an ``engine_application``) from now on; False if it does not answer."""
        from rayfleet.serving.routing.prefix_index import ReplicaId
        from rayfleet.serving.routing.policy import ReplicaSnapshot

        core, rid = self.router.core, ReplicaId(name)
        client = ServeReplicaClient(name, serve.get_deployment_handle(name, app_name=app_name))
        self.router.clients[name] = client
        core.snapshots.setdefault(rid, ReplicaSnapshot(rid, 0, 0, 0, healthy=False))
        await self.router._poll_one(name, client)  # a real snapshot before the first route
        if rid not in core.roles[role]:
            core.roles[role].append(rid)
        return core.snapshots[rid].healthy

    async def drain_replica(self, name: str) -> int:
        """Stop routing new requests to ``name``; returns its running + waiting requests."""
        from rayfleet.serving.routing.prefix_index import ReplicaId

        for names in self.router.core.roles.values():
            if ReplicaId(name) in names:
                names.remove(ReplicaId(name))
        state = self.router.states.get(name)
        if state is None:
            return 0
        return state.snapshot.num_running_requests + state.num_waiting

    async def forget_replica(self, name: str) -> None:
        """``name`` is gone (deleted after draining): stop polling it."""
        from rayfleet.serving.routing.prefix_index import ReplicaId

        self.router.clients.pop(name, None)
        self.router.states.pop(name, None)
        self.router.core.mark_unhealthy(name)
        self.router.core.snapshots.pop(ReplicaId(name), None)


class _RouterClient:
    """``RouterLike`` over the router deployment's handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def route(self, prompt, max_tokens, cache_salt=None, exclude=()):
        return await self.handle.route.remote(prompt, max_tokens, cache_salt, tuple(exclude))

    async def report_failure(self, replica):
        await self.handle.report_failure.remote(replica)

    async def replica_states(self):
        return await self.handle.replica_states.remote()


@serve.ingress()
class OpenAIIngress:
    """HTTP entry point: the FastAPI app of ``openai_app`` over an ``InferenceService``."""

    def __init__(self, router: Any, handles: dict[str, Any], *, model_name: str, mode: str, max_resumes: int,
                 max_prefill_retries: int, request_timeout_s: float) -> None:
        from rayfleet.serving.openai_api.metrics import ServingMetrics
        from rayfleet.serving.deploy.inference_service import InferenceService

        self.model_name = model_name
        self.service = InferenceService(
            router=_RouterClient(router), clients={n: ServeReplicaClient(n, h) for n, h in handles.items()},
            mode=mode, max_resumes=max_resumes, max_prefill_retries=max_prefill_retries,
            request_timeout_s=request_timeout_s, metrics=ServingMetrics(model_name))

    def add_replica(self, name: str, app_name: str) -> None:
        """Know replica ``name`` (an ``engine_application``) before the router may pick it."""
        self.service.add_client(name, ServeReplicaClient(name, serve.get_deployment_handle(name, app_name=app_name)))

    def load(self, window_s: float) -> dict:
        """Requests in flight and recent TTFTs (the shared autoscaler's Serve shell polls this)."""
        return self.service.load(window_s)

    def __serve_build_asgi_app__(self):
        from rayfleet.serving.openai_api.app import build_openai_app

        return build_openai_app(self.service, model_name=self.model_name)


def replica_options(pool: PoolSpec) -> dict[str, Any]:
    """``Deployment.options`` for one engine replica of ``pool`` (see module doc)."""
    actor: dict[str, Any] = {"num_cpus": pool.num_cpus}
    if pool.accelerators_per_replica >= 1:
        actor["num_gpus"] = 1  # the replica process drives (at least) the first accelerator
    if pool.accelerator_type:
        actor["label_selector"] = {L.RAY_ACCELERATOR_TYPE: pool.accelerator_type}
    options: dict[str, Any] = {"num_replicas": 1, "ray_actor_options": actor,
                               "health_check_period_s": 2, "health_check_timeout_s": 10,
                               "max_ongoing_requests": 1000, "graceful_shutdown_timeout_s": 2}
    if pool.accelerators_per_replica > 1:
        # Bundle 0 hosts the replica actor (its GPU and CPU share); the rest are its TP peers.
        first = {"GPU": 1.0, **({"CPU": pool.num_cpus} if pool.num_cpus else {})}
        options["placement_group_bundles"] = [first] + [{"GPU": 1.0}] * (pool.accelerators_per_replica - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
        if actor.pop("label_selector", None):
            options["placement_group_bundle_label_selector"] = [
                {L.RAY_ACCELERATOR_TYPE: pool.accelerator_type}] * pool.accelerators_per_replica
    return options


def _engine(spec: ServeSpec, role: str, name: str, *, node: str | None = None):
    """One bound engine replica deployment of ``role``; ``node`` pins it (rayfleet node label)."""
    config = spec.engine_config()
    model = {"preset": spec.model.preset if not spec.model.checkpoint else None, "seed": spec.model.seed,
             "checkpoint": spec.model.checkpoint, "dtype": spec.model.dtype, "overrides": dict(spec.model.overrides)}
    options = replica_options(spec.pools()[role])
    if node is not None:
        actor = options["ray_actor_options"]
        actor["label_selector"] = {**actor.get("label_selector", {}), L.NODE: node}
        if "placement_group_bundles" in options:
            actor.pop("label_selector")
            selectors = options.get("placement_group_bundle_label_selector") or [{}] * len(options["placement_group_bundles"])
            options["placement_group_bundle_label_selector"] = [{**s, L.NODE: node} for s in selectors]
    return serve.deployment(EngineReplica).options(name=name, **options).bind(
        name=name, model=model, config=config, transport=spec.kv_transfer.transport, lease_s=spec.kv_transfer.lease_s,
        expert_balancing=spec.expert_balancing.config())


def engine_application(spec: ServeSpec, role: str, name: str, *, node: str | None = None):
    """A one-replica engine app for the shared autoscaler (see module doc); run it with
    ``serve.run(app, name=..., route_prefix=None)`` and tell the router with ``add_replica``."""
    return _engine(spec, role, name, node=node)


def build_app(spec: ServeSpec):
    """The Serve application for ``spec``: engine replicas, router, ingress (not yet running)."""
    config = spec.engine_config()
    handles = {name: _engine(spec, role, name) for role, names in spec.replica_names().items() for name in names}
    small = {"num_cpus": 0}
    router = serve.deployment(RouterDeployment).options(
        name="router", num_replicas=1, ray_actor_options=small, max_ongoing_requests=10000,
        health_check_period_s=2).bind(
        handles, roles=spec.replica_names(), mode=spec.router.policy, load_weight=spec.router.load_weight,
        block_size=config.block_size, model_id=config.model_id, num_blocks=config.num_blocks,
        poll_interval_s=spec.router.poll_interval_s, idle_poll_interval_s=spec.router.idle_poll_interval_s,
        long_prefill=spec.long_prefill_policy())
    ingress = serve.deployment(OpenAIIngress).options(
        name="ingress", num_replicas=1, ray_actor_options=small, max_ongoing_requests=10000).bind(
        router, handles, model_name=spec.model.served_name, mode=spec.mode, max_resumes=spec.max_resumes,
        max_prefill_retries=spec.max_prefill_retries, request_timeout_s=spec.request_timeout_s)
    return ingress


def app_builder(args: dict[str, Any]):
    """Serve application builder (``import_path: rayfleet.serving.deploy.deployments:app_builder``):
    ``args`` is a ``ServeSpec`` as a dict. Lets ``serve run``/``serve deploy`` deploy a spec."""
    return build_app(ServeSpec.parse(dict(args)))


def serve_config(spec: ServeSpec) -> dict[str, Any]:
    """A Serve config file (``serve deploy``/``serve run``) equivalent to ``api.deploy(spec)``."""
    return {"proxy_location": "HeadOnly",
            "http_options": {"host": spec.http.host, "port": spec.http.port},
            "applications": [{"name": spec.name, "route_prefix": spec.http.route_prefix,
                              "import_path": "rayfleet.serving.deploy.deployments:app_builder",
                              "args": spec.model_dump(mode="json")}]}
