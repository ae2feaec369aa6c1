"""A Serve LLM request's prompt token ids, as vLLM's OpenAI server tokenizes them.

With KV events on (``kv_event_feed``), a vLLM pool's replicas publish the rayfleet token-block
hashes of what their engines cached; the router (in the ingress, before the engine tokenizes)
must hash a new prompt's token ids the same way to look them up. This module turns a request
into those ids with the model's own tokenizer (``transformers.AutoTokenizer`` on the pool's
model source, the files vLLM loads):

- completions: ``tokenizer.encode(prompt)`` with special tokens (vLLM's default
  ``add_special_tokens=True``); a prompt given as token ids is used as is;
- chat: the chat template rendered as text (``add_generation_prompt=True``, the request's
  ``chat_template_kwargs``), then encoded without special tokens, as vLLM's chat path does.

Only the leading full blocks matter for a prefix lookup, so a difference in the last tokens
(a template detail) costs at most the last block's hit. Rejected: Ray's KV-aware router's
prompt-token channel (a ZMQ socket per replica carrying tokens back from the engine): it learns
the ids only after the request was routed.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["PromptTokenizer", "chat_messages"]

logger = logging.getLogger(__name__)


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages (dicts or pydantic objects, string or text-part content) as the
    plain ``{"role", "content"}`` dicts a chat template takes."""
    out = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", "")
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
        if isinstance(content, list):
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", ""))
                              for p in content)
        out.append({"role": str(role), "content": content or ""})
    return out


class PromptTokenizer:
    """Token ids of requests (module doc); ``tokenizer`` is anything with ``encode`` and
    ``apply_chat_template`` (a Hugging Face tokenizer). ``from_source`` loads one."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_source(cls, source: str) -> "PromptTokenizer | None":
        """The tokenizer of ``source`` (a directory or hub id), or None (logged) when it cannot load."""
        try:
            from transformers import AutoTokenizer

            return cls(AutoTokenizer.from_pretrained(source))
        except Exception:  # noqa: BLE001 - any failure leaves the router on text blocks
            logger.warning("cannot load the tokenizer of %r: routing on text blocks", source, exc_info=True)
            return None

    def token_ids(self, request: Any) -> list[int] | None:
        """The prompt's token ids, or None when the request has no prompt (embeddings, ...)."""
        prompt = getattr(request, "prompt", None)
        if prompt is not None:
            if isinstance(prompt, list):
                if prompt and all(isinstance(t, int) for t in prompt):
                    return list(prompt)  # already token ids
                prompt = prompt[0] if prompt else ""
                if isinstance(prompt, list):
                    return [int(t) for t in prompt]
            return list(self.tokenizer.encode(str(prompt)))
        messages = getattr(request, "messages", None)
        if messages is None:
            return None
        kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
        text = self.tokenizer.apply_chat_template(chat_messages(messages), tokenize=False,
                                                  add_generation_prompt=True, **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
