"""Shared fixtures for serving unit tests: one tiny float64 model per session, one CPU thread,
and factories (fixtures returning functions) for requests and model-free schedulers.

float64 so that no top-k routing decision or argmax flips on rounding between the paged and
the full-sequence forward; one intra-op thread because the dev machines are 2 shared cores
and these tensors are too small to gain from more.
"""

from __future__ import annotations

import pytest
import torch

from rayfleet.models import build_model, preset
from rayfleet.serving.engine.block_hash import root_block_hash
from rayfleet.serving.engine.block_pool import BlockPool
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager
from rayfleet.serving.engine.request import Request, RequestId
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.scheduler import Scheduler, SchedulerConfig


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model():
    return build_model(preset("tiny", max_seq_len=256), seed=3, dtype=torch.float64).eval()


@torch.no_grad()
def _greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Plain greedy loop over the full sequence (training forward, no KV cache)."""
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def _make_request(rid: str, tokens: list[int], *, block_size: int = 4, max_tokens: int = 4,
                 index: int = 0, **params) -> Request:
    return Request(request_id=RequestId(rid), prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                   block_size=block_size, root_hash=root_block_hash(model_id="test"), arrival_index=index)


def _make_scheduler(*, num_blocks: int = 16, block_size: int = 4, prefix_caching: bool = True,
                   **config) -> Scheduler:
    pool = BlockPool(num_blocks, enable_caching=prefix_caching)
    manager = KVCacheManager(pool, block_size=block_size, enable_prefix_caching=prefix_caching)
    config.setdefault("max_model_len", num_blocks * block_size)
    return Scheduler(SchedulerConfig(**config), manager, eos_token_id=257,
                     detokenize=lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace"))


def _run_step(scheduler: Scheduler, next_token: int = 1):
    """Schedule, pretend to run the model (every sampling chunk yields ``next_token``), update."""
    out = scheduler.schedule()
    sampled = {c.request_id: next_token for c in out.chunks if c.sample}
    return out, scheduler.update_from_output(out, sampled)


@pytest.fixture
def make_request():
    return _make_request


@pytest.fixture
def make_scheduler():
    return _make_scheduler


@pytest.fixture
def run_step():
    return _run_step


@pytest.fixture(scope="session")
def greedy_reference():
    return _greedy_reference
