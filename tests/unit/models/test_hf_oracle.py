"""transformers as the outside oracle: every supported architecture, built locally from a
config, saved with ``save_pretrained``, loaded lazily into rayfleet's transformer.

Checks: fp32 logits on a batch of prompts within 1e-4 of transformers'; greedy decoding through
rayfleet's paged KV cache (prefill in two chunks, then one token per step, sequences batched)
equal to ``generate`` token for token.
"""

from __future__ import annotations

import math

import pytest
import torch

from rayfleet.models import PagedBatch, PagedKVCache
from rayfleet.models.hf import build_hf_model
from rayfleet.storage.safetensors_io import HFCheckpoint
from tests.unit.models.hf_fixtures import ARCHITECTURES, hf_configs, save_tiny

transformers = pytest.importorskip("transformers")

ARCHS = sorted(hf_configs())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_tiny(name, root) for name in ARCHS}


_LOADED: dict = {}


def _load_both(path):
    """(transformers model, rayfleet model, spec) for ``path``, loaded once per module."""
    if path not in _LOADED:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ckpt = HFCheckpoint(str(path))
        model, spec = build_hf_model(ckpt.config, ckpt)
        _LOADED[path] = (hf, model.eval(), spec)
    return _LOADED[path]


def _prompts(vocab: int, lengths=(5, 9, 13)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(saved, name):
    hf, model, spec = _load_both(saved[name])
    assert spec.architecture == ARCHITECTURES[name]
    tokens = torch.randint(0, spec.config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
    assert ref.abs().max() > 0.5  # the weights are large enough for a mismatch to show
    assert (out - ref).abs().max().item() <= 1e-4


def paged_greedy(model, prompts: list[list[int]], num_new: int, *, block_size: int = 4) -> list[list[int]]:
    """Greedy decode all ``prompts`` together through a paged KV cache (the engine's call shape)."""
    bsz = len(prompts)
    per_seq = math.ceil((max(map(len, prompts)) + num_new) / block_size)
    cache = PagedKVCache.for_config(model.config, num_blocks=bsz * per_seq + 1, block_size=block_size)
    # Blocks in reverse so that the block table, not the storage order, carries the sequence.
    tables = torch.tensor([[bsz * per_seq - (s * per_seq + j) for j in range(per_seq)] for s in range(bsz)])

    def step(chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        width = max(map(len, chunks))
        tokens = torch.zeros(bsz, width, dtype=torch.long)
        positions = torch.full((bsz, width), -1, dtype=torch.long)
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            tokens[i, :len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            positions[i, :len(chunk)] = torch.arange(start, start + len(chunk))
        batch = PagedBatch.from_blocks(positions=positions, block_tables=tables, block_size=block_size)
        logits = model(tokens, kv_cache=cache, paged=batch)
        last = torch.tensor([len(c) - 1 for c in chunks])
        return logits[torch.arange(bsz), last].argmax(-1)

    with torch.no_grad():
        halves = [len(p) // 2 for p in prompts]
        step([p[:h] for p, h in zip(prompts, halves)], [0] * bsz)  # chunked prefill
        nxt = step([p[h:] for p, h in zip(prompts, halves)], halves)
        out = [[int(t)] for t in nxt]
        for n in range(1, num_new):
            nxt = step([[o[-1]] for o in out], [len(p) + n - 1 for p in prompts])
            for o, t in zip(out, nxt):
                o.append(int(t))
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_paged_greedy_decoding_matches_generate(saved, name):
    hf, model, spec = _load_both(saved[name])
    prompts = _prompts(spec.config.vocab_size)
    num_new = 8
    ours = paged_greedy(model, prompts, num_new)
    # No EOS: generate must not stop early, and min_new_tokens would mask the EOS logit.
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False, pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == got


@pytest.mark.parametrize("name", ARCHS)
def test_the_serving_engine_decodes_like_generate(saved, name):
    """The built-in engine (scheduler, block pool, prefix cache) on the loaded model; for
    DeepSeek-V3 its KV pools hold the MLA latent and rotary key, of different widths."""
    from rayfleet.serving.engine.engine_config import EngineConfig
    from rayfleet.serving.engine.llm_engine import LLMEngine
    from rayfleet.serving.engine.sampling import SamplingParams

    hf, model, spec = _load_both(saved[name])
    prompts = _prompts(spec.config.vocab_size, lengths=(6, 19))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=32, model_id=name))
    results = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    hf.generation_config.eos_token_id = None
    for prompt, result in zip(prompts, results):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert list(result.output_token_ids) == ref[0, len(prompt):].tolist()
