"""One local fleet for the whole test session (never ``ray.init()`` per test).

4 nodes x 8 fake H100 in 2 racks, started by the same launcher as ``rayfleet up``, with the
fleet controller and node agents running. Tests that change the fleet (cordons, injected faults,
killed nodes) must put it back as they found it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from live_helpers import stdlib_json_tokens, wait_until  # noqa: F401 - wait_until: the tier's modules import it from here

NUM_NODES = 4


@dataclass
class FleetHandle:
    fleet: object  # rayfleet.platform.launcher.LocalFleet
    sdk: object  # rayfleet.sdk.Fleet
    topology: object  # FleetTopology of the live fleet, ray_node_id filled
    address: str
    dashboard_url: str


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """The token dataset every training job of this tier reads (made once per session)."""
    return stdlib_json_tokens(tmp_path_factory)


@pytest.fixture(scope="session")
def local_fleet(tmp_path_factory):
    import ray

    from rayfleet.platform.launcher import LocalFleet
    from rayfleet.platform.topology import FleetTopology, build_topology
    from rayfleet.sdk import connect

    topology = build_topology(num_nodes=NUM_NODES, accelerator="H100", accelerators_per_node=8, num_racks=2)
    fleet = LocalFleet.up(topology, home=tmp_path_factory.mktemp("rayfleet-home"))
    try:
        sdk = connect(fleet.address)
        wait_until(lambda: len(sdk.status().nodes) == NUM_NODES
                   and all(r.health == "healthy" for r in sdk.status().nodes),
                   timeout_s=90, what="all node agents to report healthy")
        live = FleetTopology.from_ray_nodes(ray.nodes())
        yield FleetHandle(fleet=fleet, sdk=sdk, topology=live, address=fleet.address,
                          dashboard_url=fleet.dashboard_url)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        fleet.down()


def local_reference(spec: dict) -> tuple[dict[int, float], dict[int, int]]:
    """The uninterrupted run of ``spec`` (without its checkpoint section) on local gloo processes
    forked from the fork server, with the plan the fleet resolves for it: the same ``train_worker``
    step code as the job's Ray Train workers, without a second Ray job's start (a Ray Train
    controller, its actors and fresh workers: about 40 s of CPU on 2 cores). Returns rank 0's
    (losses by step, sample-id hashes by step)."""
    from rayfleet.jobs.local_processes import run_local
    from rayfleet.jobs.planning import validate_job
    from rayfleet.jobs.spec import TrainJobSpec

    parsed = TrainJobSpec.model_validate({**spec, "checkpoint": None})
    summary = run_local(parsed, validate_job(parsed).plan).summaries[0]
    return (dict(enumerate(summary.losses, start=1)), dict(enumerate(summary.sample_ids_hashes, start=1)))


# Modules that add nodes and then kill them run last, in this order: the controller rightly
# keeps a killed node in its inventory (as lost) and Ray lists it as dead, which the fleet
# tests' exact node lists must not see.
_RUN_LAST = ("test_serving_mixed.py", "test_training.py")  # the first adds a P800 node


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.path.name
        return _RUN_LAST.index(name) + 1 if name in _RUN_LAST else 0

    items.sort(key=rank)  # stable: every other test keeps its place
