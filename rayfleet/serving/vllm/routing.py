"""``VLLMPrefixLoadRequestRouter``: rayfleet's ``PrefixLoadRequestRouter`` for a Serve LLM pool.

Serve LLM's ingress calls the pool with the OpenAI request object and no ``RouteHint``; this
subclass derives the hint from the request itself and leaves every decision to the shared
``PoolRouterCore`` (prefix overlap weighed against load, with the router's own booking between
two stats publications). The hint's hashes are the ones the pool's replicas publish
(``server.RayfleetLLMServer``):

- with KV events (``token_blocks`` given: ``config`` sets it when the pool's engines publish
  them), rayfleet's token-block hashes of the prompt's token ids (``prompt_tokens``, then
  ``PromptHashCache``), which the replicas publish for exactly what vLLM cached;
- otherwise (or when the tokenizer cannot be loaded here) chained hashes of the prompt's text
  blocks (``text_blocks``), the estimate the replicas then publish.

With ``cost: prefix_load`` (the default is the TTFT cost, ``routing.ttft_cost``, which needs no
per-engine prices), two prices differ from the built-in engine's router, because vLLM batches a new prefill with
the running decodes at its next step (continuous batching, chunked prefill), and because what
its pools serve is conversations whose later turns are cached on one replica:

- ``decode_weight = 1 / block_size``: a new request waits for the prefill queued ahead of it
  (the server publishes the blocks of requests without a first chunk as queued) and shares each
  step with the running decodes, which cost about one token of a block_size-token block each.
  Priced as queued work (the default 1), one decoding request on a replica outweighed a
  conversation's private context of a few blocks and moved the turn to the other replica, which
  then prefilled the whole conversation again (in a replay of the multi-turn benchmark workload,
  7 of 96 requests went off their longest cached prefix, 5 of them later turns).
- ``marginal_overload_at_home``: a replica caching at least half of the prompt (the
  conversation's home) pays the overload term for the work this turn adds, not for the excess
  it already has. Priced on the whole excess, a replica holding a hot tenant (over the mean by
  about a sixth) sent a turn with 4 blocks cached there to a replica that had none. The
  long-run balance is still kept by new conversations, which go where the pool is under its mean.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ray.serve.request_router import PendingRequest

from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prompt_hashes import PromptHashCache
from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.vllm.prompt_tokens import PromptTokenizer
from rayfleet.serving.vllm.text_blocks import DEFAULT_CHARS_PER_TOKEN, request_text, text_block_hashes

__all__ = ["VLLMPrefixLoadRequestRouter"]


class VLLMPrefixLoadRequestRouter(PrefixLoadRequestRouter):
    """See module doc. ``block_chars``: characters per text block (block_size x 4);
    ``token_blocks``: ``{"tokenizer": model source, "model_id", "block_size"}`` when the
    replicas publish token blocks from KV events."""

    tokenizer: PromptTokenizer | None = None
    prompt_hashes: PromptHashCache | None = None

    def initialize_state(self, *, block_chars: int = 64, decode_weight: float | None = None,
                         marginal_overload_at_home: bool = True, token_blocks: dict[str, Any] | None = None,
                         **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.block_chars = block_chars
        if token_blocks:
            self.tokenizer = PromptTokenizer.from_source(token_blocks["tokenizer"])
            self.token_block_size = int(token_blocks["block_size"])
            self.prompt_hashes = PromptHashCache(block_size=self.token_block_size, model_id=token_blocks["model_id"])
        if not isinstance(self.core.policy, RouterPolicy):
            return  # the TTFT cost (the default) prices running decodes itself: no block prices to set
        if decode_weight is None:  # one token of a block_size-token block (module doc)
            decode_weight = DEFAULT_CHARS_PER_TOKEN / block_chars
        self.core.policy = replace(self.core.policy, decode_weight=decode_weight,
                                   marginal_overload_at_home=marginal_overload_at_home)

    def _hint(self, pending_request: PendingRequest | None) -> RouteHint | None:
        hint = super()._hint(pending_request)
        if hint is not None or pending_request is None:
            return hint
        for arg in pending_request.args or ():
            text = request_text(arg)
            if text is None:
                continue
            max_tokens = getattr(arg, "max_tokens", None) or getattr(arg, "max_completion_tokens", None) or 0
            tokens = self._token_hint(arg, int(max_tokens))
            if tokens is not None:
                return tokens
            hashes = text_block_hashes(text, block_chars=self.block_chars)
            output_blocks = -(-int(max_tokens) * DEFAULT_CHARS_PER_TOKEN // self.block_chars)
            return RouteHint(block_hashes=hashes, num_prompt_blocks=len(hashes) + 1,
                             num_blocks_needed=len(hashes) + 1 + output_blocks)
        return None

    def _token_hint(self, request: Any, max_tokens: int) -> RouteHint | None:
        """The hint in token blocks (module doc), or None to fall back to text blocks."""
        if self.tokenizer is None or self.prompt_hashes is None:
            return None
        try:
            ids = self.tokenizer.token_ids(request)
        except Exception:  # noqa: BLE001 - a template the tokenizer refuses: route on text blocks
            return None
        if ids is None:
            return None
        hashes = self.prompt_hashes.hashes(ids)
        bs = self.token_block_size
        num_prompt = -(-len(ids) // bs)
        return RouteHint(block_hashes=hashes, num_prompt_blocks=num_prompt,
                         num_blocks_needed=-(-(len(ids) + max_tokens) // bs))
