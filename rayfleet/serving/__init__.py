"""rayfleet.serving: the inference side of the fleet, in rooms on a one-way ladder: a room
imports only its own room and lower ones (``tests/unit/test_layering.py``, rule 7). Bottom to
top (each module opens with its design decisions):

- ``errors``, ``api_keys`` and ``experts/`` (expert-parallel load balancing, EPLB): below every room;
- ``engine/``: the engine core of one replica (block hashes, block pool, KV manager, scheduler,
  model runner, ``LLMEngine``, ``AsyncEngine``), what it publishes (snapshots, the chunk stream)
  and the KV connector protocols it needs; no Ray;
- ``kv/`` (KV handoff between prefill and decode, host-memory and disk tiers, the global KV
  index) and ``routing/`` (prefix index, routing policy, the router, long-prompt split prefill);
- ``spec`` (``ServeSpec``);
- ``deploy/``: engine replicas on Serve, the request path (``InferenceService``), metrics,
  Serve autoscaling bounds;
- ``openai_api/`` (the OpenAI-compatible app, its Serve ingress, the in-process stack) and
  ``vllm/`` (the same API through Ray Serve LLM);
- ``deployer`` (``deploy(spec)``) and ``serve_scaling_shell`` (the shared autoscaler's Serve shell).

Only ``deploy`` and the rooms above it need Ray Serve; the names below are the engine core's
public face, imported on first use.
"""

# Loaded on first use (PEP 562): `rayfleet serve --help` and the CLI must not pay for torch.
_NAME_TO_MODULE = {
    "BlockHash": "rayfleet.serving.engine.block_hash",
    "hash_block": "rayfleet.serving.engine.block_hash",
    "hash_full_blocks": "rayfleet.serving.engine.block_hash",
    "root_block_hash": "rayfleet.serving.engine.block_hash",
    "BlockId": "rayfleet.serving.engine.block_pool",
    "BlockPool": "rayfleet.serving.engine.block_pool",
    "KVCacheEvent": "rayfleet.serving.engine.block_pool",
    "BlockStored": "rayfleet.serving.engine.kv_events",
    "BlockRemoved": "rayfleet.serving.engine.kv_events",
    "AllBlocksCleared": "rayfleet.serving.engine.kv_events",
    "EngineConfig": "rayfleet.serving.engine.engine_config",
    "EngineStats": "rayfleet.serving.engine.llm_engine",
    "GenerationResult": "rayfleet.serving.engine.llm_engine",
    "LLMEngine": "rayfleet.serving.engine.llm_engine",
    "KVCacheManager": "rayfleet.serving.engine.kv_cache_manager",
    "KVCacheStats": "rayfleet.serving.engine.kv_cache_manager",
    "PrefixIndex": "rayfleet.serving.routing.prefix_index",
    "ReplicaId": "rayfleet.serving.engine.replica_state",
    "FinishReason": "rayfleet.serving.engine.request",
    "RequestId": "rayfleet.serving.engine.request",
    "RequestOutput": "rayfleet.serving.engine.request",
    "ReplicaScore": "rayfleet.serving.routing.policy",
    "ReplicaSnapshot": "rayfleet.serving.engine.replica_state",
    "RouteDecision": "rayfleet.serving.routing.policy",
    "RouterPolicy": "rayfleet.serving.routing.policy",
    "TTFTPolicy": "rayfleet.serving.routing.ttft_cost",
    "SamplingParams": "rayfleet.serving.engine.sampling",
    "Scheduler": "rayfleet.serving.engine.scheduler",
    "SchedulerConfig": "rayfleet.serving.engine.scheduler",
    "SchedulerOutput": "rayfleet.serving.engine.scheduler",
}


def __getattr__(name: str):
    module = _NAME_TO_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'rayfleet.serving' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BlockHash", "hash_block", "hash_full_blocks", "root_block_hash",
    "BlockId", "BlockPool", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    "EngineConfig", "EngineStats", "GenerationResult", "LLMEngine",
    "KVCacheManager", "KVCacheStats",
    "PrefixIndex", "ReplicaId",
    "FinishReason", "RequestId", "RequestOutput",
    "ReplicaScore", "ReplicaSnapshot", "RouteDecision", "RouterPolicy", "TTFTPolicy",
    "SamplingParams",
    "Scheduler", "SchedulerConfig", "SchedulerOutput",
]
