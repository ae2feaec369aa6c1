"""``VLLMPrefixLoadRequestRouter``: rayfleet's ``PrefixLoadRequestRouter`` for a Serve LLM pool.

Serve LLM's ingress calls the pool with the OpenAI request object and no ``RouteHint``; this
subclass derives the hint from the request itself (``text_blocks``: chained hashes of the
prompt's text blocks, the same ones ``server.RayfleetLLMServer`` publishes) and leaves every
decision to the shared ``PoolRouterCore`` (prefix overlap weighed against load, with the
router's own booking between two stats publications).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest

from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.vllm.text_blocks import DEFAULT_CHARS_PER_TOKEN, request_text, text_block_hashes

__all__ = ["VLLMPrefixLoadRequestRouter"]


class VLLMPrefixLoadRequestRouter(PrefixLoadRequestRouter):
    """See module doc. ``block_chars``: characters per text block (block_size x 4)."""

    def initialize_state(self, *, block_chars: int = 64, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.block_chars = block_chars

    def _hint(self, pending_request: PendingRequest | None) -> RouteHint | None:
        hint = super()._hint(pending_request)
        if hint is not None or pending_request is None:
            return hint
        for arg in pending_request.args or ():
            text = request_text(arg)
            if text is None:
                continue
            hashes = text_block_hashes(text, block_chars=self.block_chars)
            max_tokens = getattr(arg, "max_tokens", None) or getattr(arg, "max_completion_tokens", None) or 0
            output_blocks = -(-int(max_tokens) * DEFAULT_CHARS_PER_TOKEN // self.block_chars)
            return RouteHint(block_hashes=hashes, num_prompt_blocks=len(hashes) + 1,
                             num_blocks_needed=len(hashes) + 1 + output_blocks)
        return None
