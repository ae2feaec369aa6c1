"""The serving forward (paged KV cache) must equal the training forward on the same tokens."""

from __future__ import annotations

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models import PagedBatch, PagedKVCache, build_model, preset

BLOCK = 4


@pytest.fixture(scope="module")
def model():
    # float64 so that no top-k routing decision flips on rounding between the two paths.
    config = preset("tiny", num_layers=3, num_dense_layers=1)
    return build_model(config, seed=7, dtype=torch.float64).eval()


def allocate(model, num_blocks: int = 16) -> PagedKVCache:
    return PagedKVCache.for_config(model.config, num_blocks=num_blocks, block_size=BLOCK,
                                   dtype=torch.float64)


def step(model, cache, tables, chunks):
    """One paged forward over per-sequence chunks [(tokens, start_position)], padded to [B, S]."""
    width = max(len(t) for t, _ in chunks)
    tokens = torch.zeros(len(chunks), width, dtype=torch.long)
    positions = torch.full((len(chunks), width), -1, dtype=torch.long)
    for b, (toks, start) in enumerate(chunks):
        tokens[b, :len(toks)] = toks
        positions[b, :len(toks)] = torch.arange(start, start + len(toks))
    batch = PagedBatch.from_blocks(positions=positions, block_tables=tables, block_size=BLOCK)
    return model(tokens, kv_cache=cache, paged=batch)


@torch.no_grad()
def test_chunked_prefill_and_decode_equal_the_full_forward(model):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 259, (13,), generator=gen), torch.randint(0, 259, (9,), generator=gen)]
    full = [model(s[None])[0] for s in seqs]
    cache = allocate(model)
    # Scattered, interleaved block ids: sequence 0 owns 11, 2, 7, 5; sequence 1 owns 0, 14, 3.
    tables = torch.tensor([[11, 2, 7, 5], [0, 14, 3, 3]])
    prompt = [7, 5]  # prefill lengths; both prefill in two chunks, the second of unequal sizes
    got = [[], []]
    out = step(model, cache, tables, [(seqs[0][:3], 0), (seqs[1][:2], 0)])
    got[0].append(out[0, :3]); got[1].append(out[1, :2])
    out = step(model, cache, tables, [(seqs[0][3:7], 3), (seqs[1][2:5], 2)])
    got[0].append(out[0, :4]); got[1].append(out[1, :3])
    for pos in range(max(len(s) for s in seqs)):  # then token-by-token decode
        chunks = [(s[pos:pos + 1], pos) if prompt[b] <= pos < len(s) else (s[:0], 0)
                  for b, s in enumerate(seqs)]
        if all(len(t) == 0 for t, _ in chunks):
            continue
        out = step(model, cache, tables, chunks)
        for b, (toks, _) in enumerate(chunks):
            if len(toks):
                got[b].append(out[b, :1])
    # The model is float64 but RMSNorm, RoPE and the router compute in fp32 (as HF does), and an
    # fp32 row reduction may sum in a different order for a [B, S] padded batch than for one
    # sequence (vector width, alignment): 1.6e-8 was measured on one CPU, 0 on another. A wrong
    # block table, position or cache write moves the logits by O(1e-1), far outside this.
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), full[b], rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_paged_forward_writes_kv_only_into_its_slots(model):
    cache = allocate(model)
    tables = torch.tensor([[3, 9]])
    step(model, cache, tables, [(torch.arange(6), 0)])
    used = {3, 9}
    for block in range(cache.num_blocks):
        written = bool(cache.k[:, block].abs().sum() > 0)
        assert written == (block in used), block
    assert not cache.k[:, 9, 2:].abs().sum()  # positions 6, 7 of block 9 not yet written


def test_mismatched_addressing_is_a_spec_error():
    with pytest.raises(SpecError, match="slot_mapping"):
        PagedBatch(positions=torch.zeros(2, 3, dtype=torch.long), slot_mapping=torch.zeros(2, 2, dtype=torch.long),
                   block_tables=torch.zeros(2, 1, dtype=torch.long))


def test_cache_and_addressing_go_together(model):
    with pytest.raises(SpecError, match="kv_cache"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=allocate(model))
