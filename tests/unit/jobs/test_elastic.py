"""The elastic size rule (pure): the largest formation the free accelerators hold."""

from __future__ import annotations

import pytest

from rayfleet.jobs.elastic import choose_world_size


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
