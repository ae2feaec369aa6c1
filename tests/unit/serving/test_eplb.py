"""EPLB: DeepSeek's published worked example, placement invariants, percentile sizing, router."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch

import rayfleet.serving.experts.eplb
from rayfleet.errors import SpecError
from rayfleet.serving.experts.eplb import (ExpertPlacement, _pack_evenly, _replicate, balance_ratio,
                                   contiguous_placement, device_load, expert_demand,
                                   rebalance_experts, route_to_replicas)

# github.com/deepseek-ai/EPLB, README "Interface and Example": two MoE layers of 12 experts,
# 16 physical experts on 2 nodes x 4 GPUs, 4 expert groups; the README prints phy2log only.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHYSICAL_TO_LOGICAL = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                              [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
# Replica counts implied by the published phy2log (how often each expert appears in its row).
README_REPLICA_COUNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                        [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def _readme_placement() -> ExpertPlacement:
    return rebalance_experts(torch.tensor(README_WEIGHT), num_physical_experts=16, num_groups=4,
                             num_nodes=2, num_devices=8, policy="hierarchical")


def _check_maps(placement: ExpertPlacement, *, num_physical: int) -> None:
    """The three outputs describe one placement: every slot filled, maps mutually inverse."""
    p2l, l2p, count = placement
    num_layers, num_logical = count.shape
    assert p2l.shape == (num_layers, num_physical)
    assert bool((count >= 1).all()), "a logical expert has no replica"
    assert count.sum(-1).tolist() == [num_physical] * num_layers
    for layer in range(num_layers):
        assert torch.equal(torch.bincount(p2l[layer], minlength=num_logical), count[layer])
        seen = []
        for e in range(num_logical):
            n = int(count[layer, e])
            replicas = l2p[layer, e, :n]
            assert bool((p2l[layer, replicas] == e).all())
            assert bool((l2p[layer, e, n:] == -1).all())
            seen += replicas.tolist()
        assert sorted(seen) == list(range(num_physical))


def test_reproduces_the_deepseek_readme_example_exactly():
    placement = _readme_placement()
    assert placement.physical_to_logical.tolist() == README_PHYSICAL_TO_LOGICAL
    assert placement.logical_replica_count.tolist() == README_REPLICA_COUNT
    assert placement.logical_to_physical.shape == (2, 12, 2)
    _check_maps(placement, num_physical=16)


def test_worked_example_layer0_follows_the_numbered_steps():
    # Step 1: group loads [262, 330, 116, 325]; heaviest first to the lighter node:
    # g1 -> node 0, g3 -> node 1, g0 -> node 1 (325 < 330), g2 -> node 0.
    groups = torch.tensor(README_WEIGHT[0], dtype=torch.float64).view(1, 4, 3).sum(-1)
    assert groups.tolist() == [[262, 330, 116, 325]]
    node, slot = _pack_evenly(groups, 2)
    assert node.tolist() == [[1, 0, 0, 1]] and slot.tolist() == [[1, 0, 1, 0]]
    # Step 2: node 0 holds experts 3..8, node 1 holds 9, 10, 11, 0, 1, 2; two extra replicas
    # each go to the heaviest load per replica: experts 5 then 4, and experts 10 then 1.
    node_loads = torch.tensor([[61, 104, 165, 39, 4, 73], [56, 183, 86, 90, 132, 40]], dtype=torch.float64)
    physical_to_local, rank, count = _replicate(node_loads, 8)
    assert count.tolist() == [[1, 2, 2, 1, 1, 1], [1, 2, 1, 1, 2, 1]]
    assert physical_to_local[:, 6:].tolist() == [[2, 1], [1, 4]] and rank[:, 6:].tolist() == [[1, 1], [1, 1]]
    # Step 3: physical loads (165/2 = 82.5, ...) packed two per GPU, heaviest first.
    loads = device_load(torch.tensor(README_WEIGHT), _readme_placement(), num_devices=8)
    assert loads[0].tolist() == [121.5, 86.5, 125.0, 113.0, 147.5, 131.5, 156.0, 152.0]


def _random_case(gen: torch.Generator) -> dict:
    num_nodes = int(torch.randint(1, 4, (), generator=gen))
    num_devices = num_nodes * int(torch.randint(1, 5, (), generator=gen))
    groups_per_node = int(torch.randint(1, 4, (), generator=gen))
    num_groups = num_nodes * groups_per_node
    num_experts = num_groups * int(torch.randint(1, 5, (), generator=gen))
    slots = -(-num_experts // num_devices) + int(torch.randint(0, 3, (), generator=gen))
    return dict(num_physical_experts=num_devices * slots, num_groups=num_groups,
                num_nodes=num_nodes, num_devices=num_devices, num_experts=num_experts)


@pytest.mark.parametrize("policy", ["hierarchical", "global"])
def test_invariants_on_random_fleets(policy):
    gen = torch.Generator().manual_seed(7)
    for _ in range(60):
        case = _random_case(gen)
        num_experts = case.pop("num_experts")
        # Heavy-tailed loads with zeros and ties, the cases that break sloppy tie handling.
        load = (torch.rand(3, num_experts, generator=gen) ** 4 * 1000).round()
        load[:, ::5] = 0
        placement = rebalance_experts(load, policy=policy, **case)
        _check_maps(placement, num_physical=case["num_physical_experts"])
        if policy == "hierarchical":  # a group and all its replicas live on one node
            per_node = case["num_physical_experts"] // case["num_nodes"]
            node_of_slot = torch.arange(case["num_physical_experts"]) // per_node
            group_size = num_experts // case["num_groups"]
            for layer in range(3):
                group_of_slot = placement.physical_to_logical[layer] // group_size
                for g in range(case["num_groups"]):
                    assert node_of_slot[group_of_slot == g].unique().numel() == 1


def test_auto_uses_global_when_groups_do_not_split_over_nodes():
    load = torch.tensor(README_WEIGHT)
    auto = rebalance_experts(load, num_physical_experts=16, num_groups=3, num_nodes=2, num_devices=8)
    flat = rebalance_experts(load, num_physical_experts=16, num_groups=3, num_nodes=2, num_devices=8,
                             policy="global")
    assert torch.equal(auto.physical_to_logical, flat.physical_to_logical)
    assert not torch.equal(auto.physical_to_logical, _readme_placement().physical_to_logical)


def _zipf_load(gen: torch.Generator, num_layers: int, num_experts: int) -> torch.Tensor:
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_layers)])
    return 100_000 / (ranks + 1).double()


def test_balancing_brings_skewed_loads_near_even():
    load = _zipf_load(torch.Generator().manual_seed(0), 4, 64)
    naive = balance_ratio(device_load(load, contiguous_placement(4, 64), num_devices=16))
    for num_groups, num_nodes in ((8, 2), (1, 1)):  # hierarchical, global
        placement = rebalance_experts(load, num_physical_experts=96, num_groups=num_groups,
                                      num_nodes=num_nodes, num_devices=16)
        balanced = balance_ratio(device_load(load, placement, num_devices=16))
        assert bool((naive > 2.5).all()) and bool((balanced < 1.1).all()), (naive, balanced)


def test_expert_demand_is_a_per_expert_percentile_over_windows():
    history = torch.tensor([[[0, 10]], [[4, 10]], [[8, 10]], [[100, 10]], [[12, 10]]])  # [5, 1, 2]
    assert expert_demand(history, percentile=50).tolist() == [[8.0, 10.0]]
    assert expert_demand(history, percentile=100).tolist() == [[100.0, 10.0]]
    assert expert_demand(history, percentile=0).tolist() == [[0.0, 10.0]]


def _bursty_trace(gen: torch.Generator, num_windows: int) -> torch.Tensor:
    """12 steady experts (~100 tokens) and 4 that burst to 600 in a quarter of windows."""
    steady = 100 * (1 + 0.1 * torch.randn(num_windows, 1, 12, generator=gen)).clamp(min=0)
    burst = torch.rand(num_windows, 1, 4, generator=gen) < 0.25
    return torch.cat([torch.where(burst, 600.0, 10.0), steady], dim=-1)


def test_percentile_sizing_beats_mean_sizing_on_bursty_load():
    # Broken variant: sizing replicas from the mean gives bursty experts one replica each, and
    # the device holding a bursting expert sets the step time. Compare the p90 window.
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        history, future = _bursty_trace(gen, 32), _bursty_trace(gen, 200)

        def p90_window_ratio(demand: torch.Tensor) -> float:
            placement = rebalance_experts(demand, num_physical_experts=32, num_groups=1,
                                          num_nodes=1, num_devices=16)
            ratios = torch.cat([balance_ratio(device_load(w, placement, num_devices=16)) for w in future])
            return float(ratios.quantile(0.9))

        by_percentile = p90_window_ratio(expert_demand(history, percentile=90))
        by_mean = p90_window_ratio(history.mean(0))
        assert by_percentile < 0.8 * by_mean, (seed, by_percentile, by_mean)


def _sequential_router(topk_idx, logical_to_physical, count, physical_load):
    """The definition: one routed copy at a time, to the least-loaded replica, lower rank on ties."""
    load = physical_load.clone()
    out = []
    for e in topk_idx.reshape(-1).tolist():
        replicas = logical_to_physical[e, :int(count[e])]
        pick = int(replicas[int(torch.argmin(load[replicas]))])
        load[pick] += 1
        out.append(pick)
    return torch.tensor(out).view(topk_idx.shape), load


def test_router_picks_the_least_loaded_replica():
    # Expert 0 has replicas 3 and 5; replica 3 already has 2 tokens queued.
    l2p = torch.tensor([[3, 5], [0, -1], [1, 2], [4, -1]])
    count = torch.tensor([2, 1, 2, 1])
    queued = torch.tensor([0, 0, 0, 2, 0, 0])
    route = route_to_replicas(torch.tensor([[0], [0], [0], [2], [2]]), l2p, count, physical_load=queued)
    assert route.physical_idx.view(-1).tolist() == [5, 5, 3, 1, 2]  # 0<2, 1<2, tie -> rank 0
    assert route.physical_load.tolist() == [0, 1, 1, 3, 0, 2]
    assert queued.tolist() == [0, 0, 0, 2, 0, 0]  # not mutated


def test_router_equals_the_sequential_definition():
    gen = torch.Generator().manual_seed(3)
    placement = rebalance_experts(_zipf_load(gen, 1, 16), num_physical_experts=32, num_groups=1,
                                  num_nodes=1, num_devices=8)
    l2p, count = placement.logical_to_physical[0], placement.logical_replica_count[0]
    for _ in range(5):
        topk = torch.randint(0, 16, (200, 2), generator=gen)
        queued = torch.randint(0, 20, (32,), generator=gen)
        route = route_to_replicas(topk, l2p, count, physical_load=queued)
        expected_idx, expected_load = _sequential_router(topk, l2p, count, queued)
        assert torch.equal(route.physical_idx, expected_idx)
        assert torch.equal(route.physical_load, expected_load)


def test_router_splits_each_expert_evenly_where_first_replica_routing_does_not():
    placement = _readme_placement()
    l2p, count = placement.logical_to_physical[0], placement.logical_replica_count[0]
    # Layer 0's loads as a shuffled batch of single-expert tokens.
    topk = torch.repeat_interleave(torch.arange(12), torch.tensor(README_WEIGHT[0])).view(-1, 1)
    topk = topk[torch.randperm(topk.shape[0], generator=torch.Generator().manual_seed(0))]
    layer0 = ExpertPlacement(*(t[:1] for t in placement))
    even = device_load(torch.tensor([README_WEIGHT[0]]), layer0, num_devices=8)[0]

    def per_device(physical: torch.Tensor) -> torch.Tensor:
        return torch.bincount(physical.view(-1), minlength=16).view(8, 2).sum(-1).double()

    ours = per_device(route_to_replicas(topk, l2p, count).physical_idx)
    assert bool(((ours - even).abs() < 2).all())  # under one token per replica, two per device
    first_replica = l2p[topk.view(-1), 0]  # broken variant: ignores the replicas
    assert float((per_device(first_replica) - even).abs().max()) > 50


def test_router_handles_an_empty_batch():
    placement = _readme_placement()
    route = route_to_replicas(torch.zeros(0, 2, dtype=torch.int64), placement.logical_to_physical[0],
                              placement.logical_replica_count[0])
    assert route.physical_idx.shape == (0, 2) and route.physical_load.tolist() == [0] * 16


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_physical_experts=18), "num_physical_experts"),  # 18 slots over 8 devices
    (dict(num_physical_experts=8), "num_physical_experts"),  # fewer slots than experts
    (dict(num_groups=5), "num_groups"),  # 12 experts in 5 groups
    (dict(num_devices=6, num_nodes=4, num_physical_experts=24), "num_devices"),
    (dict(num_groups=3, policy="hierarchical"), "num_groups"),  # 3 groups over 2 nodes
    (dict(num_nodes=0), "num_nodes"),
    (dict(policy="nearest"), "policy"),
])
def test_bad_fleet_shapes_raise_spec_errors_naming_the_field(kwargs, field):
    args = dict(num_physical_experts=16, num_groups=4, num_nodes=2, num_devices=8) | kwargs
    with pytest.raises(SpecError) as info:
        rebalance_experts(torch.tensor(README_WEIGHT), **args)
    assert info.value.field == field and "Fix:" in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).field == field


def test_bad_loads_raise_spec_errors():
    fleet = dict(num_physical_experts=16, num_groups=4, num_nodes=2, num_devices=8)
    with pytest.raises(SpecError, match="demand"):
        rebalance_experts(torch.tensor(README_WEIGHT[0]), **fleet)
    with pytest.raises(SpecError, match="demand"):
        rebalance_experts(-torch.tensor(README_WEIGHT), **fleet)
    with pytest.raises(SpecError, match="percentile"):
        expert_demand(torch.ones(2, 1, 4), percentile=101)
    with pytest.raises(SpecError, match="load_history"):
        expert_demand(torch.ones(1, 4))
    placement = _readme_placement()
    l2p, count = placement.logical_to_physical[0], placement.logical_replica_count[0]
    with pytest.raises(SpecError, match="topk_idx"):
        route_to_replicas(torch.tensor([[12]]), l2p, count)
    with pytest.raises(SpecError, match="physical_load"):
        route_to_replicas(torch.tensor([[1]]), l2p, count, physical_load=torch.zeros(16))


def test_eplb_is_a_pure_module():
    """No Ray, clock, I/O or other rayfleet layers: the same code runs in actors and simulators."""
    tree = ast.parse(Path(rayfleet.serving.experts.eplb.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "typing", "torch", "rayfleet.errors"}, imported
