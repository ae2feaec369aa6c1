"""A prompt's block hashes, computed once per request at the ingress and reused by every
routing call of that request (prefill and decode pools, split-prefill planning, retries).

Design decisions:
- Hashing is the costly part of routing a long prompt (BLAKE2b over every full block: ~10 ms
  for a 32k-token prompt), and lookup + scoring must stay under a millisecond; so the decision
  never hashes. The ingress asks this cache, which hashes a prompt the first time it is seen and
  answers repeats from memory; a caller resuming a request (its prompt plus the tokens generated
  so far) may pass the original prompt's hashes (``known``), so only the new blocks are hashed.
- Keyed by ``(cache_salt, prompt tuple)``: equal keys are equal prompts, never a collision.
  Bounded (``max_entries``, least recently used out): entries live for a request's routing calls,
  a few milliseconds to seconds, so a few hundred suffice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import BlockHash, hash_full_blocks, root_block_hash

__all__ = ["PromptHashCache"]


class PromptHashCache:
    """Full-block hashes of recent prompts (module doc). Mutable, plain class."""

    def __init__(self, *, block_size: int, model_id: str, max_entries: int = 256) -> None:
        if block_size < 1 or max_entries < 1:
            raise SpecError("block_size/max_entries", (block_size, max_entries), "must be positive",
                            "pass the engine's block size and e.g. 256 entries")
        self.block_size = block_size
        self.model_id = model_id
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str | None, tuple[int, ...]], tuple[BlockHash, ...]] = OrderedDict()
        self.num_hashed_blocks = 0  # blocks hashed so far (tests, metrics): repeats add none

    def hashes(self, prompt: Sequence[int], cache_salt: str | None = None,
               known: Sequence[BlockHash] = ()) -> tuple[BlockHash, ...]:
        """The prompt's full-block hashes. ``known``: hashes of an earlier prompt this one
        extends (a resumed request's original prompt), reused instead of rehashed. Mutates the
        cache; raises ``SpecError`` when ``known`` claims more blocks than the prompt has."""
        key = (cache_salt, tuple(prompt))
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        out = tuple(hash_full_blocks(key[1], block_size=self.block_size,
                                     root=root_block_hash(model_id=self.model_id, cache_salt=cache_salt),
                                     known=known))
        self.num_hashed_blocks += len(out) - len(known)
        self._entries[key] = out
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return out
