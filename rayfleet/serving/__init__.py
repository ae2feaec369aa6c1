"""rayfleet.serving: the inference side of the fleet, in rooms (each module opens with its
design decisions):

- ``engine/``: the engine core of one replica (block hashes, block pool, KV manager, scheduler,
  model runner, ``LLMEngine``, ``AsyncEngine``); no Ray;
- ``kv/``: KV handoff between prefill and decode, host-memory and disk tiers, the global KV index;
- ``routing/``: prefix index, routing policy, the router, long-prompt split prefill;
- ``experts/``: expert-parallel load balancing (EPLB) inside an engine replica;
- ``deploy/``: Serve deployments, ``deploy(spec)``, the request path, the in-process stack,
  the shared autoscaler's Serve shell;
- ``openai_api/``: the OpenAI-compatible FastAPI app and Prometheus metrics;
- ``spec`` (``ServeSpec``) and ``cli`` (``rayfleet serve``).

Only ``deploy`` needs Ray Serve; the names below are the engine core's public face.
"""

from rayfleet.serving.engine.block_hash import BlockHash, hash_block, hash_full_blocks, root_block_hash
from rayfleet.serving.engine.block_pool import BlockId, BlockPool, KVCacheEvent
from rayfleet.serving.engine.llm_engine import EngineConfig, EngineStats, GenerationResult, LLMEngine
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager, KVCacheStats
from rayfleet.serving.routing.prefix_index import PrefixIndex, ReplicaId
from rayfleet.serving.engine.request import FinishReason, RequestId, RequestOutput
from rayfleet.serving.routing.policy import ReplicaScore, ReplicaSnapshot, RouteDecision, RouterPolicy
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

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
