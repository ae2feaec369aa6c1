"""A launch whose DP replicas mix accelerator kinds holds them through a reservation group (pure part)."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import TrainJob, train_job
from rayfleet.jobs.train_launcher import RESERVATION_PREFIX, prepare_formation, reservation_bundles, scaling_options
from rayfleet.platform import labels as L
from rayfleet.platform.topology import FleetTopology, NodeTopology


def fleet(h100: int, p800: int) -> FleetTopology:
    return FleetTopology((NodeTopology("g0", "H100", h100, "r0", "b0", "nvl-g0"),
                          NodeTopology("x0", "P800", p800, "r0", "b0", "nvl-x0")))


def spec(job_dict, **plan) -> TrainJob:
    return train_job(TrainJobSpec.model_validate({**job_dict, "name": "mixed", "plan": {"dp": 2, **plan},
                                                  "resources": {"accelerator": "H100", "num_workers": 2}}))


def test_a_mixed_launch_reserves_each_ranks_accelerator_on_its_node(job_dict):
    launch = prepare_formation(spec(job_dict, replica_accelerators=["H100", "P800"]), fleet(1, 1))
    assert launch.layout.rank_to_accelerator == ("H100", "P800")
    assert reservation_bundles(launch) == [({"GPU": 1.0}, {L.NODE: "g0"}), ({"XPU": 1.0}, {L.NODE: "x0"})]
    # the workers themselves ask for no accelerator (Ray Train gives all workers the same resources)
    # but for a sliver of CPU: Ray refuses a worker group whose bundles are all zeros (regression)
    resources = scaling_options(launch)["resources_per_worker"]
    assert set(resources) == {"CPU"} and resources["CPU"] > 0
    assert RESERVATION_PREFIX + launch.name == "rayfleet:train:mixed"


def test_a_single_kind_launch_needs_no_reservation(job_dict):
    launch = prepare_formation(spec(job_dict), fleet(2, 2))
    assert reservation_bundles(launch) is None
    assert scaling_options(launch)["resources_per_worker"] == {"GPU": 1.0, "CPU": 0.0}


def test_a_mixed_plan_counts_every_kind_it_names_as_free(job_dict):
    # one H100 alone could not hold two workers; with the P800 it can (regression: only the
    # spec's resources.accelerator used to be counted)
    assert prepare_formation(spec(job_dict, replica_accelerators=["H100", "P800"]), fleet(1, 1)).layout.world_size == 2
    with pytest.raises(SpecError, match="1 free H100 accelerators"):
        prepare_formation(spec(job_dict), fleet(1, 1))
