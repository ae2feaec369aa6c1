"""The a2a hidden fraction is measured from when transfers complete, not when someone waits.

Two real gloo ranks exchange rows through the EP dispatcher's own ``_issue``/``_wait``; rank 1
controls when the transfer can complete (it issues its side late), rank 0 "computes" (sleeps:
wall time on the training thread, what overlap must cover) between issue and wait.

- ``hides``: rank 1 issues 60 ms late while rank 0 computes 150 ms: the whole transfer ran
  under compute, so a positive share (about all of it) is hidden.
- ``cannot``: the overlapped exchange completes at once (rank 1 issued first) and rank 0 then
  computes 150 ms; a blocking exchange follows whose peer is 60 ms late. There was almost no
  communication to hide behind the compute and the blocking one hides nothing: honest ~0. The
  earlier measure (issue -> wait as transfer time) calls the 150 ms of compute hidden
  communication and reports ~0.7: the test checks that it does, to show what it overstated.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


def _rank_main(mode: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from rayfleet.jobs.local_processes import leave_after_barrier
    from rayfleet.jobs.parallel.context import A2AStats
    from rayfleet.models.expert_parallel import _issue, _wait

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    rows = torch.randn(64, 32)
    splits = [32, 32]
    stats = A2AStats()

    def exchange(*, late_s: float, compute_s: float, overlapped: bool) -> None:
        if rank == 1:
            time.sleep(late_s)
        pending = _issue(torch.empty_like(rows), rows, splits, splits, group)
        if rank == 0:
            time.sleep(compute_s)
        _wait(pending, stats if rank == 0 else None, overlapped=overlapped)

    dist.barrier()
    if mode == "hides":
        exchange(late_s=0.06, compute_s=0.15, overlapped=True)
    else:
        if rank == 0:
            time.sleep(0.03)  # rank 1 has issued: the overlapped transfer completes right away
        exchange(late_s=0.0, compute_s=0.15, overlapped=True)
        dist.barrier()
        exchange(late_s=0.06, compute_s=0.0, overlapped=False)
    if rank == 0:
        Path(out_dir, f"{mode}.json").write_text(json.dumps({
            "honest": stats.hidden_fraction(), "issue_to_wait": stats.hidden_fraction_issue_to_wait(),
            "transfer_s": stats.transfer_s, "exposed_s": stats.exposed_s}))
    leave_after_barrier()


def _launch(mode: str, tmp_path) -> dict:
    from rayfleet.jobs.local_processes import run_script_ranks

    run_script_ranks(str(HERE), [mode, str(tmp_path)], 2)
    return json.loads(Path(tmp_path, f"{mode}.json").read_text())


def test_overlap_hides_a_transfer_that_runs_under_compute(tmp_path) -> None:
    got = _launch("hides", tmp_path)
    assert got["transfer_s"] >= 0.04, got  # it really was in flight while rank 0 computed
    assert got["honest"] > 0.8, got


def test_nothing_to_hide_reads_near_zero_where_the_old_measure_said_most(tmp_path) -> None:
    got = _launch("cannot", tmp_path)
    assert got["honest"] < 0.25, got
    assert got["issue_to_wait"] > 0.5, got  # the overstatement this measure replaced


@pytest.mark.parametrize("completed,waited,exposed", [(1.0, 3.0, 0.0), (3.0, 1.0, 2.0), (2.0, 0.0, 2.0)])
def test_record_counts_only_the_blocked_part_of_the_transfer(completed, waited, exposed) -> None:
    from rayfleet.jobs.parallel.context import A2AStats

    stats = A2AStats()
    stats.record(issued=0.0, completed=completed, waited=waited)
    assert stats.transfer_s == completed and stats.exposed_s == exposed


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _rank_main(sys.argv[1], sys.argv[2])
