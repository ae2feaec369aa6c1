"""``RayfleetLLMServer``: Serve LLM's ``LLMServer`` that publishes rayfleet's routing stats.

A colocated vLLM pool routed by rayfleet's ``PrefixLoadRequestRouter`` (``vllm.request_router:
rayfleet``) runs this class (``LLMConfig.server_cls``). It changes nothing in how a request is
served; it only keeps what the router reads through Serve's ``record_routing_stats`` poll
(schema ``routing.router.ROUTING_STATS_KEYS``): the text blocks of the prompts it served
(``text_blocks.ServedBlocks``, capped at the engine's KV capacity) and its load (requests in
flight, the blocks they occupy: queued until their first chunk, active after). Serve LLM's own stats (its KV-events endpoint) are kept beside.

Exact cache state: when the pool's engine arguments carry ``kv_events_config`` (``config`` sets it
for rayfleet-routed colocated pools), the replica gives its engine a private ipc endpoint before
the engine starts and subscribes to it (``kv_event_subscriber``): what it publishes is then what
vLLM cached and evicted, in rayfleet's token-block hashes (``kv_event_feed``), through the same
bounded log the built-in engine's replicas publish (``routing.hash_log.HashLogPublisher``), with
``block_hash_kind: "tokens"`` and the subscriber's counters (``kv_events``). Without events (a
data-parallel pool, prefix caching off) it publishes the text-block estimate, ``block_hash_kind:
"text"``; the router hashes prompts the same way as its pool's replicas (``routing``).

Prefill/decode apps keep Serve LLM's PD server classes (its builder fixes them), hence
``config`` allows this router for colocated pools only.
"""

from __future__ import annotations

import time
from typing import Any, AsyncGenerator

from ray.serve.llm.deployment import LLMServer

from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.vllm.kv_event_subscriber import KV_EVENTS_TOPIC, KVEventSubscriber, private_ipc_endpoint
from rayfleet.serving.vllm.text_blocks import DEFAULT_CHARS_PER_TOKEN, ServedBlocks, request_text, text_block_hashes

__all__ = ["RayfleetLLMServer", "DEFAULT_KV_CAPACITY_BLOCKS"]

DEFAULT_KV_CAPACITY_BLOCKS = 4096  # when the engine does not say (its config is internal to vLLM)


class RayfleetLLMServer(LLMServer):
    """See module doc. State lives on the replica's event loop (no locks)."""

    _rf_served: ServedBlocks | None = None
    _rf_running = 0
    _rf_active_blocks = 0  # blocks of requests that have streamed their first chunk (decoding)
    _rf_queued_blocks = 0  # blocks of requests that have not yet (their prefill is ahead)
    _rf_version = 0
    _rf_events: KVEventSubscriber | None = None
    _rf_hash_log: HashLogPublisher | None = None

    async def start(self) -> None:
        self._rf_subscribe()
        await super().start()

    def _rf_subscribe(self) -> None:
        """Before the engine starts: a private endpoint for its KV events, and our subscriber."""
        config = self._llm_config
        events = dict(config.engine_kwargs.get("kv_events_config") or {})
        if not events.get("enable_kv_cache_events") or self._rf_events is not None:
            return
        endpoint = private_ipc_endpoint()
        events.update(publisher="zmq", endpoint=endpoint, topic=KV_EVENTS_TOPIC, replay_endpoint=None)
        config.update_engine_kwargs(kv_events_config=events)
        self._rf_events = KVEventSubscriber(endpoint, model_id=config.model_id,
                                            block_size=int(config.engine_kwargs.get("block_size", 16)))
        self._rf_hash_log = HashLogPublisher()

    def _rf_init(self) -> ServedBlocks:
        if self._rf_served is None:
            kwargs = self._llm_config.engine_kwargs
            self._rf_block_chars = int(kwargs.get("block_size", 16)) * DEFAULT_CHARS_PER_TOKEN
            self._rf_max_num_seqs = int(kwargs.get("max_num_seqs", 256))
            self._rf_capacity = self._kv_capacity_blocks() or DEFAULT_KV_CAPACITY_BLOCKS
            self._rf_served = ServedBlocks(self._rf_capacity)
        return self._rf_served

    def _kv_capacity_blocks(self) -> int | None:
        # vLLM's engine client knows its KV blocks once started; reach it defensively, since
        # the attribute path is Serve LLM's and vLLM's internals, not an API.
        client = getattr(getattr(self, "engine", None), "_engine_client", None)
        blocks = getattr(getattr(getattr(client, "vllm_config", None), "cache_config", None), "num_gpu_blocks", None)
        return int(blocks) if isinstance(blocks, int) and blocks > 0 else None

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        return self._rf_track(request, await super().chat(request, raw_request_info))

    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        return self._rf_track(request, await super().completions(request, raw_request_info))

    def _rf_track(self, request: Any, stream: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        served = self._rf_init()
        text = request_text(request) or ""
        if self._rf_events is not None:  # the engine's events say what is cached; count blocks only
            return self._rf_counted(stream, len(text.encode("utf-8", errors="replace")) // self._rf_block_chars + 1)
        hashes = text_block_hashes(text, block_chars=self._rf_block_chars)
        served.add(hashes)
        return self._rf_counted(stream, len(hashes) + 1)

    async def _rf_counted(self, stream: AsyncGenerator[Any, None], blocks: int) -> AsyncGenerator[Any, None]:
        # Until its first chunk a request's prompt is prefill work queued ahead of a new request;
        # after it, a decode that a new prefill shares steps with (the router prices the two
        # apart: ``RouterPolicy.decode_weight``).
        self._rf_running += 1
        self._rf_queued_blocks += blocks
        self._rf_version += 1
        decoding = False
        try:
            async for item in stream:
                if not decoding:
                    decoding = True
                    self._rf_queued_blocks -= blocks
                    self._rf_active_blocks += blocks
                    self._rf_version += 1
                yield item
        finally:
            self._rf_running -= 1
            if decoding:
                self._rf_active_blocks -= blocks
            else:
                self._rf_queued_blocks -= blocks
            self._rf_version += 1

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats() or {})
        served = self._rf_init()
        capacity = self._rf_capacity
        active = min(self._rf_active_blocks, capacity)
        queued = min(self._rf_queued_blocks, capacity - active)
        stats.update({"num_total_blocks": capacity,
                      "num_free_blocks": capacity - active - queued, "num_active_blocks": active,
                      "num_queued_blocks": queued,
                      "num_running_requests": self._rf_running, "max_num_seqs": self._rf_max_num_seqs,
                      "taken_at": time.time()})
        if self._rf_events is None or self._rf_hash_log is None:
            stats.update({"version": (self._rf_version, len(served)), "block_hash_kind": "text",
                          "block_hashes": served.hashes()})
            return stats
        log, sub = self._rf_hash_log, self._rf_events
        log.apply(sub.drain())
        stats.update(log.fields(time.monotonic()))
        stats.update({"version": (self._rf_version, log.epoch, log.seq, "block_hashes" in stats),
                      "block_hash_kind": "tokens",
                      "kv_events": {"batches": sub.num_batches, "events": sub.num_events, "gaps": sub.num_gaps,
                                    "errors": sub.num_errors, "cached_blocks": len(log.cached)}})
        return stats
