"""Prompt text blocks: the prefix identity rayfleet's router uses for a vLLM pool. Pure.

rayfleet's ``PoolRouterCore`` ranks replicas by how many of a prompt's leading blocks each holds,
where a block is anything whose hash is equal exactly when the prefix is. For the built-in engine
those are token blocks. In a Serve LLM pool the router runs in the ingress, before any
tokenization (Serve LLM tokenizes inside the engine), so both sides use *text* blocks instead:
the prompt text cut into ``block_chars`` characters, hashes chained (``h_i = H(h_{i-1}, chunk_i)``,
so a block's hash names its whole prefix). The replica publishes the hashes of the prompts it
served (``ServedBlocks``, LRU, capped at its KV capacity), the router computes the same hashes
for a new request; equal text prefixes give equal hashes on both sides.

Text blocks are now the fallback: a pool whose engines publish KV events routes on exact token
blocks instead (``kv_event_feed``: vLLM's events rehashed from their token ids, which the router
computes from the prompt with the model's tokenizer, ``prompt_tokens``). vLLM's own hashes are
unusable by a router (salted per engine process: its ``NONE_HASH`` is random unless
``PYTHONHASHSEED`` is set). Text blocks approximate the engine's cache (an evicted block may still
be listed until the LRU cap pushes it out), which is what Serve LLM's ``PrefixCacheAffinityRouter``
approximates too, but per replica and shared by every ingress replica through routing stats.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Iterable

__all__ = ["DEFAULT_CHARS_PER_TOKEN", "request_text", "text_block_hashes", "ServedBlocks"]

DEFAULT_CHARS_PER_TOKEN = 4  # English BPE averages about 4 characters per token


def request_text(request: Any) -> str | None:
    """The prompt text of a Serve LLM request (``CompletionRequest.prompt`` or
    ``ChatCompletionRequest.messages``), or ``None`` when it has neither (embeddings, ...)."""
    prompt = getattr(request, "prompt", None)
    if prompt is not None:
        if isinstance(prompt, list):  # a batch of prompts, or token ids: the first one routes
            prompt = prompt[0] if prompt else ""
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    messages = getattr(request, "messages", None)
    if messages is None:
        return None
    parts = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", "")
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", ""))
                              for p in content)
        parts.append(f"<{role}>{content or ''}")
    return "".join(parts)


def text_block_hashes(text: str, *, block_chars: int) -> tuple[int, ...]:
    """Chained hashes of the full ``block_chars``-character blocks of ``text`` (a partial last
    block has none: it is not reusable). 64-bit ints from BLAKE2b, stable across processes."""
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    data = text.encode("utf-8", errors="replace")
    out: list[int] = []
    parent = b"\0" * 8
    for start in range(0, len(data) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + data[start:start + block_chars], digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return tuple(out)


class ServedBlocks:
    """The text blocks one replica has served, least recently used first out past ``capacity``
    (the replica's KV capacity in blocks). Mutated by ``add``; not thread-safe (one replica's
    event loop owns it)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> frozenset[int]:
        return frozenset(self._blocks)
