"""vLLM's offline engine, one start for every check here (``offline_engine.py``), on weights
rayfleet wrote: a job fine-tunes the tiny Hugging Face model (``model: {hf: DIR}``, fp32, on text
tokenized with the model's own tokenizer) and ``rayfleet model export`` writes it back to HF format.
On that export vLLM runs here, is deterministic, reuses its prefix cache, agrees on greedy tokens
in fp32 with transformers (the outside oracle) and with the built-in engine serving the same
directory (cross-engine truth), and its KV events reach rayfleet's replica index in the hashes the
router computes (stored, then evicted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayfleet.serving.routing.prompt_hashes import PromptHashCache

from .conftest import long_prompt

MAX_TOKENS = 12
NUM_BLOCKS = 12  # of 32 tokens: a prompt of ~100 tokens holds 3; five such prompts overflow it


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


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny HF model fine-tuned by a rayfleet job (3 steps) and exported back to HF format."""
    import os

    from rayfleet.cli.model import export_hf_model
    from rayfleet.jobs.local_processes import run_local
    from rayfleet.jobs.spec import TrainJobSpec
    from rayfleet.models.hf.tokenizer import HFTokenizer
    from rayfleet.placement.plan import ParallelPlan
    from rayfleet.storage.tokens import prepare_token_dataset

    work = tmp_path_factory.mktemp("cross-engine")
    tokenizer = HFTokenizer.from_files({name: (tiny_model_dir / name).read_bytes()
                                        for name in ("tokenizer.json", "tokenizer_config.json")
                                        if (tiny_model_dir / name).exists()})
    data = str(work / "data")
    prepare_token_dataset([os.path.join(os.path.dirname(os.__file__), "json")], data, shard_tokens=1 << 14,
                          seq_len=64, tokenizer=tokenizer)
    spec = TrainJobSpec.model_validate({
        "name": "cross-engine", "model": {"hf": str(tiny_model_dir)}, "data": {"uri": data, "seq_len": 64},
        "steps": 3, "global_batch_size": 4, "precision": "fp32", "resources": {"num_workers": 1},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 0, "kind": "constant"},
        "output": {"uri": str(work / "out")}})
    # its own process: a tier's pytest process may drive a Ray session and must not hold a process group
    run_local(spec, ParallelPlan(dp=1, micro_batch_size=2), in_process=False)
    export_hf_model(str(work / "out"), str(work / "hf_out"))
    return work / "hf_out"


@pytest.fixture(scope="module")
def offline(exported) -> dict:
    """The one engine's results on the export (``offline_engine.py``): the greedy part and the KV
    events part."""
    spec = {"greedy": ["the fleet serves", long_prompt(7, 100)], "max_tokens": MAX_TOKENS,
            "events": [long_prompt(seed, 100) for seed in range(1, 7)],  # the first one, then five fillers
            "num_blocks": NUM_BLOCKS}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_engine.py")), str(exported),
                           json.dumps(spec)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLINE_RESULT ")), None)
    assert line, proc.stdout[-3000:]
    return json.loads(line.split(" ", 1)[1])


def test_offline_engine_greedy_matches_transformers_and_the_builtin_engine(exported, offline):
    result = offline["greedy"]
    assert all(len(t) == MAX_TOKENS for t in result["tokens"])
    assert result["tokens_again"] == result["tokens"]
    # The second pass of the 100-word prompt reused its full blocks from the prefix cache.
    assert result["cached_tokens_again"][1] >= 32 * (len(result["prompt_ids"][1]) // 32 - 1) > 0
    for prompt_ids, tokens in zip(result["prompt_ids"], result["tokens"]):
        assert tokens == _hf_greedy(exported, prompt_ids, MAX_TOKENS)
    assert _builtin_greedy(exported, result["prompt_ids"], MAX_TOKENS) == result["tokens"]


def test_a_model_trained_by_rayfleet_and_exported_gives_the_same_greedy_tokens_in_vllm_and_the_builtin_engine(
        tiny_model_dir, exported, offline):
    """Cross-engine truth on weights rayfleet wrote, and the tokens compared are the fine-tune's."""
    import torch
    from safetensors.torch import load_file

    from rayfleet.storage.safetensors_io import HFCheckpoint

    name = "model.layers.0.self_attn.q_proj.weight"  # the job trained: the export is not the start
    start = load_file(str(tiny_model_dir / "model.safetensors"))[name]
    assert not torch.equal(HFCheckpoint(str(exported)).get(name), start)
    result = offline["greedy"]
    trained = _builtin_greedy(exported, result["prompt_ids"], MAX_TOKENS)
    assert trained == result["tokens"]
    # the starting weights answer otherwise
    assert _builtin_greedy(tiny_model_dir, result["prompt_ids"], MAX_TOKENS) != trained


def test_vllm_engine_events_reach_the_replica_index_stored_then_evicted(offline):
    """A real vLLM engine's KV events through rayfleet's subscriber: a prompt's blocks arrive as
    ``BlockStored`` in the hashes the router computes from the prompt's token ids, and once the
    cache is filled past its capacity the evicted ones arrive as ``BlockRemoved``."""
    result = offline["kv_events"]
    assert result["num_blocks"] == NUM_BLOCKS
    assert result["num_gaps"] == result["num_errors"] == result["num_unchained"] == 0

    first = result["steps"][0]
    router = [h.hex() for h in PromptHashCache(block_size=32, model_id="tiny-moe").hashes(first["prompt_ids"])]
    assert len(router) >= 3
    # Its blocks were stored, in exactly the hashes the router computes for the same tokens
    # (vLLM's own hashes differ: salted per process). A broken mapping (no parent chain) would
    # match only the first block: the chain is what makes blocks 2.. equal.
    assert first["stored"][:len(router)] == router and not first["removed"]

    # The fillers overflow the 12-block cache: vLLM evicts the first prompt's blocks (LRU) and
    # says so; the replica then stops claiming them.
    removed = {h for step in result["steps"][1:] for h in step["removed"]}
    assert set(router) & removed, "no block of the first prompt was reported evicted"
    assert not set(router) & removed & set(result["cached"])  # what was evicted is not claimed
    assert len(result["cached"]) <= NUM_BLOCKS  # never more than the engine can hold
