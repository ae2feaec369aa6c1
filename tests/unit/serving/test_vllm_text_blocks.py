"""Text blocks: the prefix identity shared by rayfleet's router and the vLLM replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rayfleet.serving.vllm.text_blocks import ServedBlocks, request_text, text_block_hashes


def test_hashes_are_chained_full_blocks_and_stable():
    a = text_block_hashes("abcdefgh" * 4, block_chars=8)
    assert len(a) == 4 and len(set(a)) == 4  # equal chunks, different prefixes -> different hashes
    assert text_block_hashes("abcdefgh" * 4 + "xyz", block_chars=8) == a  # partial block: no hash
    assert text_block_hashes("abcdefgh" * 4, block_chars=8) == a  # deterministic (no process salt)
    b = text_block_hashes("abcdefgX" + "abcdefgh" * 3, block_chars=8)
    assert not set(a) & set(b)  # a different first block changes every later hash
    c = text_block_hashes("abcdefgh" * 2 + "ZZZZZZZZ" * 2, block_chars=8)
    assert c[:2] == a[:2] and c[2:] != a[2:]  # the shared prefix keeps its hashes
    with pytest.raises(ValueError):
        text_block_hashes("x", block_chars=0)


def test_request_text_of_completions_and_chat():
    assert request_text(SimpleNamespace(prompt="hello")) == "hello"
    assert request_text(SimpleNamespace(prompt=["first", "second"])) == "first"
    chat = SimpleNamespace(prompt=None, messages=[{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert request_text(chat) == "<system>be brief<user>hi"
    assert request_text(SimpleNamespace(input="embed me")) is None


def test_served_blocks_evict_least_recently_used():
    served = ServedBlocks(capacity=3)
    served.add([1, 2, 3])
    served.add([1])  # touched: now the most recent
    served.add([4])
    assert served.hashes() == frozenset({1, 3, 4}) and len(served) == 3
    with pytest.raises(ValueError):
        ServedBlocks(0)
