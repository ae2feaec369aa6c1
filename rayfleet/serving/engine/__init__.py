"""The engine room: one replica's engine core, in vLLM v1's layers, with no Ray.

``block_hash`` (typed, chained block hashes) -> ``block_pool`` (KV blocks, LRU prefix cache) ->
``kv_cache_manager`` (per-request block tables) -> ``scheduler`` (continuous batching) ->
``model_runner`` (one paged forward) -> ``llm_engine`` (``LLMEngine``, the facade) ->
``async_engine`` (``AsyncEngine``, the asyncio body of every engine replica). ``request``,
``sampling`` and ``stop_checker`` hold request state, the sampler and stop conditions.
"""
