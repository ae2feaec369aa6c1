"""Typed, chained hashes of full KV blocks: the key of prefix reuse everywhere in serving.

Design decisions:
- A block's hash is ``H(parent_hash, block_token_ids)``, so equal hashes mean equal *prefixes*,
  not just equal blocks: the engine's prefix cache, the router's index and (later) the KV tiers
  and the global index all share one key and never compare token lists (vLLM v1's scheme).
- The chain starts from a root hash ``H(model_id, cache_salt)``: blocks of different models, or
  of tenants that asked for isolation with a ``cache_salt``, can never be confused, and the
  extras are paid for once per request instead of once per block.
- Only full blocks are hashed. A partial block is still being written, so it can be neither
  shared nor moved; it gets a hash the step it fills up.
- BLAKE2b-128 over a fixed binary encoding, not Python's ``hash()``: ``hash()`` of strings is
  salted per process, and these hashes cross processes (router, replicas, KV tiers). 128 bits
  keep the collision odds negligible at any fleet size; BLAKE2b is the fastest hashlib digest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

from rayfleet.errors import SpecError

__all__ = ["BlockHash", "root_block_hash", "hash_block", "hash_full_blocks"]

BlockHash = NewType("BlockHash", bytes)
"""16-byte digest of a full block and, through its parent, of everything before it."""

_DIGEST_SIZE = 16


def root_block_hash(*, model_id: str = "", cache_salt: str | None = None) -> BlockHash:
    """The parent of a sequence's first block: one per (model, salt). Pure; never raises."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    data = b"rayfleet-kv/1\x00" + model_id.encode("utf-8") + b"\x00" + salt
    return BlockHash(hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """``H(parent, token_ids)`` for one full block. Pure; never raises for int tokens."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


def hash_full_blocks(token_ids: Sequence[int], *, block_size: int, root: BlockHash,
                     known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, reusing the ``known`` leading hashes.

    ``known`` are hashes already computed for this sequence (a request extends its list as it
    generates); only blocks after them are hashed. Returns a new list; mutates nothing.
    Raises ``SpecError`` if ``block_size`` is not positive or ``known`` claims more blocks than
    ``token_ids`` fills.
    """
    if block_size <= 0:
        raise SpecError("block_size", block_size, "must be positive", "pass block_size >= 1")
    num_full = len(token_ids) // block_size
    if len(known) > num_full:
        raise SpecError("known", len(known), f"more hashes than the {num_full} full blocks",
                        "pass the hashes previously computed for these same tokens")
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
