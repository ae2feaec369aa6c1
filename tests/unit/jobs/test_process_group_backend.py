"""rayfleet's Ray Train backend: what it runs on the workers (that the processes which only drive
a run import no torch is ``tests/unit/test_light_processes.py``).

The backend's group set-up runs live in every training job of the cluster tier; here its hooks
run against a stand-in worker group that calls the functions in this process, in order, so the
ranks and the environment each worker gets are checked without a cluster.
"""

from __future__ import annotations

import os

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.process_group_backend import ProcessGroupBackend, ProcessGroupConfig


class _Context:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def get_world_rank(self): return self.rank  # noqa: E704
    def get_world_size(self): return self.world  # noqa: E704
    def get_local_rank(self): return self.rank  # noqa: E704
    def get_local_world_size(self): return self.world  # noqa: E704
    def get_node_rank(self): return 0  # noqa: E704


class _WorkerGroup:
    """Calls each function as worker ``i`` would, recording (worker, function, kwargs, env)."""

    def __init__(self, world: int, monkeypatch) -> None:
        self.world, self.calls, self.monkeypatch = world, [], monkeypatch

    def __len__(self) -> int:
        return self.world

    def _as_worker(self, i, fn, kwargs):
        import ray.train

        self.monkeypatch.setattr(ray.train, "get_context", lambda: _Context(i, self.world))
        self.calls.append((i, fn.__name__, dict(kwargs)))
        return fn(**kwargs)

    def execute_single(self, i, fn, **kwargs):
        return self._as_worker(i, fn, kwargs)

    def execute(self, fn, **kwargs):
        out = []
        for i in range(self.world):
            out.append(self._as_worker(i, fn, kwargs))
            self.calls[-1] += ({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
                                if k in os.environ},)
        return out

    def execute_single_async(self, i, fn, **kwargs):
        self.calls.append((i, fn.__name__, dict(kwargs)))
        return i

    def execute_async(self, fn, **kwargs):
        return [self.execute_single_async(i, fn, **kwargs) for i in range(self.world)]


def test_on_start_gives_each_worker_its_rank_the_rendezvous_and_one_group_call(monkeypatch):
    import ray

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    monkeypatch.setattr(ray, "get", lambda refs, **_: refs)
    from rayfleet.platform import rendezvous

    hosted = []
    monkeypatch.setattr(rendezvous, "host_store", lambda world, host, timeout_s: hosted.append((world, host, timeout_s))
                        or type("Store", (), {"port": 40123})())
    group = _WorkerGroup(3, monkeypatch)
    ProcessGroupBackend().on_start(group, ProcessGroupConfig(backend="gloo", timeout_s=60))
    names = [c[1] for c in group.calls]
    assert names[0] == "_host_rendezvous" and names[1:4] == ["_set_rendezvous_env"] * 3
    assert group.calls[0][2] == {"world_size": 3, "timeout_s": 60}
    envs = [c[3] for c in group.calls[1:4]]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    # every worker dials the store worker 0 hosts, on the port it listens on
    assert hosted == [(3, "10.1.2.3", 60)]
    assert {e["MASTER_PORT"] for e in envs} == {"40123"} and os.environ["MASTER_ADDR"] == "10.1.2.3"
    inits = group.calls[4:]
    assert [(c[0], c[1]) for c in inits] == [(i, "_init_default_group") for i in range(3)]
    assert [c[2]["group_rank"] for c in inits] == [0, 1, 2]
    assert {(c[2]["group_backend"], c[2]["world_size"], c[2]["timeout_s"]) for c in inits} == {("gloo", 3, 60)}


def test_a_single_process_group_forms_and_is_destroyed(monkeypatch):
    import torch.distributed as dist

    import ray

    from rayfleet.jobs import process_group_backend as pgb

    import socket

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    addr, port = pgb._host_rendezvous(world_size=1, timeout_s=30)
    # the port handed out is already listening (no window in which another process can take it)
    with socket.create_connection((addr, port), timeout=5):
        pass
    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.setenv("MASTER_PORT", str(port))
    pgb._init_default_group(group_backend="gloo", group_rank=0, world_size=1, timeout_s=30)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        pgb._destroy_default_group()
    assert not dist.is_initialized() and pgb._hosted_store is None
    pgb._destroy_default_group()  # nothing to destroy: no error


@pytest.mark.parametrize("field, kwargs", [("process_group.backend", {"backend": "mpi"}),
                                           ("process_group.timeout_s", {"timeout_s": 0})])
def test_bad_config_names_the_field(field, kwargs):
    with pytest.raises(SpecError) as err:
        ProcessGroupConfig(**kwargs)
    assert field in str(err.value)

