"""The built-in engine's Serve application: the OpenAI ingress in front of the engine pools.

Design decisions:
- ``OpenAIIngress`` is the one place the OpenAI app meets the request path: it builds the
  ``InferenceService`` (``deploy``) over the pools' handles and serves ``app.build_openai_app``
  over it. ``app`` itself knows the service only as ``generation_service.GenerationService``,
  so it runs the same over the in-process stack (``in_process``) and in unit tests.
- It sits in ``openai_api``, above ``deploy``, as ``vllm.app`` does for Ray Serve LLM: each
  engine's application is built in the room of its HTTP face, and ``deploy`` only knows engine
  replicas and the request path.
- ``app_builder`` is Serve's import path (``serve run``/``serve deploy`` of a spec), which
  admits the pools through their queues first (``deploy.pool_admission.build_admitted``, the
  deployer's admission); ``serve_config`` writes the equivalent Serve config file.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from rayfleet.errors import SpecError
from rayfleet.serving.deploy.inference_service import InferenceService
from rayfleet.serving.deploy.pool_admission import build_admitted
from rayfleet.serving.deploy.pool_client import FailedReplicas, PoolClient, PoolRouter
from rayfleet.serving.deploy.serving_metrics import ServingMetrics
from rayfleet.serving.engine.replica_state import ReplicaState
from rayfleet.serving.openai_api.app import build_openai_app
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.spec import HttpSpec, ServeSpec

__all__ = ["OpenAIIngress", "build_app", "app_builder", "serve_config"]


@serve.ingress()
class OpenAIIngress:
    """HTTP entry point: the FastAPI app of ``openai_api.app`` over an ``InferenceService`` whose
    clients are the pool deployments' handles."""

    def __init__(self, pools: dict[str, Any], *, app_name: str, model_name: str, mode: str, max_resumes: int,
                 max_prefill_retries: int, request_timeout_s: float, block_size: int, model_id: str,
                 long_prefill: Any = None, http: dict[str, Any] | None = None) -> None:
        self.model_name = model_name
        self.http = http  # keys are read here, in the ingress process (``api_keys``)
        failed = FailedReplicas()
        clients = {role: PoolClient(role, h, block_size=block_size, model_id=model_id, failed=failed,
                                    app_name=app_name) for role, h in pools.items()}
        self.router = PoolRouter(clients, mode=mode, max_prefill_retries=max_prefill_retries,
                                 long_prefill=long_prefill, block_size=block_size)
        self.service = InferenceService(
            router=self.router, clients=clients, mode=mode, max_resumes=max_resumes,
            max_prefill_retries=max_prefill_retries, request_timeout_s=request_timeout_s,
            metrics=ServingMetrics(model_name, ray_metrics=True))
        self.router.service = self.service

    def load(self, window_s: float) -> dict:
        """Requests in flight and recent TTFTs (the shared autoscaler's Serve shell polls this)."""
        return self.service.load(window_s)

    async def replica_states(self) -> dict[str, ReplicaState]:
        """Every pool replica's last published state, keyed ``<pool>/<replica id>``."""
        return await self.router.replica_states()

    def set_routing_mode(self, mode: str) -> None:
        """Switch this ingress's request routers between ``prefix_aware`` and ``round_robin``
        live (operators, benchmarks); raises ``SpecError`` for another mode."""
        if mode not in ("prefix_aware", "round_robin"):
            raise SpecError("router.policy", mode, "unknown routing policy", "use prefix_aware or round_robin")
        for client in self.router.pools.values():
            router = client._router()
            if router is not None:
                router.core.mode = mode

    async def reset_prefix_caches(self) -> dict[str, bool]:
        """Empty every replica's prefix cache (pinned calls); True per replica that emptied it."""
        out = {}
        for role, client in self.router.pools.items():
            for replica in client.replica_ids():
                out[f"{role}/{replica}"] = await client.call("reset_prefix_cache", route=RouteHint(replica=replica))
        return out

    def __serve_build_asgi_app__(self) -> Any:
        http = HttpSpec.model_validate(self.http) if self.http is not None else None
        return build_openai_app(self.service, model_name=self.model_name, http=http)


def build_app(spec: ServeSpec) -> Any:
    """The Serve application for ``spec``: one deployment per pool and the ingress (not yet running)."""
    from rayfleet.serving.deploy.deployments import bind_pool  # the engine replicas: not the ingress's imports

    config = spec.engine_config()
    pools = {role: bind_pool(spec, role) for role in spec.pools()}
    return serve.deployment(OpenAIIngress).options(
        name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10000).bind(
        pools, app_name=spec.name, model_name=spec.model.served_name, mode=spec.mode, max_resumes=spec.max_resumes,
        max_prefill_retries=spec.max_prefill_retries, request_timeout_s=spec.request_timeout_s,
        block_size=config.block_size, model_id=config.model_id, long_prefill=spec.long_prefill_policy(),
        http=spec.http.model_dump(mode="json"))


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path: rayfleet.serving.openai_api.serve_app:app_builder``):
    ``args`` is a ``ServeSpec`` as a dict. Lets ``serve run``/``serve deploy`` deploy a spec, its
    pools admitted through their queues and bounded as ``deploy`` does (``build_admitted``)."""
    return build_admitted(ServeSpec.parse(dict(args)), build_app, deployment_name=lambda role: role)


def serve_config(spec: ServeSpec) -> dict[str, Any]:
    """A Serve config file (``serve deploy``/``serve run``) equivalent to ``api.deploy(spec)``."""
    return {"proxy_location": "HeadOnly",
            "http_options": {"host": spec.http.host, "port": spec.http.port},
            "applications": [{"name": spec.name, "route_prefix": spec.http.route_prefix,
                              "import_path": "rayfleet.serving.openai_api.serve_app:app_builder",
                              "args": spec.model_dump(mode="json")}]}
