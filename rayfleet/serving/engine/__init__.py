"""The engine room: one replica's engine core, in vLLM v1's layers, with no Ray.

``block_hash`` (typed, chained block hashes) -> ``block_pool`` (KV blocks, LRU prefix cache) ->
``kv_cache_manager`` (per-request block tables) -> ``scheduler`` (continuous batching) ->
``model_runner`` (one paged forward) -> ``llm_engine`` (``LLMEngine``, the facade) ->
``async_engine`` (``AsyncEngine``, the asyncio body of every engine replica). ``request``,
``sampling`` and ``stop_checker`` hold request state, the sampler and stop conditions;
``engine_config`` the limits, ``loading`` the model loading.

The bottom of the serving ladder (above ``errors`` and ``experts`` only): what the engine
publishes lives here (``replica_state``: snapshots the router reads; ``replica_output``: the
``GenerationChunk`` stream and ``PrefillReply``), and so do the protocols it needs from outside
(``kv_connector``: KV tiers and the prefill -> decode transport, implemented in ``kv``).
"""
