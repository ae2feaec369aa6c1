"""The Ray adapter's pure half: bundles, label selectors and strategies encode the layout exactly."""

from __future__ import annotations

from rayfleet.placement.layout import build_layout
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.ray_adapter import placement_group_specs, serve_replica_options, train_label_selectors
from rayfleet.platform import labels as L
from rayfleet.platform.topology import AcceleratorSlot, build_topology


def _layout():
    topo = build_topology(num_nodes=4, accelerator="H100", accelerators_per_node=8, num_racks=2)
    held = [AcceleratorSlot("n0000", 0), AcceleratorSlot("n0000", 1)]
    return build_layout(ParallelPlan(tp=4, pp=2, dp=2), topo, held=held), held


def test_one_bundle_per_rank_pins_node_and_rail() -> None:
    layout, held = _layout()
    (spec,) = placement_group_specs(layout)
    assert sorted(spec.ranks) == list(range(layout.world_size))
    for bundle, selector, rank in zip(spec.bundles, spec.bundle_label_selector, spec.ranks):
        slot = layout.slot(rank)
        assert selector == {L.NODE: slot.node}
        assert bundle == {"GPU": 1.0, L.slot_resource(slot.index): 1.0}
        assert slot not in held
    # bundles are ordered by (node, index) so Ray's GPU ids follow the slots on idle nodes
    keys = [(layout.nodes().index(layout.slot(r).node), layout.slot(r).index) for r in spec.ranks]
    assert keys == sorted(keys)
    assert spec.strategy == "PACK"


def test_group_by_dp_replica_and_node() -> None:
    layout, _ = _layout()
    replicas = placement_group_specs(layout, group_by="dp_replica")
    assert len(replicas) == layout.plan.dp
    for spec in replicas:
        assert {layout.plan.coords(r).dp for r in spec.ranks} == {int(spec.name.rsplit("-", 1)[1])}
    per_node = placement_group_specs(layout, group_by="node", cpus_per_bundle=0.5)
    assert all(s.strategy == "STRICT_PACK" for s in per_node)
    assert all(len({sel[L.NODE] for sel in s.bundle_label_selector}) == 1 for s in per_node)
    assert all(b["CPU"] == 0.5 for s in per_node for b in s.bundles)


def test_non_gpu_accelerators_use_their_ray_resource() -> None:
    topo = build_topology(num_nodes=4, accelerator="P800", num_racks=1)
    layout = build_layout(ParallelPlan(tp=8, dp=2), topo)
    (spec,) = placement_group_specs(layout)
    assert all("XPU" in b and "GPU" not in b for b in spec.bundles)


def test_serve_and_train_options() -> None:
    layout, _ = _layout()
    opts = serve_replica_options(layout, ranks=[0, 1, 2, 3])
    assert len(opts["placement_group_bundles"]) == 4
    assert opts["placement_group_bundle_label_selector"][0] == {L.NODE: layout.slot(0).node}
    selectors = train_label_selectors(layout)
    assert [s[L.NODE] for s in selectors] == [layout.slot(r).node for r in range(layout.world_size)]
