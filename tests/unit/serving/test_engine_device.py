"""Where the built-in engine runs (issue 32: ``load_engine`` never passed a device, so the engine
served on CPU even on a GPU node): ``load_engine`` builds the model and its KV cache on the
replica's accelerator unless told otherwise, and the replica publishes that device in its state.

No GPU here: the accelerator is stood in for by the ``meta`` device (tensors without storage,
so construction runs but no forward), and ``replica_device`` is checked against a patched
``torch.cuda.is_available`` only, which is all it reads. ``tests/gpu/test_engine_on_cuda.py``
runs the engine on a real GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayfleet.serving.engine import loading
from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.sampling import SamplingParams

ENGINE = EngineConfig(block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32)


def _load(**kwargs) -> LLMEngine:
    return loading.load_engine(preset_name="tiny", seed=0, checkpoint=None, dtype="float32",
                               overrides={"max_seq_len": 64}, config=ENGINE, **kwargs)


@pytest.mark.parametrize("cuda, expected", [(True, "cuda:0"), (False, "cpu")])
def test_replica_device_is_the_first_visible_gpu_else_cpu(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert loading.replica_device() == expected


def test_load_engine_never_passed_a_device_regression(monkeypatch):
    """The bug: without a ``device`` argument the engine was built on the CPU whatever the node
    had. Now the default is ``replica_device()``: model and KV cache both land there."""
    monkeypatch.setattr(loading, "replica_device", lambda: "meta")
    engine = _load()
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}
    assert engine.runner.kv_cache.k.device.type == "meta" and engine.runner.kv_cache.v.device.type == "meta"


def test_load_engine_explicit_device_overrides_the_accelerator(monkeypatch):
    monkeypatch.setattr(loading, "replica_device", lambda: "meta")
    engine = _load(device="cpu")
    assert {p.device.type for p in engine.model.parameters()} == {"cpu"}
    assert engine.runner.kv_cache.k.device.type == "cpu"


def test_replica_state_publishes_the_engine_device():
    engine = _load(device="cpu")

    async def run() -> tuple[list[int], str]:
        runtime = AsyncEngine(engine, name="colocated/0")
        try:
            tokens = [t async for chunk in runtime.generate("r0", [1, 2, 3, 4, 5], SamplingParams(
                max_tokens=3, temperature=0, ignore_eos=True)) for t in chunk.token_ids]
            return tokens, (await runtime.poll_state()).device
        finally:
            runtime.shutdown()

    tokens, device = asyncio.run(run())
    assert len(tokens) == 3
    assert device == "cpu"
