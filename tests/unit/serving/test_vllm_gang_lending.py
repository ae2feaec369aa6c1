"""The shared autoscaler lends and reclaims whole gangs of a wide-EP vLLM pool (``deploy.gang_units``).

The Serve shell reports a ``data_parallel_size: N`` pool with a gang as the policy's replica; the
unchanged policy then frees a gang's accelerators per lend and removes whole gangs, and the shell
moves Serve's bounds by N ranks per gang. Each test drives the real policy and the shell's pure
observation; the broken variant (ranks reported as replicas) is run beside to show the test can fail.
"""

from __future__ import annotations

from rayfleet.platform.autoscaler.policy import (
    AutoscalerConfig, AutoscalerPolicy, AutoscalerState, FleetObservation, ScaleServe, ShrinkTraining,
    TrainingObservation,
)
from rayfleet.platform.queues import JobClass
from rayfleet.serving.deploy.gang_units import LendUnit
from rayfleet.serving.deploy.serve_scaling_rules import LentReplica, ServeShellConfig, serve_observation
from rayfleet.serving.spec import ServeSpec

NODES = {f"n{i}": "H100" for i in range(4)}


def _dp_spec(dp: int = 4, per_rank: int = 1) -> ServeSpec:
    return ServeSpec.parse({"engine": "vllm", "model": {"hf": "/models/moe"}, "vllm": {"device": "gpu"},
                            "colocated": {"accelerator_type": "H100", "data_parallel_size": dp,
                                          "accelerators_per_replica": dp * per_rank, "enable_expert_parallel": True}})


def _unit(spec: ServeSpec) -> LendUnit:
    pool = spec.colocated
    return LendUnit.of_pool(data_parallel_size=pool.data_parallel_size, accelerators_per_replica=pool.accelerators_per_replica)


def test_worked_example_in_the_module_doc():
    unit = _unit(_dp_spec(dp=4))
    assert unit == LendUnit(ranks=4, accelerators=4)
    assert unit.units_in(10) == 2 and unit.units_in(3) == 0 and unit.units_in(-1) == 0
    assert unit.serve_replicas(2) == 8 and unit.whole_units(7) == 1 and unit.whole_units(8) == 2
    plain = LendUnit.of_pool(data_parallel_size=1, accelerators_per_replica=0)  # a CPU pool: one per replica
    assert (plain.units_in(3), plain.serve_replicas(3), plain.whole_units(3)) == (3, 3, 3)


def test_gang_nodes_count_complete_gangs_at_their_majority_node():
    unit = LendUnit(ranks=4, accelerators=4)
    by_gang = {"pg-a": ["n1", "n1", "n2", "n1"], "pg-b": ["n3", "n0", "n0", "n3"], "pg-c": ["n2", "n2", "n2"]}
    assert unit.unit_nodes(by_gang) == ["n0", "n1"]  # pg-c is still starting a rank; pg-b ties -> n0


def _training(nodes_per_replica: list[str]) -> TrainingObservation:
    """An elastic job of 1-accelerator DP replicas, one per listed node entry, minimum 2."""
    replicas = tuple((n,) for n in nodes_per_replica)
    return TrainingObservation("t", "q", "H100", JobClass.ELASTIC, len(replicas), 2, len(replicas), 1, replicas,
                               admitted_size=len(replicas))


def _lend(unit: LendUnit, *, in_flight: int) -> tuple[ScaleServe, dict[str, int], dict[str, int]]:
    """One policy step for a pool with one running gang on n0 that wants more; n1 has 1 free
    accelerator and training on the rest. Returns the scale-up, what training freed per node and
    the free accelerators the step saw."""
    config = ServeShellConfig(target_ongoing_requests=4 * unit.ranks, max_replicas=4)  # the shell's gang target
    obs = serve_observation(deployment="moe", accelerator_type="H100", accelerators_per_replica=unit.accelerators,
                            load={"in_flight": in_flight}, kv_usage_by_replica={}, base_nodes=["n0"], lent=[],
                            config=config)
    free = {"n0": 0, "n1": 1, "n2": 0, "n3": 0}
    job = _training(["n1"] * 7 + ["n2"] * 8 + ["n3"] * 8)
    result = AutoscalerPolicy().decide(AutoscalerState(), FleetObservation(0.0, free, NODES, (obs,), (job,), {}))
    (scale,) = [d for d in result.decisions if isinstance(d, ScaleServe)]
    freed: dict[str, int] = {}
    for shrink in (d for d in result.decisions if isinstance(d, ShrinkTraining)):
        for node, count in shrink.freed_by_node.items():
            freed[node] = freed.get(node, 0) + count
    return scale, freed, free


def test_a_lend_frees_one_whole_gang_on_one_node_and_raises_serve_by_its_ranks():
    unit = _unit(_dp_spec(dp=4))
    scale, freed, free = _lend(unit, in_flight=20)  # 20 in flight / (4 per rank x 4 ranks): 2 gangs
    assert scale.target_replicas == 2 and len(scale.add_on_nodes) == 1
    (node,) = scale.add_on_nodes
    assert free[node] + freed.get(node, 0) == unit.accelerators  # room for all 4 ranks, there
    assert set(freed) == {node}
    assert unit.serve_replicas(scale.target_replicas) == 8  # the bounds the shell writes: 2 gangs x 4 ranks
    # Broken variant: ranks reported to the policy as replicas (1 accelerator each). The same
    # demand then buys a single accelerator, a quarter of a gang, which cannot serve.
    rank_as_replica = LendUnit(ranks=1, accelerators=1)
    _, broken_freed, _ = _lend(rank_as_replica, in_flight=20 // unit.ranks * 1 + 1)
    assert sum(broken_freed.values()) + 1 < unit.accelerators


def test_reclaim_takes_a_whole_gang_and_lowers_serve_by_its_ranks():
    unit = _unit(_dp_spec(dp=2, per_rank=2))  # gangs of 2 ranks x 2 accelerators
    policy = AutoscalerPolicy(AutoscalerConfig(scale_down_after_s=3))
    config = ServeShellConfig(target_ongoing_requests=4 * unit.ranks, max_replicas=4)
    state, free = AutoscalerState(), {n: 0 for n in NODES}
    lent = [LentReplica("colocated-1", "moe", "n2", decided_at=-60, placed_at=-59, running_at=-30)]
    obs = serve_observation(deployment="moe", accelerator_type="H100", accelerators_per_replica=unit.accelerators,
                            load={"in_flight": 0, "ttft_s": [0.1]}, kv_usage_by_replica={}, base_nodes=["n0"],
                            lent=lent, config=config)  # the spec's gang on n0, a lent one on n2
    assert (obs.running_replicas, obs.min_replicas, obs.desired_replicas) == (2, 1, 1)
    downs = []
    for t in (0.0, 2.0, 4.0, 8.0):
        result = policy.decide(state, FleetObservation(t, free, NODES, (obs,), (), {}))
        state = result.state
        downs += [d for d in result.decisions if isinstance(d, ScaleServe)]
    down = downs[0]  # (repeated while the stale report still shows 2 gangs)
    assert down.target_replicas == 1 and down.remove_from_nodes == ("n2",)  # the lent gang
    assert (unit.serve_replicas(2), unit.serve_replicas(down.target_replicas)) == (4, 2)  # 4 ranks -> 2
    assert unit.serve_replicas(down.target_replicas) % unit.ranks == 0  # never part of a gang
