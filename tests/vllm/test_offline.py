"""vLLM's offline engine on the tiny model: it runs here, is deterministic, reuses its prefix
cache, and agrees on greedy tokens in fp32 with transformers (the outside oracle) and with the
built-in engine serving the same Hugging Face directory (cross-engine truth)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import long_prompt

MAX_TOKENS = 12


def _hf_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _builtin_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The built-in engine (scheduler, paged KV cache, prefix cache) on the HF directory."""
    import torch

    from rayfleet.models.hf import build_hf_model
    from rayfleet.serving.engine.llm_engine import EngineConfig, LLMEngine
    from rayfleet.serving.engine.sampling import SamplingParams
    from rayfleet.storage.safetensors_io import HFCheckpoint

    checkpoint = HFCheckpoint(str(model_dir))
    model, _ = build_hf_model(checkpoint.config, checkpoint, dtype=torch.float32)
    engine = LLMEngine(model.eval(), EngineConfig(block_size=16, num_blocks=64, model_id="tiny-moe"))
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(r.output_token_ids) for r in results]


def test_offline_engine_greedy_matches_transformers_and_the_builtin_engine(tiny_model_dir):
    prompts = ["the fleet serves", long_prompt(1, 100)]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_greedy.py")), str(tiny_model_dir),
                           json.dumps(prompts), str(MAX_TOKENS), "float32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLINE_RESULT ")), None)
    assert line, proc.stdout[-3000:]
    result = json.loads(line.split(" ", 1)[1])
    assert all(len(t) == MAX_TOKENS for t in result["tokens"])
    assert result["tokens_again"] == result["tokens"]
    # The second pass of the 60-word prompt reused its full blocks from the prefix cache.
    assert result["cached_tokens_again"][1] >= 32 * (len(result["prompt_ids"][1]) // 32 - 1) > 0
    for prompt_ids, tokens in zip(result["prompt_ids"], result["tokens"]):
        assert tokens == _hf_greedy(tiny_model_dir, prompt_ids, MAX_TOKENS)
    assert _builtin_greedy(tiny_model_dir, result["prompt_ids"], MAX_TOKENS) == result["tokens"]
