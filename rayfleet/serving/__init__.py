"""rayfleet.serving: the inference side of the fleet.

This package's foundation is the engine core, in vLLM v1's layers (each module opens with its
design decisions):

- ``block_hash``: typed, chained hashes of full KV blocks (the prefix-reuse key everywhere);
- ``block_pool`` -> ``kv_cache_manager``: KV blocks with LRU prefix caching, per-request tables;
- ``request``, ``sampling``, ``stop_checker``: request state, sampling, stop conditions;
- ``scheduler``: continuous batching (decode first, chunked prefill, preemption by recompute);
- ``model_runner`` + ``engine``: ``LLMEngine`` runs ``rayfleet.models`` through its paged forward;
- ``prefix_index`` + ``router_policy``: pure prefix-aware routing for prefill/decode replicas.

None of these import Ray: Serve deployments (next layer) wrap them.

The serving layer on top (import these modules directly; only ``deployments`` and ``api`` need
Ray Serve at import or call time):

- ``spec``: ``ServeSpec`` (pydantic), what ``rayfleet serve serve.yaml`` / ``fleet.serve`` deploy;
- ``kv_transfer``: KV handoff interface, leases, Ray object store and in-process transports;
- ``engine_loop``: ``AsyncEngine``, the asyncio runtime of one engine replica (any role);
- ``replica_client``, ``router``, ``service``: how requests reach replicas, routing, retries;
- ``openai_app`` + ``metrics``: the OpenAI-compatible FastAPI app and Prometheus metrics;
- ``deployments`` + ``api`` + ``cli``: the Serve application, ``deploy(spec)``, ``rayfleet serve``;
- ``local``: the same stack in one process without Ray (tests, policy benchmarks).
"""

from rayfleet.serving.block_hash import BlockHash, hash_block, hash_full_blocks, root_block_hash
from rayfleet.serving.block_pool import BlockId, BlockPool, KVCacheEvent
from rayfleet.serving.engine import EngineConfig, EngineStats, GenerationResult, LLMEngine
from rayfleet.serving.kv_cache_manager import KVCacheManager, KVCacheStats
from rayfleet.serving.prefix_index import PrefixIndex, ReplicaId
from rayfleet.serving.request import FinishReason, RequestId, RequestOutput
from rayfleet.serving.router_policy import ReplicaScore, ReplicaSnapshot, RouteDecision, RouterPolicy
from rayfleet.serving.sampling import SamplingParams
from rayfleet.serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "BlockHash", "hash_block", "hash_full_blocks", "root_block_hash",
    "BlockId", "BlockPool", "KVCacheEvent",
    "EngineConfig", "EngineStats", "GenerationResult", "LLMEngine",
    "KVCacheManager", "KVCacheStats",
    "PrefixIndex", "ReplicaId",
    "FinishReason", "RequestId", "RequestOutput",
    "ReplicaScore", "ReplicaSnapshot", "RouteDecision", "RouterPolicy",
    "SamplingParams",
    "Scheduler", "SchedulerConfig", "SchedulerOutput",
]
