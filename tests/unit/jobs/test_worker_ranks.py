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


def test_the_job_log_names_a_re_rank_and_says_nothing_when_ray_already_had_the_layouts_order():
    from rayfleet.jobs.worker_ranks import RankAssignment, rerank_note

    assert rerank_note(RankAssignment((0, 1, 2, 3), rail_matches=4)) is None
    note = rerank_note(RankAssignment((2, 3, 0, 1), rail_matches=4))
    assert "re-formed" in note and "0->2, 1->3, 2->0, 3->1" in note and "4/4 workers on their planned rail" in note


def test_the_driver_logs_rank0s_re_rank_note_once_and_keeps_it_out_of_the_metrics_line():
    from rayfleet.jobs.train_launcher import _MetricsPrinter
    from rayfleet.jobs.worker_ranks import RankAssignment, rerank_note

    lines: list[str] = []
    printer = _MetricsPrinter(control=None, log=lines.append, on_step=None)
    note = rerank_note(RankAssignment((1, 0), rail_matches=2))
    printer._show({"step": 1, "loss": 5.0, "rank_note": note})
    printer._show({"step": 2, "loss": 4.9})
    assert lines[0] == note and "rank_note" not in lines[1] and "rank_note" not in printer.last
    assert [line.startswith("RAYFLEET_METRICS") for line in lines] == [False, True, True]
