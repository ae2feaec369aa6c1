"""Expert load balancing in a serving engine (``expert_balancing``): generated tokens are
identical with and without redundant expert replicas; placements keep every logical expert and
respect per-device slots; placement updates in the middle of generation drop nothing and change
no output; a skewed load gets better balanced; inconsistent placements are refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models import build_model, preset
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.experts.eplb import ExpertPlacement, rebalance_experts
from rayfleet.serving.experts.balancer import (ExpertBalancingConfig, ExpertLoadBalancer, ReplicatedExpertDispatcher,
                                               check_placement)
from rayfleet.serving.engine.sampling import SamplingParams

CONFIG = preset("tiny", max_seq_len=256, num_experts=8, init_std=0.1)  # 2 MoE layers, 8 experts, top-2
ENGINE = EngineConfig(block_size=8, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=48)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _model():
    return build_model(CONFIG, seed=7, dtype=torch.float64).eval()


def _prompts(n: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (int(length),), generator=gen).tolist()
            for length in torch.randint(5, 40, (n,), generator=gen)]


@pytest.fixture(scope="module")
def reference():
    return [r.output_token_ids for r in LLMEngine(_model(), ENGINE).generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("num_devices,redundant", [(4, 4), (2, 6), (8, 8)])
def test_outputs_identical_with_and_without_redundant_replicas(reference, num_devices, redundant):
    model = _model()
    x = torch.randint(0, 256, (3, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        plain = model(x)
    balancer = ExpertLoadBalancer(model, ExpertBalancingConfig(num_devices=num_devices,
                                                               num_redundant_experts=redundant))
    assert all(isinstance(layer.dispatcher, ReplicatedExpertDispatcher) for layer in model.moe_layers())
    assert bool((balancer.placement.logical_replica_count > 1).any())  # replicas are really used
    with torch.inference_mode():
        assert torch.equal(model(x), plain)
    assert [r.output_token_ids for r in LLMEngine(model, ENGINE).generate(_prompts(), GREEDY)] == reference
    # Tokens were really spread over the replicas of the replicated experts.
    assert all(int((d.window_physical > 0).sum()) > CONFIG.num_experts for d in balancer.dispatchers)


def _skewed_model():
    model = _model()
    for layer in model.moe_layers():  # make experts 0 and 5 hot, as a real skew would
        layer.router.expert_bias[0] = 1.0
        layer.router.expert_bias[5] = 0.5
    return model


@pytest.fixture(scope="module")
def skewed_reference():
    return [r.output_token_ids for r in LLMEngine(_skewed_model(), ENGINE).generate(_prompts(), GREEDY)]


def _skewed_balancer(**overrides) -> tuple[torch.nn.Module, ExpertLoadBalancer]:
    model = _skewed_model()
    config = dict(num_devices=4, num_redundant_experts=4, window_steps=2, rebalance_every_windows=1, percentile=90.0)
    return model, ExpertLoadBalancer(model, ExpertBalancingConfig(**{**config, **overrides}))


@pytest.mark.parametrize("kwargs", [dict(num_devices=4, num_redundant_experts=4),
                                    dict(num_devices=4, num_redundant_experts=8, num_nodes=2, num_groups=2),
                                    dict(num_devices=2, num_redundant_experts=2, policy="global")])
def test_placements_keep_every_expert_and_respect_device_slots(kwargs):
    model, balancer = _skewed_balancer(**kwargs)
    engine = LLMEngine(model, ENGINE)
    for i, prompt in enumerate(_prompts(6)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        balancer.after_step()
    assert balancer.num_updates >= 3
    p2l, l2p, count = balancer.placement
    num_devices = kwargs["num_devices"]
    slots = (CONFIG.num_experts + kwargs["num_redundant_experts"]) // num_devices
    assert p2l.shape == (CONFIG.num_moe_layers, num_devices * slots)
    check_placement(balancer.placement, num_layers=2, num_experts=8, num_devices=num_devices)
    for layer in range(p2l.shape[0]):
        assert set(p2l[layer].tolist()) == set(range(CONFIG.num_experts))  # every logical expert held
        assert torch.equal(torch.bincount(p2l[layer], minlength=8), count[layer])
        assert int(count[layer].sum()) == num_devices * slots
    # The hot expert got the most replicas in every layer.
    assert all(int(count[layer, 0]) == int(count[layer].max()) > 1 for layer in range(p2l.shape[0]))


def test_skewed_load_is_better_balanced_after_rebalancing():
    model, balancer = _skewed_balancer(rebalance_every_windows=0, window_steps=1)
    x = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(x)
    balancer.after_step()
    naive = balancer.stats().naive_balance
    balancer.rebalance()
    with torch.inference_mode():
        model(x)
    balancer.after_step()
    balanced = balancer.stats().device_balance
    assert all(b < n for b, n in zip(balanced, naive)), (balanced, naive)
    assert max(balanced) <= 1.25 and min(naive) >= 1.5, (balanced, naive)


def test_placement_update_mid_generation_keeps_requests_and_outputs(skewed_reference):
    model, balancer = _skewed_balancer(rebalance_every_windows=0)
    initial = balancer.placement.physical_to_logical.clone()
    engine = LLMEngine(model, ENGINE)
    prompts = _prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished = set()
    placements = []
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
        balancer.after_step()
        step += 1
        if step in (2, 5, 9):  # between steps, while every request is mid-prefill or mid-decode
            assert engine.scheduler.running
            placements.append(balancer.rebalance().physical_to_logical.clone())
    assert any(not torch.equal(p, initial) for p in placements)  # the slots really changed
    assert finished == set(tokens) and [tuple(tokens[f"r{i}"]) for i in range(len(prompts))] == skewed_reference
    assert engine.stats().num_preemptions == 0


def test_async_engine_rebalances_on_its_own_between_steps(skewed_reference):
    model, balancer = _skewed_balancer(window_steps=1, rebalance_every_windows=1)
    engine = AsyncEngine(LLMEngine(model, ENGINE), name="e0", after_step=balancer.after_step)

    async def run():
        async def one(i, prompt):
            out = []
            async for chunk in engine.generate(f"r{i}", prompt, GREEDY):
                out += chunk.token_ids
            return tuple(out)
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts())))

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert list(outs) == skewed_reference
    assert balancer.num_updates >= 5 and balancer.num_windows == balancer.num_steps


def test_inconsistent_placements_are_refused():
    model, balancer = _skewed_balancer()
    p2l, l2p, count = balancer.placement
    with pytest.raises(SpecError, match="invert"):  # slots swapped without updating the inverse map
        balancer.apply(ExpertPlacement(p2l.roll(1, dims=1), l2p, count))
    dropped = p2l.clone()
    dropped[:, dropped[0] == 3] = 0  # expert 3 loses its replicas
    with pytest.raises(SpecError):
        balancer.apply(rebalance_experts(torch.ones(2, 8), num_physical_experts=12, num_groups=1, num_nodes=1,
                                         num_devices=4)._replace(physical_to_logical=dropped))
    with pytest.raises(SpecError, match="slot count"):
        balancer.apply(rebalance_experts(torch.ones(2, 8), num_physical_experts=16, num_groups=1, num_nodes=1,
                                         num_devices=4))
    assert balancer.num_updates == 0


def test_serve_spec_turns_expert_balancing_on_in_local_replicas():
    from rayfleet.serving.openai_api.in_process import build_local
    from rayfleet.serving.spec import ServeSpec

    assert ServeSpec.parse({}).expert_balancing.config() is None
    local = build_local({"model": {"preset": "tiny", "seed": 7, "dtype": "float64",
                                   "overrides": {"max_seq_len": 256, "num_experts": 8, "init_std": 0.1}},
                         "colocated": {"replicas": 1},
                         "expert_balancing": {"enabled": True, "num_devices": 4, "num_redundant_experts": 4,
                                              "window_steps": 1, "rebalance_every_windows": 1}})
    try:
        engine = local.engines["colocated-0"]
        assert all(isinstance(layer.dispatcher, ReplicatedExpertDispatcher)
                   for layer in engine.engine.model.moe_layers())
        balancer = engine.after_step.__self__
        assert balancer.config.num_redundant_experts == 4 and balancer.num_physical == 12
    finally:
        local.shutdown()
