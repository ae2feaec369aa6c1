"""Layout-rank assignment for Ray Train workers (pure)."""

import pytest

from rayfleet.jobs.worker_ranks import PlacementMismatchError, WorkerPlace, assign_layout_ranks


def _w(ray_rank, node, index):
    return WorkerPlace(ray_rank=ray_rank, node=node, accelerator_index=index, host="127.0.0.1")


def test_pairs_ranks_with_workers_in_rail_order():
    # Layout: ranks 0,1 on node b (slots 0,1), ranks 2,3 on node a (slots 0,1).
    layout = [("b", 0), ("b", 1), ("a", 0), ("a", 1)]
    # Ray sorted by node id then GPU id: a's workers first.
    workers = [_w(0, "a", 0), _w(1, "a", 1), _w(2, "b", 0), _w(3, "b", 1)]
    got = assign_layout_ranks(workers, layout)
    assert got.layout_rank_of == (2, 3, 0, 1)
    assert got.rail_matches == 4


def test_rail_mismatch_is_counted_not_hidden():
    layout = [("a", 2), ("a", 5)]
    workers = [_w(0, "a", 0), _w(1, "a", 1)]
    got = assign_layout_ranks(workers, layout)
    assert got.layout_rank_of == (0, 1)
    assert got.rail_matches == 0


def test_wrong_node_counts_raise():
    layout = [("a", 0), ("b", 0)]
    workers = [_w(0, "a", 0), _w(1, "a", 1)]
    with pytest.raises(PlacementMismatchError, match="layout needs"):
        assign_layout_ranks(workers, layout)
