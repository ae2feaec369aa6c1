"""Chained block hashes: equal prefixes give equal hashes; salt, model and order change them."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import hash_block, hash_full_blocks, root_block_hash

ROOT = root_block_hash(model_id="tiny")


def test_same_prefix_same_hashes_and_only_full_blocks():
    a = hash_full_blocks(list(range(10)), block_size=4, root=ROOT)
    b = hash_full_blocks(list(range(8)) + [99, 98, 97], block_size=4, root=ROOT)
    assert len(a) == 2 and len(b) == 2  # 10 and 11 tokens: two full blocks each
    assert a == b
    assert all(isinstance(h, bytes) and len(h) == 16 for h in a)


def test_hash_is_chained_on_the_parent():
    # Same second block after a different first block: the second hashes must differ.
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], block_size=4, root=ROOT)
    b = hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], block_size=4, root=ROOT)
    assert a[1] != b[1]
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_salt_and_model_isolate_caches():
    tokens = list(range(8))
    plain = hash_full_blocks(tokens, block_size=4, root=ROOT)
    salted = hash_full_blocks(tokens, block_size=4, root=root_block_hash(model_id="tiny", cache_salt="t1"))
    other_salt = hash_full_blocks(tokens, block_size=4, root=root_block_hash(model_id="tiny", cache_salt="t2"))
    other_model = hash_full_blocks(tokens, block_size=4, root=root_block_hash(model_id="small"))
    assert len({plain[0], salted[0], other_salt[0], other_model[0]}) == 4
    assert root_block_hash(cache_salt="") != root_block_hash(cache_salt=None)


def test_incremental_hashing_equals_hashing_at_once():
    tokens = list(range(13))
    known = hash_full_blocks(tokens[:6], block_size=4, root=ROOT)
    assert hash_full_blocks(tokens, block_size=4, root=ROOT, known=known) == \
        hash_full_blocks(tokens, block_size=4, root=ROOT)


def test_bad_arguments_are_spec_errors():
    with pytest.raises(SpecError, match="block_size"):
        hash_full_blocks([1], block_size=0, root=ROOT)
    with pytest.raises(SpecError, match="known"):
        hash_full_blocks([1, 2], block_size=2, root=ROOT, known=[ROOT, ROOT])
