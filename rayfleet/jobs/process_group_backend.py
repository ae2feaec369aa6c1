"""Ray Train's backend for rayfleet jobs: the workers' default torch process group, with no torch
in the processes that only drive the run.

Ray's ``TorchConfig`` does the same set-up but its module imports torch at the top, and both the
job's driver (building the trainer) and Ray Train's controller (unpickling the trainer's backend
config, then running the backend's hooks) load it: about 2 s of CPU each per job start on a
2-core host, for processes that never touch a tensor. Here the config and the hooks are plain
Ray code; torch is imported only inside the functions the hooks run on the workers.

What the workers get is what ``TorchConfig(backend=...)`` gives them: ``MASTER_ADDR`` /
``MASTER_PORT`` (worker 0's address and the rendezvous port there), the torchrun variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), and a default group over ``backend``; at
shutdown each destroys it. The loop then re-forms it with layout ranks
(``worker_ranks.rerank_process_group``).

One difference: the port. ``TorchConfig`` (and this backend at first) probed a free port on worker
0, closed it and let ``init_process_group("env://")`` bind it again later; in that window any
process on the host may take it. Two integration tests side by side lost a training job to it
(``EADDRINUSE`` on the rendezvous port, with three jobs starting at once). Worker 0 now hosts the
store on a port the OS gives it (``platform.rendezvous.host_store``) and only that listening
port is handed out; the other workers join it as clients.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend, BackendConfig

__all__ = ["ProcessGroupConfig", "ProcessGroupBackend"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0
"""How long the controller waits for the workers to destroy their groups (Ray's default too)."""


@dataclass
class ProcessGroupConfig(BackendConfig):
    """``backend``: the torch.distributed backend of the workers' default group (``gloo`` works
    on every fleet, fake-GPU local fleets included); ``timeout_s``: its collectives' timeout."""

    backend: str = "gloo"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        from rayfleet.errors import SpecError

        if self.backend not in ("gloo", "nccl"):
            raise SpecError("process_group.backend", self.backend, "is not a torch.distributed backend rayfleet runs",
                            "use 'gloo' (any fleet) or 'nccl' (CUDA workers)")
        if self.timeout_s <= 0:
            raise SpecError("process_group.timeout_s", self.timeout_s, "must be positive", "use e.g. 1800")

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def framework(self):
        from rayfleet.platform.ray_compat import torch_training_framework

        return torch_training_framework()

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class ProcessGroupBackend(Backend):
    """Runs in Ray Train's controller: each hook runs functions on the worker group."""

    share_cuda_visible_devices: bool = True  # as Ray's torch backend: NCCL needs every local GPU visible

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        import ray

        world = len(worker_group)
        addr, port = worker_group.execute_single(0, _host_rendezvous, world_size=world,
                                                 timeout_s=backend_config.timeout_s)
        worker_group.execute(_set_rendezvous_env, addr=addr, port=port)
        # (keyword names that ``execute_single_async(rank, fn, ...)`` does not take itself)
        ray.get([worker_group.execute_single_async(rank, _init_default_group, group_backend=backend_config.backend,
                                                   group_rank=rank, world_size=world, timeout_s=backend_config.timeout_s)
                 for rank in range(world)])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        futures = worker_group.execute_async(_destroy_default_group)
        try:
            ray.get(futures, timeout=SHUTDOWN_TIMEOUT_S)
        except GetTimeoutError:
            logger.warning("rayfleet: the workers' process groups were not destroyed within %.0f s",
                           SHUTDOWN_TIMEOUT_S)


# On the workers -------------------------------------------------------------------------------

_hosted_store: Any = None
"""Worker 0's rendezvous store (a listening ``TCPStore``), kept alive until its group is destroyed."""


def _host_rendezvous(*, world_size: int, timeout_s: float) -> tuple[str, int]:
    """On worker 0: host the group's store on a port the OS chose; returns (node address, port)."""
    global _hosted_store

    import ray

    from rayfleet.platform.rendezvous import host_store

    addr = ray.util.get_node_ip_address()
    _hosted_store = host_store(world_size, host=addr, timeout_s=timeout_s)
    return addr, _hosted_store.port


def _set_rendezvous_env(addr: str, port: int) -> None:
    """The rendezvous address and torchrun's variables, from Ray Train's context of this worker."""
    import ray.train

    context = ray.train.get_context()
    os.environ.update({
        "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "RANK": str(context.get_world_rank()), "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_RANK": str(context.get_local_rank()), "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "NODE_RANK": str(context.get_node_rank()),
    })


def _init_default_group(*, group_backend: str, group_rank: int, world_size: int, timeout_s: int) -> None:
    from rayfleet.platform.rendezvous import join_group

    if group_backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        # fail a timed-out collective instead of hanging (as Ray's torch backend does)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # rank 0 is worker 0, which hosts the store: it uses it; the others dial in
    join_group(group_backend, host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), rank=group_rank,
               world_size=world_size, timeout_s=timeout_s, store=_hosted_store if group_rank == 0 else None)


def _destroy_default_group() -> None:
    global _hosted_store

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _hosted_store = None
