"""A prompt is hashed once per request at the ingress; the decision only looks hashes up."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.routing.prompt_hashes import PromptHashCache


def test_repeats_are_answered_from_memory_and_resumes_hash_only_new_blocks():
    cache = PromptHashCache(block_size=4, model_id="m", max_entries=2)
    prompt = list(range(10))
    first = cache.hashes(prompt, "tenant")
    assert first == tuple(hash_full_blocks(prompt, block_size=4, root=root_block_hash(model_id="m", cache_salt="tenant")))
    assert cache.num_hashed_blocks == 2
    assert cache.hashes(prompt, "tenant") is first and cache.num_hashed_blocks == 2  # the same request again
    assert cache.hashes(prompt, None) != first  # another salt is another chain
    resumed = cache.hashes(prompt + [50, 51, 52, 53, 54, 55], "tenant", known=first)
    assert resumed[:2] == first and len(resumed) == 4 and cache.num_hashed_blocks == 2 + 2 + 2
    cache.hashes([9, 9, 9, 9], None)  # bounded: the oldest entries leave
    assert len(cache._entries) == 2
    with pytest.raises(SpecError):
        PromptHashCache(block_size=0, model_id="m")
