"""The pure parts of wide-EP serving: replica split, live EPLB decisions, auto policy, DP balancing."""

from __future__ import annotations

import torch

from rayfleet.serving.engine.dp_balance import DPBalancer, RankLoad
from rayfleet.serving.experts.eplb import balance_ratio, device_load, rebalance_experts
from rayfleet.serving.experts.live_eplb import (ApplyPlacement, KeepPlacement, LiveEPLBConfig, LiveEPLBPolicy,
                                                placement_balance)
from rayfleet.serving.experts.replica_split import assign_copies, balanced_split, rank_quotas


def _zipf(num_experts: int, tokens: int, zipf: float, seed: int, layers: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(layers):
        log_pop = -zipf * torch.log1p(torch.randperm(num_experts, generator=gen).double())
        rows.append(torch.bincount(torch.multinomial(torch.softmax(log_pop, -1), tokens, True, generator=gen),
                                   minlength=num_experts))
    return torch.stack(rows)


def test_balanced_split_worked_example_levels_devices_where_the_even_split_cannot():
    # 2 devices x 2 slots. Expert 0 (40 copies) has replicas on both devices (slots 0 and 2);
    # expert 1 (30, slot 1) shares device 0; expert 2 (10, slot 3) is on device 1.
    l2p = torch.tensor([[0, 2], [1, -1], [3, -1]])
    count = torch.tensor([2, 1, 1])
    counts = torch.tensor([40, 30, 10])
    even = torch.tensor([20, 30, 20, 10])  # devices 50 / 30
    quota = balanced_split(counts, l2p, count, slots_per_device=2)
    # Water-filling: device 0 = 30 + a, device 1 = 10 + (40 - a) -> a = 10: both 40.
    assert quota.tolist() == [10, 30, 30, 10]
    assert balanced_split(counts, l2p, count, slots_per_device=2, passes=0).tolist() == even.tolist()


def test_balanced_split_keeps_counts_and_is_never_worse_than_even():
    for seed in range(5):
        demand = _zipf(32, 3000, 1.2, seed)
        placement = rebalance_experts(demand, num_physical_experts=40, num_groups=1, num_nodes=1, num_devices=8,
                                      policy="global")
        fresh = _zipf(32, 3000, 1.2, seed + 100)  # a different batch than the fit
        for layer in range(2):
            l2p, count = placement.logical_to_physical[layer], placement.logical_replica_count[layer]
            quota = balanced_split(fresh[layer], l2p, count, slots_per_device=5)
            per_expert = torch.zeros(32, dtype=torch.int64).index_add_(0, placement.physical_to_logical[layer], quota)
            assert torch.equal(per_expert, fresh[layer])
            even = balanced_split(fresh[layer], l2p, count, slots_per_device=5, passes=0)
            assert quota.view(8, 5).sum(1).max() <= even.view(8, 5).sum(1).max() + 1


def test_rank_quotas_and_assignment_route_exactly_the_global_split():
    l2p = torch.tensor([[0, 2], [1, -1], [3, -1]])
    count = torch.tensor([2, 1, 1])
    gen = torch.Generator().manual_seed(0)
    topk = [torch.randint(0, 3, (n, 2), generator=gen) for n in (7, 12)]  # two ranks' batches
    by_rank = torch.stack([torch.bincount(t.flatten(), minlength=3) for t in topk])
    quota = balanced_split(by_rank.sum(0), l2p, count, slots_per_device=2)
    table = rank_quotas(by_rank, quota, l2p, count)
    assert torch.equal(table.sum(-1), by_rank)  # each rank routes all of its copies
    sent = torch.zeros(4, dtype=torch.int64)
    for rank, t in enumerate(topk):
        physical = assign_copies(t, table[rank], l2p)
        for e in range(3):  # every copy lands on a replica of its own expert
            assert set(physical[t == e].tolist()) <= set(l2p[e][l2p[e] >= 0].tolist())
        sent += torch.bincount(physical.flatten(), minlength=4)
    assert torch.equal(sent, quota)  # together the ranks realise the global split exactly


def test_hard_skew_hierarchical_reaches_the_node_bound_and_auto_never_loses_to_global():
    skew = _zipf(64, 16384, 1.5, seed=1, layers=4)
    fleet = dict(num_physical_experts=80, num_groups=8, num_nodes=4, num_devices=16)
    hier = rebalance_experts(skew, policy="hierarchical", **fleet)
    node_bound = float(balance_ratio(device_load(skew, hier, num_devices=4)).mean())
    even = placement_balance(skew, hier, num_devices=16, routing="even")
    balanced = placement_balance(skew, hier, num_devices=16, routing="balanced")
    assert even > 1.2 * node_bound  # the previous router: two hot replicas on one device
    assert balanced <= 1.02 * node_bound
    for seed in range(4):
        demand = _zipf(64, 8192, 1.0 + 0.25 * seed, seed=seed + 10, layers=3)
        auto = rebalance_experts(demand, policy="auto", **fleet)
        glob = rebalance_experts(demand, policy="global", **fleet)
        per_layer = lambda p: balance_ratio(device_load(demand, p, num_devices=16))  # noqa: E731
        assert bool((per_layer(auto) <= per_layer(glob)).all())


def _shifted_windows() -> list[torch.Tensor]:
    first, second = _zipf(16, 4096, 1.2, seed=3), _zipf(16, 4096, 1.2, seed=4)
    return [first] * 4 + [second] * 4


def test_live_policy_recovers_from_a_shift_within_two_periods():
    config = LiveEPLBConfig(num_devices=4, num_physical_experts=24, window_steps=1, history_windows=4,
                            rebalance_every_windows=2)
    policy = LiveEPLBPolicy(config, num_layers=2, num_experts=16)
    windows = _shifted_windows()
    decisions = [policy.observe_window(w) for w in windows[:4]]
    assert isinstance(decisions[0], ApplyPlacement)  # the uniform start is far from the first demand
    after = []
    for w in windows[4:]:
        best = rebalance_experts(w, num_physical_experts=24, num_groups=1, num_nodes=1, num_devices=4)
        after.append(placement_balance(w, policy.placement, num_devices=4) / placement_balance(w, best, num_devices=4))
        decision = policy.observe_window(w)
        if len(after) == 1:
            assert isinstance(decision, ApplyPlacement) and decision.reason == "shift"
    assert after[0] > 1.25 and max(after[1:]) <= 1.25, after
    assert isinstance(policy.observe_window(windows[-1]), KeepPlacement)  # steady demand: no churn


def test_live_policy_without_shift_detection_waits_for_its_period():
    """The broken variant: with the trigger off the shift is only caught at the next period."""
    config = LiveEPLBConfig(num_devices=4, num_physical_experts=24, window_steps=1, history_windows=4,
                            rebalance_every_windows=4, shift_trigger=1e9)
    policy = LiveEPLBPolicy(config, num_layers=2, num_experts=16)
    windows = _shifted_windows()
    for w in windows[:4]:
        policy.observe_window(w)
    stale = policy.placement
    policy.observe_window(windows[4])
    assert policy.placement is stale


def test_live_policy_counts_steps_into_windows():
    config = LiveEPLBConfig(num_devices=2, num_physical_experts=6, window_steps=3)
    policy = LiveEPLBPolicy(config, num_layers=1, num_experts=4)
    step = torch.tensor([[5, 1, 1, 1]])
    assert policy.observe_step(step) is None and policy.observe_step(step) is None
    assert policy.observe_step(step) is not None
    assert torch.equal(policy.history[-1], 3 * step)


def test_dp_balancer_sends_work_to_the_lightest_queue_in_tokens():
    dp = DPBalancer(2, block_size=4)
    dp.observe(0, RankLoad(num_queued_tokens=100, num_running=2, num_waiting=1))
    dp.observe(1, RankLoad(num_queued_tokens=10, num_running=2, num_waiting=0))
    assert dp.choose(list(range(40))) == 1  # 10 + 2 + 40 < 100 + 2 + 40
    assert dp.choose(list(range(50, 110))) == 1  # 12 + 40 sent + 60 = 112, below rank 0's 162
    assert dp.choose(list(range(200, 260))) == 0  # rank 1 now carries the 100 tokens sent since its report
    rr = DPBalancer(2, block_size=4, policy="round_robin")
    rr.observe(0, RankLoad(1000, 0, 5))
    assert [rr.choose([1, 2, 3]) for _ in range(4)] == [0, 1, 0, 1]


def test_dp_balancer_prefers_the_rank_holding_the_prefix():
    dp = DPBalancer(2, block_size=4)
    shared = list(range(64))
    assert dp.choose(shared + [1, 2]) == 0
    dp.observe(0, RankLoad(num_queued_tokens=20, num_running=1, num_waiting=0))
    dp.observe(1, RankLoad(num_queued_tokens=0, num_running=0, num_waiting=0))
    # rank 0: 20 + 1 + 70 - 64 (cached) = 27 < rank 1: 70
    assert dp.choose(shared + [7, 8, 9, 10, 11, 12]) == 0
