"""A plan's layout placed on the local fleet: every worker lands on the node and rail it was given.

Uses the session's shared ``local_fleet`` (4 nodes x 8 fake H100, 2 racks; see conftest.py).
"""

from __future__ import annotations

import pytest

from rayfleet.placement.layout import Layout, build_layout, rank_groups
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.ray_adapter import PlacementTimeoutError, assigned_slot_index, reserve_layout
from rayfleet.platform import labels as L
from rayfleet.platform.topology import AcceleratorSlot

pytestmark = pytest.mark.cluster


def _report_where(layout: Layout, reserved) -> list[tuple[dict, int | None]]:
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def where(self) -> tuple[dict, int | None]:
            return ray.get_runtime_context().get_node_labels(), assigned_slot_index()

    actors = [Rank.options(**reserved.actor_options(r)).remote() for r in range(layout.world_size)]
    try:
        return ray.get([a.where.remote() for a in actors], timeout=60)
    finally:
        for actor in actors:  # kill before removing the groups, or restartable actors hang
            ray.kill(actor)


@pytest.mark.parametrize("plan,held_rails", [
    # TP4 inside a node, DP peers on the same rails of two nodes (rails 4-7 held by "other work")
    (ParallelPlan(tp=4, dp=2), (4, 5, 6, 7)),
    # TP2 x DP2 x PP2 over the free rails 2-5 of two nodes
    (ParallelPlan(tp=2, dp=2, pp=2), (0, 1, 6, 7)),
])
def test_workers_land_where_the_layout_says(local_fleet, plan: ParallelPlan, held_rails) -> None:
    topology = local_fleet.topology
    held = [AcceleratorSlot(n.name, i) for n in topology.nodes for i in held_rails]
    layout = build_layout(plan, topology, held=held)
    assert len(layout.nodes()) == 2
    reserved = reserve_layout(layout, timeout_s=60, name_prefix=f"test-placement-{plan.describe()}")
    try:
        reports = _report_where(layout, reserved)
    finally:
        reserved.release()
    for rank, (labels, rail) in enumerate(reports):
        slot = layout.slot(rank)
        node = topology.node(slot.node)
        assert labels[L.NODE] == slot.node, f"rank {rank}"
        assert labels[L.RACK] == node.rack and labels[L.NVLINK_DOMAIN] == node.nvlink_domain
        assert rail == slot.index, f"rank {rank} holds rail {rail}, layout says {slot.index}"
    # DP and PP peers that sit on different nodes share a rail
    crossing = 0
    for kind in ("dp", "pp"):
        for group in rank_groups(plan, kind):
            for a, b in zip(group, group[1:]):
                if layout.slot(a).node != layout.slot(b).node:
                    crossing += 1
                    assert layout.slot(a).index == layout.slot(b).index, (kind, a, b)
    assert crossing > 0


def test_infeasible_layout_fails_by_the_deadline_with_a_reason(local_fleet) -> None:
    import ray.util

    plan = ParallelPlan(tp=1, dp=1)
    ghost = Layout(plan=plan, rank_to_slot=(AcceleratorSlot("n9999", 0),), rank_to_accelerator=("H100",))
    with pytest.raises(PlacementTimeoutError, match="no alive node labelled rayfleet.io/node=n9999"):
        reserve_layout(ghost, timeout_s=3, name_prefix="test-placement-ghost")
    left = [pg for pg in ray.util.placement_group_table().values()
            if pg["name"] == "test-placement-ghost" and pg["state"] != "REMOVED"]
    assert not left, "the timed-out group must be removed"
