"""The elastic policy (pure): formation sizes, when a running formation must end, what follows it."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.elastic.policy import (
    CapacityShortage, attribute_lent, DriverState, EndKind, FormationEnd, after_formation, choose_world_size, replica_slots, size_formation,
    watch_formation,
)
from rayfleet.jobs.planning import plan_inputs
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import TrainJob, train_job
from rayfleet.jobs.train_launcher import prepare_formation, prepare_launch
from rayfleet.platform.topology import AcceleratorSlot, FleetTopology, NodeTopology


@pytest.mark.parametrize("free, lo, hi, replica, expected", [
    (8, 2, 4, 1, 4),  # capped at max_workers
    (3, 2, 4, 1, 3),  # a node lost: shrink to what is left
    (7, 2, 8, 2, 6),  # whole model replicas only (tp*pp = 2)
    (1, 2, 4, 1, None),  # below the gang minimum: no formation
    (5, 6, 8, 2, None),
    (0, 1, 4, 1, None),
])
def test_choose_world_size(free, lo, hi, replica, expected) -> None:
    assert choose_world_size(free, min_workers=lo, max_workers=hi, replica_size=replica) == expected


def fleet(*sizes: int) -> FleetTopology:
    return FleetTopology(tuple(NodeTopology(name=f"n{i}", accelerator_type="H100", num_accelerators=n, rack="r0",
                                            block="b0", nvlink_domain=f"nvl{i}") for i, n in enumerate(sizes)))


@pytest.fixture()
def elastic_spec(job_dict) -> TrainJob:
    return train_job(TrainJobSpec.model_validate({**job_dict, "resources": {
        "accelerator": "H100", "elastic": {"min_workers": 2, "max_workers": 4}}}))


def test_size_formation_takes_the_largest_size_the_free_fleet_holds(elastic_spec) -> None:
    launch = size_formation(elastic_spec, (fleet(2, 2), set(), set()), prepare=prepare_formation)
    assert launch.layout.world_size == 4
    # one node's accelerators held by other work, one cordoned: what is left
    launch = size_formation(elastic_spec, (fleet(2, 2, 2), {AcceleratorSlot("n0", 0)}, {"n1"}), prepare=prepare_formation)
    assert launch.layout.world_size == 3 and "n1" not in launch.layout.nodes()


def test_size_formation_plans_around_lent_slots_and_the_autoscalers_target(elastic_spec) -> None:
    lent = (AcceleratorSlot("n1", 0), AcceleratorSlot("n1", 1))
    launch = size_formation(elastic_spec, (fleet(2, 2), set(), set()), prepare=prepare_formation, lent=lent)
    assert launch.layout.world_size == 2 and set(launch.layout.nodes()) == {"n0"}
    assert size_formation(elastic_spec, (fleet(2, 2), set(), set()), prepare=prepare_formation,
                          max_size=2).layout.world_size == 2


def test_size_formation_retries_smaller_when_a_size_does_not_plan(elastic_spec) -> None:
    tried = []

    def prepare(job, topology, *, world_size, held, cordoned):
        tried.append(world_size)
        if world_size == 4:  # e.g. the batch does not split over 4 replicas
            raise SpecError("global_batch_size", 6, "does not split over 4 replicas", "use a multiple of 4")
        return prepare_formation(job, topology, world_size=world_size, held=held, cordoned=cordoned)

    assert size_formation(elastic_spec, (fleet(4), set(), set()), prepare=prepare).layout.world_size == 3
    assert tried == [4, 3]


def test_size_formation_names_the_field_when_not_even_the_minimum_fits(elastic_spec) -> None:
    with pytest.raises(CapacityShortage, match="resources.elastic.min_workers.*minimum formation.*1 free H100"):
        size_formation(elastic_spec, (fleet(1), set(), set()), prepare=prepare_formation)


def test_a_plan_that_fails_at_every_size_is_not_a_capacity_shortage(elastic_spec) -> None:
    def prepare(job, topology, *, world_size, held, cordoned):
        raise SpecError("global_batch_size", 5, "does not split", "use a multiple")

    with pytest.raises(SpecError, match="minimum formation.*global_batch_size") as err:
        size_formation(elastic_spec, (fleet(4), set(), set()), prepare=prepare)
    assert not isinstance(err.value, CapacityShortage)  # the driver does not wait this one out


def test_a_capacity_shortage_survives_pickling_as_itself() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(CapacityShortage("resources.elastic.min_workers", 2, "too few", "add some")))
    assert isinstance(err, CapacityShortage) and err.field == "resources.elastic.min_workers" and err.value == 2


def test_a_placed_loan_is_not_counted_twice() -> None:
    """One node of 4: Serve's own replica and a borrower run (Ray: 2 taken, marked on slots 3, 2);
    the borrower's lent slot is 0. Counted twice the job sees 1 free; attributed, 2."""
    topology = fleet(4)
    slot = lambda i: AcceleratorSlot("n0", i)  # noqa: E731
    ray_marked = {slot(3), slot(2)}
    assert attribute_lent(topology, ray_marked, {slot(0)}) == {slot(0), slot(3)}
    assert attribute_lent(topology, ray_marked, ()) == ray_marked  # nothing placed: Ray's marks stand
    # a placed loan Ray no longer counts (its borrower went): never more marks than Ray's count
    assert attribute_lent(topology, {slot(3)}, {slot(0), slot(1)}) == {slot(0)}
    # slots of nodes the topology does not know pass through
    assert AcceleratorSlot("zz", 0) in attribute_lent(topology, {AcceleratorSlot("zz", 0)}, ())


def test_size_formation_counts_a_placed_loan_once(job_dict) -> None:
    spec = train_job(TrainJobSpec.model_validate({**job_dict, "resources": {
        "accelerator": "H100", "elastic": {"min_workers": 2, "max_workers": 3}}}))
    slot = lambda i: AcceleratorSlot("n0", i)  # noqa: E731
    observed = (fleet(4), {slot(3), slot(2)}, set())  # Serve's replica + the placed borrower of slot 0
    with pytest.raises(CapacityShortage):  # counted twice: 4 - {3, 2, 0} = 1 free, below the minimum
        size_formation(spec, observed, prepare=prepare_formation, lent=(slot(0),))
    launch = size_formation(spec, observed, prepare=prepare_formation, lent=(slot(0),), lent_placed=(slot(0),))
    assert launch.layout.world_size == 2 and not {slot(0), slot(3)} & set(launch.layout.rank_to_slot)


def test_replica_slots_groups_ranks_by_their_dp_coordinate(job_dict) -> None:
    spec = TrainJobSpec.model_validate({**job_dict, "plan": {"dp": 2, "tp": 2},
                                        "resources": {"accelerator": "H100", "num_workers": 4}})
    launch = prepare_launch(plan_inputs(spec), fleet(2, 2), name=spec.name)
    slots = replica_slots(launch.layout)
    assert [len(r) for r in slots] == [2, 2]
    assert sorted(s for r in slots for s in r) == sorted(launch.layout.rank_to_slot)
    assert all(len({s.node for s in r}) == 1 for r in slots)  # a TP pair stays on one node


@pytest.mark.parametrize("alive, size, free, grows, expected", [
    ({"n0", "n1"}, 4, 4, True, None),  # nothing changed
    ({"n0"}, 4, 4, True, EndKind.NODE_LOST),
    ({"n0"}, 4, 0, False, EndKind.NODE_LOST),  # node loss ends it even when growth is not its call
    ({"n0", "n1", "n2"}, 4, 6, True, EndKind.GROW),
    ({"n0", "n1", "n2"}, 4, 6, False, None),  # the shared autoscaler decides growth
    ({"n0", "n1", "n2"}, 4, 5, True, None),  # 5 free, replicas of 2: still 4
    ({"n0", "n1", "n2"}, 6, 8, True, None),  # already at max_workers: the fleet is not looked at
])
def test_watch_formation(alive, size, free, grows, expected) -> None:
    calls = []

    def free_if_regrown():
        calls.append(1)
        return free

    end = watch_formation(layout_nodes=("n0", "n1"), alive_nodes=alive, size=size, min_workers=2,
                          max_workers=6, replica_size=2, free_if_regrown=free_if_regrown if grows else None)
    assert (end.kind if end else None) == expected
    if expected is EndKind.NODE_LOST:
        assert "n1" in end.detail and not calls  # the fleet is not even looked at
    if size == 6:
        assert not calls


@pytest.mark.parametrize("step, end, resized, failed, expected", [
    (24, None, False, False, DriverState.FINISHED),
    (24, FormationEnd(EndKind.GROW, "bigger"), True, False, DriverState.FINISHED),  # a resize with the last step is moot
    (10, FormationEnd(EndKind.GROW, "bigger"), False, False, DriverState.RESIZING),
    (10, None, True, False, DriverState.RESIZING),  # the autoscaler stopped it
    (10, FormationEnd(EndKind.NODE_LOST, "n1 died"), False, True, DriverState.RECOVERING),
    (10, None, False, True, DriverState.ERRORED),  # a failure nobody caused: the job fails
    (10, FormationEnd(EndKind.GROW, "bigger"), False, True, DriverState.ERRORED),
])
def test_after_formation(step, end, resized, failed, expected) -> None:
    assert after_formation(step=step, steps=24, end=end, resized=resized, failed=failed)[0] is expected


def test_slots_in_use_follow_live_free_counts():
    from rayfleet.jobs.elastic.policy import free_accelerators, slots_in_use
    from rayfleet.platform.topology import FleetTopology, NodeTopology

    topo = FleetTopology(tuple(NodeTopology(name=f"n{i}", accelerator_type="H100", num_accelerators=2, rack="r0",
                                            block="b0", nvlink_domain=f"nvl{i}") for i in range(3)))
    # n0: a Serve replica holds one accelerator; n1: all free; n2: no live count (taken as free)
    held = slots_in_use(topo, {"n0": 1, "n1": 2})
    assert {(s.node, s.index) for s in held} == {("n0", 1)}
    assert free_accelerators(topo, accelerator="H100", held=held, cordoned=set()) == 5
    # a node reporting more free than it has, or a negative count, never marks or frees extra slots
    assert slots_in_use(topo, {"n0": 5}) == set()
    assert len(slots_in_use(topo, {"n0": -1})) == 2
