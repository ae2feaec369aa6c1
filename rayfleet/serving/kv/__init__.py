"""The KV room: moving and keeping KV blocks outside one engine's pool.

``transfer`` hands a prefilled request's blocks from a prefill to a decode replica;
``host_pool`` and ``tiers`` are a node's host-memory and disk tiers below the engine pool;
``global_index`` says which block hash lives where; ``tier_policy`` (pure) decides what to load
and prefetch; ``tier_connector`` joins an engine's pool to the tiers; ``tier_actors`` are their
Ray shells (one host-pool actor per node, one index actor per fleet). ``transfer`` and
``tier_connector`` implement the engine's protocols (``engine.kv_connector``); the engine never
imports this room.
"""
