"""``GenerationService``: what the OpenAI app needs of the serving stack below it.

Design decisions:
- The app owns this small protocol and the request path (``deploy.inference_service``)
  satisfies it without importing it, so ``app`` and ``generation`` never import ``deploy``:
  whoever builds the app passes the real service in (the Serve ingress, ``serve_app``; the
  in-process stack, ``in_process``; a unit test's fake).
- The stream is the engine's own chunk type (``engine.replica_output.GenerationChunk``), frozen
  and unchanged from the replica; the app turns its tokens into text only at the end
  (``generation``, ``text_stream``) and its text into SSE in ``responses``.
- Errors the app maps to HTTP statuses are ``serving.errors`` types, below every room.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from rayfleet.serving.engine.replica_output import GenerationChunk
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaState
from rayfleet.serving.engine.sampling import SamplingParams

__all__ = ["GenerationService"]


class GenerationService(Protocol):
    """One served model's generation, as the OpenAI app calls it (``InferenceService``)."""

    def stream(self, prompt: list[int], params: SamplingParams, *, cache_salt: str | None = None,
               request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        """The chunks of one request; the last has ``finish_reason``. Closing it aborts the request."""
        ...

    async def tokenizer(self) -> Any:
        """The served model's tokenizer (``ByteTokenizer`` or ``HFTokenizer``)."""
        ...

    async def max_model_len(self) -> int:
        """The context length, in tokens, of the served model's engines."""
        ...

    async def replica_states(self) -> Mapping[str, ReplicaState]:
        """Each replica's last published state (``/health``)."""
        ...

    async def metrics_text(self) -> bytes:
        """``/metrics`` as Prometheus text."""
        ...

    async def block_usage(self) -> Mapping[str, BlockUsage | None]:
        """Each replica's KV block usage (``/v1/block_usage``); None for a replica that did not answer."""
        ...
