"""Unit tests run without Ray: this guard fails any test that leaves a Ray runtime behind."""

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_ray_runtime():
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("a unit test started Ray; move it to tests/cluster")
