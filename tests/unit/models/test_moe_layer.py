"""Routing, dispatch and grouped experts against straightforward references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayfleet.models import GroupedExperts, LocalDispatcher, MoELayer, Router, grouped_linear


def make_layer(**overrides) -> MoELayer:
    kwargs = dict(dim=32, hidden_dim=48, num_experts=6, top_k=2, num_shared_experts=1,
                  score="sigmoid", route_scale=1.0, bias_update_rate=1e-2, aux_loss_coef=0.0,
                  capacity_factor=None)
    kwargs.update(overrides)
    torch.manual_seed(0)
    layer = MoELayer(**kwargs).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def expert_ffn(experts: GroupedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ experts.w1[e].t()) * (x @ experts.w3[e].t())) @ experts.w2[e].t()


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_grouped_experts_equal_a_per_token_per_expert_loop(score):
    layer = make_layer(score=score)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    out = layer(x)
    flat = x.reshape(-1, 32)
    routing = layer.router(flat)
    expected = torch.stack([
        sum(routing.topk_weight[t, j] * expert_ffn(layer.experts, int(routing.topk_idx[t, j]), flat[t])
            for j in range(layer.top_k)) + layer.shared_experts(flat[t])
        for t in range(flat.shape[0])])
    torch.testing.assert_close(out.reshape(-1, 32), expected)


def test_grouped_linear_equals_loop_and_skips_empty_groups():
    x = torch.randn(9, 5)
    w = torch.randn(4, 3, 5)
    sizes = [2, 0, 7, 0]
    out = grouped_linear(x, w, sizes)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0].t(), x[2:] @ w[2].t()]))


def test_dropless_routing_conserves_tokens():
    layer = make_layer()
    x = torch.randn(64, 32, dtype=torch.float64)
    routing = layer.router(x)
    dispatched = LocalDispatcher().dispatch(x, routing.topk_idx, routing.topk_weight,
                                            num_experts=6, capacity=None)
    assert int(dispatched.tokens_per_expert.sum()) == 64 * 2 == dispatched.tokens.shape[0]
    # Every routed copy arrives once: identity experts give back sum_k w_k * x = x (weights sum to 1).
    back = LocalDispatcher().combine(dispatched.tokens, dispatched)
    torch.testing.assert_close(back, x)
    layer(x)
    assert layer.last_dropped_tokens == 0
    assert torch.equal(layer.last_tokens_per_expert, torch.bincount(routing.topk_idx.flatten(), minlength=6))


def test_capacity_factor_drops_overflow_and_caps_each_expert():
    layer = make_layer(capacity_factor=1.0)
    with torch.no_grad():
        layer.router.expert_bias[0] = 10.0  # every token wants expert 0
    x = torch.randn(40, 32, dtype=torch.float64)
    layer(x)
    capacity = layer.capacity(40)
    assert capacity == 14
    assert layer.last_tokens_per_expert[0] == 40  # load is counted before dropping
    assert layer.last_dropped_tokens == 40 - capacity
    routing = layer.router(x)
    dispatched = LocalDispatcher().dispatch(x, routing.topk_idx, routing.topk_weight,
                                            num_experts=6, capacity=capacity)
    assert int(dispatched.tokens_per_expert.max()) <= capacity


def test_router_runs_in_fp32_under_autocast():
    router = Router(dim=16, num_experts=4, top_k=2, score="sigmoid", route_scale=1.0, bias_update_rate=0.0)
    torch.nn.init.normal_(router.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(torch.randn(8, 16, dtype=torch.bfloat16))
    assert out.scores.dtype == torch.float32 and out.topk_weight.dtype == torch.float32


def skewed_router(rate: float) -> Router:
    torch.manual_seed(1)
    router = Router(dim=16, num_experts=8, top_k=2, score="sigmoid", route_scale=1.0, bias_update_rate=rate)
    torch.nn.init.normal_(router.weight, std=0.3)
    with torch.no_grad():
        router.weight[0] += 0.3  # experts 0 and 1 attract most tokens
        router.weight[1] += 0.2
    return router


def balance(router: Router, steps: int) -> float:
    gen = torch.Generator().manual_seed(2)
    shift = torch.ones(16) * 0.5
    for _ in range(steps):
        x = torch.randn(512, 16, generator=gen) + shift
        load = torch.bincount(router(x).topk_idx.flatten(), minlength=8)
        router.update_bias(load)
    x = torch.randn(4096, 16, generator=gen) + shift
    load = torch.bincount(router(x).topk_idx.flatten(), minlength=8).float()
    return float(load.max() / load.mean())


def test_aux_loss_free_bias_balances_a_skewed_router():
    assert balance(skewed_router(rate=0.0), steps=1) > 2.0  # the skew is real
    assert balance(skewed_router(rate=0.005), steps=500) <= 1.2


def test_aux_loss_reaches_the_router_through_backward():
    x = torch.randn(32, 32, dtype=torch.float64)
    for coef, expect_grad in ((0.0, False), (0.1, True)):
        layer = make_layer(aux_loss_coef=coef, num_shared_experts=0).train()
        (layer(x) * 0).sum().backward()  # only the aux loss can produce a router gradient
        grad = layer.router.weight.grad
        assert (grad is not None and grad.abs().sum() > 0) == expect_grad
    assert layer.last_aux_loss >= 1.0 - 1e-6  # E * sum f_i P_i >= ~1 (1 when balanced)


def test_dispatcher_is_swappable():
    class CountingDispatcher(LocalDispatcher):
        calls = 0

        def dispatch(self, *args, **kwargs):
            CountingDispatcher.calls += 1
            return super().dispatch(*args, **kwargs)

    layer = make_layer()
    x = torch.randn(10, 32, dtype=torch.float64)
    expected = layer(x)
    layer.dispatcher = CountingDispatcher()
    torch.testing.assert_close(layer(x), expected)
    assert CountingDispatcher.calls == 1
