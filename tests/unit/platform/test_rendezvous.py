"""The held-port rendezvous: the store listens before its port is handed out, and ranks join it.

The single-process tests check that no other socket can take a hosted store's port while the
store lives (the race a free-port probe leaves open: CI lost a three-rank test to it) and that
the port is free again once the store is gone. The three-rank test (this file is also the ranks'
script) joins through :func:`agent_store_env` (``env://``, the way ``run_script_ranks`` starts
ranks), then runs :func:`rerank_process_group` with a layout that reverses Ray's order, so the
worker that becomes rank 0 hosts the new group's store and broadcasts its port.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


def test_a_hosted_stores_port_cannot_be_taken_while_it_lives_and_is_free_after() -> None:
    from rayfleet.platform.rendezvous import agent_store_env, host_store

    store = host_store(2)
    port = store.port
    assert port > 0
    assert agent_store_env(store) == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                      "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as taken:
            probe.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    import gc

    gc.collect()
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # released with the store


def _rank_main(out_dir: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from rayfleet.jobs import worker_ranks
    from rayfleet.jobs.local_processes import leave_after_barrier

    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    dist.init_process_group("gloo")  # env://: every rank a client of the launcher's store
    ray_rank, world = dist.get_rank(), dist.get_world_size()
    # What Ray would supply: this worker's accelerator index and host. Reversed against Ray's
    # order, so every worker but the middle one changes rank and the last one becomes rank 0.
    worker_ranks._local_accelerator_index = lambda: world - 1 - ray_rank
    worker_ranks._node_ip = lambda: "127.0.0.1"
    assignment = worker_ranks.rerank_process_group([("n", i) for i in range(world)], node="n", backend="gloo",
                                                   timeout_s=60)
    seen = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(seen, torch.tensor([ray_rank]))
    Path(out_dir, f"ray{ray_rank}.json").write_text(json.dumps({
        "layout_rank_of": list(assignment.layout_rank_of), "new_rank": dist.get_rank(),
        "ray_rank_of_new_rank": [int(t) for t in seen]}))
    leave_after_barrier()


def test_three_ranks_join_a_hosted_store_and_rerank_through_the_new_rank0s_store(tmp_path) -> None:
    from rayfleet.jobs.local_processes import run_script_ranks

    run_script_ranks(str(HERE), [str(tmp_path)], 3, timeout_s=120)
    reports = [json.loads((tmp_path / f"ray{r}.json").read_text()) for r in range(3)]
    for ray_rank, report in enumerate(reports):
        assert report["layout_rank_of"] == [2, 1, 0]
        assert report["new_rank"] == 2 - ray_rank
        assert report["ray_rank_of_new_rank"] == [2, 1, 0]  # the new group's rank r is Ray's 2 - r


if __name__ == "__main__":
    _rank_main(sys.argv[1])
