"""Topology model, labels and catalogue: pure, no Ray."""

import pytest

from rayfleet.errors import LabelError, RayfleetError, SpecError, UnknownAcceleratorError
from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import CATALOGUE, get_accelerator
from rayfleet.platform.topology import FleetTopology, NodeTopology, build_topology, parse_accelerator_mix


def test_catalogue_has_required_types_with_sane_figures():
    for name in ("H100", "H200", "A100", "P800", "910B"):
        spec = get_accelerator(name)
        assert spec.peak_bf16_tflops > 100 and spec.hbm_gib >= 32
        assert spec.scaleup_domain_size % spec.accelerators_per_node == 0
    assert get_accelerator("P800").scaleup_domain_size == 32
    assert get_accelerator("h100").name == "H100"  # case-insensitive
    assert get_accelerator("H200").hbm_gib > get_accelerator("H100").hbm_gib
    assert not get_accelerator("A100").supports_fp8
    assert get_accelerator("A100").peak_tflops("fp8_tensorwise") == get_accelerator("A100").peak_bf16_tflops
    assert get_accelerator("H100").peak_tflops("fp8") == get_accelerator("H100").peak_fp8_tflops > 1900


def test_unknown_accelerator_names_value_and_fix():
    with pytest.raises(UnknownAcceleratorError) as err:
        get_accelerator("H1OO")
    msg = str(err.value)
    assert "'H1OO'" in msg and "Fix" in msg and "H100" in msg
    assert isinstance(err.value, ValueError)


def test_label_round_trip_for_every_catalogue_type():
    for name in CATALOGUE:
        fleet = build_topology(num_nodes=5, accelerator=name, num_racks=2)
        for node in fleet.nodes:
            back = NodeTopology.from_labels(node.to_labels())
            assert back == node
        rebuilt = FleetTopology.from_ray_nodes(
            [{"NodeID": f"id{i}", "Alive": True, "Labels": n.to_labels()} for i, n in enumerate(fleet.nodes)])
        assert rebuilt == fleet
        assert [n.ray_node_id for n in rebuilt.nodes] == [f"id{i}" for i in range(5)]


def test_from_ray_nodes_skips_dead_and_unlabeled_nodes():
    node = build_topology(num_nodes=1).nodes[0]
    entries = [{"NodeID": "a", "Alive": False, "Labels": node.to_labels()},
               {"NodeID": "b", "Alive": True, "Labels": {"ray.io/node-id": "b"}}]
    assert FleetTopology.from_ray_nodes(entries).nodes == ()
    assert len(FleetTopology.from_ray_nodes(entries, alive_only=False).nodes) == 1


def test_rails_domains_racks():
    fleet = build_topology(num_nodes=4, accelerator="H100", num_racks=2)
    rails = fleet.rails()
    assert sorted(rails) == list(range(8))
    assert all(len(slots) == 4 for slots in rails.values())
    assert all({s.index for s in slots} == {rail} for rail, slots in rails.items())
    assert {k: len(v) for k, v in fleet.racks().items()} == {"r00": 2, "r01": 2}
    # 8-GPU servers: the NVLink domain is the server itself.
    assert len(fleet.nvlink_domains()) == 4
    a, b = fleet.node("n0000").slots[0], fleet.node("n0000").slots[7]
    assert fleet.same_domain(a, b) and not fleet.same_domain(a, fleet.node("n0001").slots[0])
    assert fleet.node("n0000").role == "head" and fleet.node("n0003").role == "worker"


def test_superpod_domains_group_four_p800_servers_and_never_span_racks():
    fleet = build_topology(num_nodes=8, accelerator="P800", num_racks=1)
    domains = fleet.nvlink_domains()
    assert [len(v) for v in domains.values()] == [4, 4]
    assert all(sum(n.num_accelerators for n in v) == 32 for v in domains.values())
    split = build_topology(num_nodes=6, accelerator="P800", num_racks=2)
    for nodes in split.nvlink_domains().values():
        assert len({n.rack for n in nodes}) == 1


def test_mixed_fleet():
    fleet = build_topology(num_nodes=4, accelerator="H100:2,P800:2")
    assert fleet.accelerator_types() == {"H100": 16, "P800": 16}
    assert parse_accelerator_mix("H100:2, 910B:1") == [("H100", 2), ("910B", 1)]
    p800 = fleet.node("n0002")
    assert p800.to_resources()["XPU"] == 8 and "GPU" not in p800.to_resources()
    assert fleet.node("n0000").to_resources()[L.slot_resource(7)] == 1


@pytest.mark.parametrize("kwargs, field", [
    ({"num_nodes": -1}, "nodes"),
    ({"num_nodes": 0}, "nodes"),
    ({"num_nodes": 2, "num_racks": 0}, "racks"),
    ({"num_nodes": 3, "accelerator": "H100:2,P800:2"}, "accelerator"),
    ({"num_nodes": 2, "accelerator": "H100:x"}, "accelerator"),
    ({"num_nodes": 2, "accelerators_per_node": -8}, "accelerators_per_node"),
])
def test_bad_fleet_shapes_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as err:
        build_topology(**kwargs)
    assert err.value.field == field and "Fix" in str(err.value)


def test_bad_labels_are_rejected_with_the_value_and_fix():
    with pytest.raises(LabelError, match="'rack 1'.*Fix"):
        L.validate_label(L.RACK, "rack 1")
    with pytest.raises(LabelError, match="Fix"):
        L.validate_label("Bad_Prefix!/x", "v")
    with pytest.raises(LabelError, match="no '='"):
        L.parse_label_string("rayfleet.io/rack")
    labels = build_topology(num_nodes=1).nodes[0].to_labels()
    labels.pop(L.RACK)
    with pytest.raises(LabelError, match="rayfleet.io/rack"):
        NodeTopology.from_labels(labels)
    labels = build_topology(num_nodes=1).nodes[0].to_labels() | {L.NUM_ACCELERATORS: "eight"}
    with pytest.raises(LabelError, match="'eight'"):
        NodeTopology.from_labels(labels)


def test_label_string_round_trip():
    labels = build_topology(num_nodes=1).nodes[0].to_labels()
    assert L.parse_label_string(L.format_label_string(labels)) == labels


def test_duplicate_node_names_are_rejected():
    node = build_topology(num_nodes=1).nodes[0]
    with pytest.raises(LabelError, match="more than once"):
        FleetTopology((node, node))


def test_errors_pickle_with_their_fields():
    import pickle

    err = SpecError("nodes", -1, "why", "fix")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, RayfleetError) and back.field == "nodes" and str(back) == str(err)
