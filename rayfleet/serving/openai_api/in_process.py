"""A whole served model in this process, without Ray: engines, router, service, OpenAI app.

Design decisions:
- The same classes the Serve deployments wrap (``AsyncEngine``, ``Router``, ``InferenceService``,
  ``build_openai_app``), connected by ``LocalReplicaClient`` and a ``LocalTransport`` instead of
  Serve handles and the object store. The in-process twin of ``serve_app``, in the same room
  for the same reason: it wires the request path (``deploy``) into the OpenAI app. Unit tests and the router/prefix-cache parts of the
  benchmark run on it; Serve adds processes and placement, not different logic.
- Engines share one process and its two cores: throughput figures from here compare policies,
  not hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.experts.balancer import ExpertLoadBalancer
from rayfleet.serving.kv.transfer import LocalTransport
from rayfleet.serving.deploy.inference_service import InferenceService
from rayfleet.serving.deploy.replica_client import LocalReplicaClient
from rayfleet.serving.deploy.serving_metrics import ServingMetrics
from rayfleet.serving.openai_api.app import build_openai_app
from rayfleet.serving.routing.ttft_cost import prefill_policy
from rayfleet.serving.routing.router import Router, RouterCore
from rayfleet.serving.spec import ServeSpec

__all__ = ["LocalServing", "build_local"]


@dataclass
class LocalServing:
    spec: ServeSpec
    engines: dict[str, AsyncEngine]
    clients: dict[str, LocalReplicaClient]
    router: Router
    service: InferenceService

    def app(self) -> Any:
        return build_openai_app(self.service, model_name=self.spec.model.served_name, http=self.spec.http)

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        if self.router._task is not None:
            self.router._task.cancel()


def build_local(spec: ServeSpec | dict) -> LocalServing:
    """Build every replica of ``spec`` in this process (models load now; call inside or outside
    an event loop; the loops start on first use)."""
    spec = ServeSpec.parse(spec)
    config = spec.engine_config()
    m = spec.model
    engines = {}
    # One process is one node: its replicas share one host/disk tier, as on a fleet node.
    node_tiers = None
    if spec.kv_cache.enabled:
        from rayfleet.serving.kv.tiers import NodeKVTiers

        disk = spec.kv_cache.disk
        node_tiers = NodeKVTiers("local", host_blocks=spec.kv_cache.host_blocks,
                                 disk_uri=disk.uri if disk else None, disk_blocks=disk.blocks if disk else 0)
    for names in spec.replica_names().values():
        for name in names:
            kv_tiers = None
            if node_tiers is not None:
                from rayfleet.serving.kv.tier_connector import KVTierConnector
                from rayfleet.serving.kv.tier_policy import KVTierPolicy

                kv_tiers = KVTierConnector(node_tiers, policy=KVTierPolicy(prefetch_window=spec.kv_cache.prefetch_window))
            engine = load_engine(preset_name=m.preset, seed=m.seed, checkpoint=m.checkpoint, dtype=m.dtype,
                                 overrides=m.overrides, config=config, kv_tiers=kv_tiers, hf=m.hf)
            balancing = spec.expert_balancing.config()
            balancer = ExpertLoadBalancer(engine.model, balancing) if balancing is not None else None
            engines[name] = AsyncEngine(engine, name=name,
                                        transport=LocalTransport(owner=name, lease_s=spec.kv_transfer.lease_s),
                                        after_step=balancer.after_step if balancer is not None else None)
    clients = {n: LocalReplicaClient(e) for n, e in engines.items()}
    cost = (prefill_policy("prefix_load", load_weight=spec.router.load_weight) if spec.router.cost == "prefix_load"
            else prefill_policy("predicted_ttft", step_token_budget=max(2, config.max_num_batched_tokens)))
    core = RouterCore(roles=spec.replica_names(), policy=cost,
                      mode=spec.router.policy, block_size=config.block_size, model_id=config.model_id,
                      num_blocks_hint=config.num_blocks, long_prefill=spec.long_prefill_policy())
    router = Router(clients, core, poll_interval_s=spec.router.poll_interval_s,
                    idle_poll_interval_s=spec.router.idle_poll_interval_s)
    service = InferenceService(router=router, clients=clients, mode=spec.mode, max_resumes=spec.max_resumes,
                               max_prefill_retries=spec.max_prefill_retries,
                               request_timeout_s=spec.request_timeout_s,
                               metrics=ServingMetrics(m.served_name))
    return LocalServing(spec=spec, engines=engines, clients=clients, router=router, service=service)
