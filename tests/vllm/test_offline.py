"""vLLM's offline engine on the tiny model: it runs here, is deterministic, reuses its prefix
cache, and agrees on greedy tokens in fp32 with transformers (the outside oracle) and with the
built-in engine serving the same Hugging Face directory (cross-engine truth), also once rayfleet
has fine-tuned the model and exported it back to Hugging Face format."""

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
    from rayfleet.serving.engine.engine_config import EngineConfig
    from rayfleet.serving.engine.llm_engine import LLMEngine
    from rayfleet.serving.engine.sampling import SamplingParams
    from rayfleet.storage.safetensors_io import HFCheckpoint

    checkpoint = HFCheckpoint(str(model_dir))
    model, _ = build_hf_model(checkpoint.config, checkpoint, dtype=torch.float32)
    engine = LLMEngine(model.eval(), EngineConfig(block_size=16, num_blocks=64, model_id="tiny-moe"))
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(r.output_token_ids) for r in results]


def _vllm_greedy(model_dir: Path, prompts: list[str]) -> dict:
    """vLLM's offline engine on ``model_dir`` in its own process (``offline_greedy.py``): prompt
    ids, greedy tokens (twice, the second pass from the prefix cache) and cached tokens."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_greedy.py")), str(model_dir),
                           json.dumps(prompts), str(MAX_TOKENS), "float32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLINE_RESULT ")), None)
    assert line, proc.stdout[-3000:]
    result = json.loads(line.split(" ", 1)[1])
    assert all(len(t) == MAX_TOKENS for t in result["tokens"])
    return result


def test_offline_engine_greedy_matches_transformers_and_the_builtin_engine(tiny_model_dir):
    prompts = ["the fleet serves", long_prompt(1, 100)]
    result = _vllm_greedy(tiny_model_dir, prompts)
    assert result["tokens_again"] == result["tokens"]
    # The second pass of the 60-word prompt reused its full blocks from the prefix cache.
    assert result["cached_tokens_again"][1] >= 32 * (len(result["prompt_ids"][1]) // 32 - 1) > 0
    for prompt_ids, tokens in zip(result["prompt_ids"], result["tokens"]):
        assert tokens == _hf_greedy(tiny_model_dir, prompt_ids, MAX_TOKENS)
    assert _builtin_greedy(tiny_model_dir, result["prompt_ids"], MAX_TOKENS) == result["tokens"]


def test_a_model_trained_by_rayfleet_and_exported_gives_the_same_greedy_tokens_in_vllm_and_the_builtin_engine(
        tiny_model_dir, tmp_path):
    """Cross-engine truth on weights rayfleet wrote: a job fine-tunes the HF model (``model: {hf:
    DIR}``, fp32, on text tokenized with the model's own tokenizer), ``rayfleet model export``
    writes it back to HF format, and vLLM and the built-in engine serve the export alike."""
    import os

    import torch
    from safetensors.torch import load_file

    from rayfleet.jobs.local_processes import run_local
    from rayfleet.jobs.spec import TrainJobSpec
    from rayfleet.models.hf.tokenizer import HFTokenizer
    from rayfleet.placement.plan import ParallelPlan
    from rayfleet.cli.model import export_hf_model
    from rayfleet.storage.safetensors_io import HFCheckpoint
    from rayfleet.storage.tokens import prepare_token_dataset

    tokenizer = HFTokenizer.from_files({name: (tiny_model_dir / name).read_bytes()
                                        for name in ("tokenizer.json", "tokenizer_config.json")
                                        if (tiny_model_dir / name).exists()})
    data = str(tmp_path / "data")
    prepare_token_dataset([os.path.join(os.path.dirname(os.__file__), "json")], data, shard_tokens=1 << 14,
                          seq_len=64, tokenizer=tokenizer)
    spec = TrainJobSpec.model_validate({
        "name": "cross-engine", "model": {"hf": str(tiny_model_dir)}, "data": {"uri": data, "seq_len": 64},
        "steps": 3, "global_batch_size": 4, "precision": "fp32", "resources": {"num_workers": 1},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 0, "kind": "constant"},
        "output": {"uri": str(tmp_path / "out")}})
    # its own process: this one drives the tier's Ray session and must not hold a process group
    run_local(spec, ParallelPlan(dp=1, micro_batch_size=2), in_process=False)
    exported = tmp_path / "hf_out"
    export_hf_model(str(tmp_path / "out"), str(exported))
    name = "model.layers.0.self_attn.q_proj.weight"  # the job trained: the export is not the start
    start = load_file(str(tiny_model_dir / "model.safetensors"))[name]
    assert not torch.equal(HFCheckpoint(str(exported)).get(name), start)

    prompts = ["the fleet serves", long_prompt(2, 100)]
    result = _vllm_greedy(exported, prompts)
    trained = _builtin_greedy(exported, result["prompt_ids"], MAX_TOKENS)
    assert trained == result["tokens"]
    # and the tokens compared are the fine-tune's: the starting weights answer otherwise
    assert _builtin_greedy(tiny_model_dir, result["prompt_ids"], MAX_TOKENS) != trained
