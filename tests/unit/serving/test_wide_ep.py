"""A wide-EP replica on real gloo processes: greedy tokens equal the single-process engine's.

Each gang costs a few seconds of process start-up (more on a loaded machine), so one 2-rank
gang checks equality, a forced weight move mid-generation, and then live EPLB deciding its own
moves under shifting traffic (no request lost, tokens unchanged); one more runs the broken variant
(the EP dispatcher's ``misroute``: rows go to the wrong rank's experts), which must differ.
The model has no shared expert and a larger init so that routed experts decide the tokens
(with the tiny preset's defaults a wrong expert changes no greedy token: a test that cannot fail).
"""

from __future__ import annotations

import pytest
import torch

from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.wide_ep_local import LocalGang
from rayfleet.serving.engine.wide_ep_rank import ModelRecipe, StepCommand
from rayfleet.serving.engine.wide_ep_replica import WideEPReplica
from rayfleet.serving.experts.eplb import rebalance_experts
from rayfleet.serving.experts.live_eplb import LiveEPLBConfig, LiveEPLBPolicy

RECIPE = ModelRecipe("tiny", (("num_experts", 8), ("num_shared_experts", 0), ("init_std", 0.1)), seed=0,
                     dtype="float64")
CONFIG = EngineConfig(num_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=96)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
NUM_RANKS, NUM_SLOTS = 2, 10  # 8 experts + 2 redundant slots, 5 per rank


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 30, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    return [list(r.output_token_ids) for r in LLMEngine(RECIPE.build(), CONFIG).generate(prompts, PARAMS)]


def _placement(demand: torch.Tensor):
    return rebalance_experts(demand, num_physical_experts=NUM_SLOTS, num_groups=1, num_nodes=1,
                             num_devices=NUM_RANKS, policy="global")


@pytest.mark.timeout(600)
def test_two_rank_replica_matches_single_process_and_moves_weights_mid_run():
    prompts = _prompts()
    expected = _reference(prompts)
    uniform = _placement(torch.ones(2, 8))
    skewed = _placement(torch.tensor([[50.0, 1, 1, 1, 1, 1, 1, 30]] * 2))
    assert not torch.equal(uniform.physical_to_logical, skewed.physical_to_logical)
    with LocalGang(num_ranks=NUM_RANKS, recipe=RECIPE, engine_config=CONFIG, placement=uniform) as gang:
        replica = WideEPReplica(gang, num_ranks=NUM_RANKS, block_size=CONFIG.block_size)
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            replica.submit(rid, prompt, PARAMS)

        def move_after_a_few_steps(step: int) -> None:
            if step == 4:  # mid-generation: prefills done, decodes running
                replica.next_placement = skewed
                replica.moves.append((step, "test", 0, 0.0))

        tokens = replica.run_until_done(ids, arrivals=move_after_a_few_steps)
        got = [tokens[rid] for rid in ids]
        # Weights really moved: each rank's slots now hold the skewed placement's experts, and
        # some of them came from the other rank.
        report = gang.step([StepCommand()] * NUM_RANKS)
        live = _live_phase(gang, initial=skewed)
    assert got == expected
    assert live["tokens"] == live["expected"]  # every request finished, same tokens, across live moves
    assert live["moves"] and all(received > 0 for _, _, received, _ in live["moves"]), live["moves"]
    assert {r.rank for r in report} == {0, 1}
    full = RECIPE.build()
    for r in report:
        slots = slice(r.rank * 5, (r.rank + 1) * 5)
        for i, layer in enumerate(full.moe_layers()):
            want = layer.experts.w1.detach().double().sum(dim=(1, 2))[skewed.physical_to_logical[i, slots]]
            torch.testing.assert_close(r.slot_checksums[i], want, rtol=0, atol=1e-9)
    assert replica.moves and replica.moves[0][2] > 0, replica.moves  # slots received from the other rank
    assert sum(f.num_requests for f in replica.ranks) == len(prompts)
    assert min(f.num_requests for f in replica.ranks) >= 2  # DP balancing used both ranks
    assert sum(replica.exchange_bytes.values()) > 0


@pytest.mark.timeout(600)
def test_misrouted_expert_exchange_changes_the_tokens():
    """The broken variant: the same gang with rows sent to the wrong rank's experts."""
    prompts = _prompts(4, seed=1)
    expected = _reference(prompts)
    with LocalGang(num_ranks=NUM_RANKS, recipe=RECIPE, engine_config=CONFIG,
                   placement=_placement(torch.ones(2, 8)), misroute=True) as gang:
        got = WideEPReplica(gang, num_ranks=NUM_RANKS, block_size=CONFIG.block_size).generate(prompts, PARAMS)
    assert got != expected


def _live_phase(gang: LocalGang, *, initial) -> dict:
    """The front's own live EPLB on the same gang: traffic shifts from one "topic" (a few token
    ids, which the router sends to few experts) to another, requests arriving two per step; the
    policy decides the moves (window 2 steps, re-place every window or on a shift)."""
    config = LiveEPLBConfig(num_devices=NUM_RANKS, num_physical_experts=NUM_SLOTS, policy="global", window_steps=2,
                            history_windows=2, rebalance_every_windows=1)
    front = WideEPReplica(gang, num_ranks=NUM_RANKS, block_size=CONFIG.block_size,
                          eplb=LiveEPLBPolicy(config, num_layers=2, num_experts=8, initial=initial))
    gen = torch.Generator().manual_seed(5)
    topics = [torch.tensor([5, 17, 33]), torch.tensor([101, 150, 201, 250])]
    prompts = [topics[i >= 8][torch.randint(0, len(topics[i >= 8]), (12,), generator=gen)].tolist() for i in range(16)]
    ids = [f"live-{i}" for i in range(len(prompts))]
    tokens = front.run_until_done(ids, arrivals=lambda s: [front.submit(ids[i], prompts[i], PARAMS)
                                                           for i in range(2 * s, min(2 * s + 2, len(ids)))])
    return {"tokens": [tokens[r] for r in ids], "expected": _reference(prompts), "moves": front.moves}
