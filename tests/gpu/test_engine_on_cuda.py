"""The built-in engine on a real GPU (issue 32): it serves on ``cuda:0`` when ``load_engine`` is
given no device, says so in its published state, generates the CPU engine's greedy tokens
(float64, so no argmax flips on rounding), and hands a prefill's KV off to a CPU engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.kv_connector import KVPayload
from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 for j in range(5 + 6 * i)] for i in range(4)]


def _load(device: str | None):
    return load_engine(preset_name="tiny", seed=1, checkpoint=None, dtype="float64",
                       overrides={"max_seq_len": 256}, config=ENGINE, device=device)


def test_engine_on_cuda_matches_cpu_and_publishes_its_device():
    gpu, cpu = _load(None), _load("cpu")
    assert gpu.runner.device == torch.device("cuda:0") and gpu.runner.kv_cache.k.is_cuda
    assert [r.output_token_ids for r in gpu.generate(PROMPTS, GREEDY)] == \
        [r.output_token_ids for r in cpu.generate(PROMPTS, GREEDY)]

    async def state_device() -> str:
        runtime = AsyncEngine(gpu, name="colocated/0")
        try:
            return (await runtime.poll_state()).device
        finally:
            runtime.shutdown()

    assert asyncio.run(state_device()) == "cuda:0"


def test_prefill_on_cuda_decodes_on_cpu():
    gpu, cpu = _load("cuda:0"), _load("cpu")
    reference = cpu.generate([PROMPTS[3]], GREEDY)[0].output_token_ids
    gpu.add_request("p", PROMPTS[3], GREEDY, prefill_only=True)
    while gpu.has_unfinished_requests():
        gpu.step()
    result = gpu.pop_prefill_result("p")
    payload = KVPayload.from_tensors(prompt_token_ids=result.prompt_token_ids, first_token_id=result.first_token_id,
                                     k=result.k, v=result.v)
    assert cpu.reserve_prefilled("d", PROMPTS[3], result.first_token_id, GREEDY) is not None
    cpu.commit_prefilled("d", *payload.tensors())
    tokens = [result.first_token_id]
    while cpu.has_unfinished_requests():
        for out in cpu.step():
            tokens.extend(out.new_token_ids)
    assert tuple(tokens) == reference


def test_fp8_gemm_with_a_row_count_off_16_runs_real_on_cuda():
    """cuBLASLt refused ``_scaled_mm`` at m=2099 (an expert's tokens) on an H200: rows are padded."""
    from rayfleet.models.fp8 import ROWWISE, TENSORWISE, fp8_mm, quantize

    a = torch.randn(2099, 128, device="cuda:0")
    b = torch.randn(128, 128, device="cuda:0") * 0.05
    for block in (TENSORWISE, ROWWISE):
        qa, _ = quantize(a, block=block)
        qb, _ = quantize(b, block=block)
        real, emulated = fp8_mm(qa, qb), fp8_mm(qa, qb, use_scaled_mm=False)
        assert real.shape == (2099, 128)
        assert ((real - emulated).norm() / emulated.norm()).item() < 8e-3
