"""``GangEngine`` over a local 2-rank gang: concurrent streams equal the single-process engine's
greedy tokens, and a rank killed mid-stream is survived (gang re-formed, every stream resumed to
the same tokens, nothing left on the ranks). Without Ray: the Serve replica (``GangReplica``)
wraps the same class over Ray actors (``tests/cluster/test_wide_ep_serving.py``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayfleet.models import ByteTokenizer
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.wide_ep_async import GangEngine
from rayfleet.serving.engine.wide_ep_local import LocalGang
from rayfleet.serving.engine.wide_ep_rank import ModelRecipe
from rayfleet.serving.engine.wide_ep_replica import WideEPReplica
from rayfleet.serving.experts.eplb import rebalance_experts

RECIPE = ModelRecipe("tiny", (("num_experts", 8), ("num_shared_experts", 0), ("init_std", 0.1)), seed=3,
                     dtype="float64")
CONFIG = EngineConfig(num_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=96)
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (int(torch.randint(4, 24, (), generator=gen)),), generator=gen).tolist()
            for _ in range(4)]


@pytest.mark.timeout(600)
def test_streams_equal_single_process_and_survive_a_killed_rank():
    prompts = _prompts()
    expected = [list(r.output_token_ids) for r in LLMEngine(RECIPE.build(), CONFIG).generate(prompts, PARAMS)]
    placement = rebalance_experts(torch.ones(2, 8), num_physical_experts=8, num_groups=1, num_nodes=1,
                                  num_devices=2, policy="global")
    gangs: list[LocalGang] = []

    def make_front(p):
        gangs.append(LocalGang(num_ranks=2, recipe=RECIPE, engine_config=CONFIG, placement=p or placement,
                               timeout_s=60))
        return WideEPReplica(gangs[-1], num_ranks=2, block_size=CONFIG.block_size)

    async def run() -> tuple[list[list[int]], object, object]:
        engine = GangEngine(make_front, name="gang-test", tokenizer=ByteTokenizer())
        killed = asyncio.Event()

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for chunk in engine.generate(f"r{i}", prompts[i], PARAMS):
                tokens += chunk.token_ids
                if i == 0 and len(tokens) >= 5 and not killed.is_set():
                    killed.set()
                    gangs[0].procs[1].kill()  # a rank dies mid-stream, with every request in flight
            return tokens

        try:
            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            figures = await engine.figures()
            usage = await engine.block_usage()
        finally:
            engine.shutdown()
        return got, figures, usage

    got, figures, usage = asyncio.run(run())
    assert got == expected
    assert len(gangs) == 2 and figures.num_reforms == 1 and figures.num_resumed == len(prompts), figures
    assert usage.num_requests == 0 and usage.num_reserved == 0 and usage.num_free_blocks == usage.num_blocks, usage
