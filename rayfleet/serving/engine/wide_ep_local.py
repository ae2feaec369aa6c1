"""A wide-EP gang on local processes: torch.multiprocessing + gloo, no Ray.

Design decisions:
- The same ``WideEPRank`` code runs here and (later) inside Ray actors; only the transport of
  its two messages differs. Here every rank is a spawned process with an inbox and an outbox
  (``torch.multiprocessing`` queues, so tensors travel through shared memory) and a gloo
  process group on 127.0.0.1, like ``jobs.local_processes`` does for training.
- ``LocalGang.step`` sends every rank its command, then waits for every report: the ranks step
  in lockstep because the front sends one command per rank per step.
- A rank that raises sends its traceback and exits; the front raises ``GangError`` naming the
  rank (it also notices a rank that died without a word). The gloo group has a finite timeout
  so the surviving ranks exit instead of waiting forever in a collective.
- Each rank uses ``threads_per_rank`` intra-op threads, so a gang on a small machine does not
  oversubscribe its cores.
- ``backend="nccl"`` puts rank r on ``cuda:r`` (one GPU per rank; NCCL refuses two ranks on
  one GPU). Written for GPU hosts but not yet run on one: the development machines have no GPU.
"""

from __future__ import annotations

import queue
import traceback
from typing import Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayfleet.platform.rendezvous import host_store, join_group
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.wide_ep_rank import ModelRecipe, StepCommand, StepReport, WideEPRank
from rayfleet.serving.experts.eplb import ExpertPlacement

__all__ = ["GangError", "LocalGang"]


class GangError(RuntimeError):
    """A rank of the gang failed; the message names it and carries its traceback."""


def _rank_main(rank: int, num_ranks: int, port: int, recipe: ModelRecipe, engine_config: EngineConfig,
               placement: ExpertPlacement, routing: str, misroute: bool, threads: int, timeout_s: float,
               backend: str, inbox, outbox) -> None:
    torch.set_num_threads(threads)
    device = "cpu" if backend == "gloo" else f"cuda:{rank}"
    try:
        if device != "cpu":
            torch.cuda.set_device(device)
        join_group(backend, host="127.0.0.1", port=port, rank=rank, world_size=num_ranks, timeout_s=timeout_s)
        worker = WideEPRank(rank=rank, num_ranks=num_ranks, group=dist.group.WORLD, recipe=recipe,
                            engine_config=engine_config, placement=placement, routing=routing, misroute=misroute,
                            device=device)
        outbox.put(("ready", rank))
        while (command := inbox.get()) is not None:
            outbox.put(("report", worker.step(command)))
        dist.barrier()  # no rank closes its connections while a peer still finishes an exchange
    except Exception:  # noqa: BLE001 - reported to the front, which raises GangError
        outbox.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class LocalGang:
    """``num_ranks`` spawned rank processes; ``step`` drives them together, ``close`` ends them."""

    def __init__(self, *, num_ranks: int, recipe: ModelRecipe, engine_config: EngineConfig,
                 placement: ExpertPlacement, routing: Literal["balanced", "even"] = "balanced",
                 misroute: bool = False, threads_per_rank: int = 1, timeout_s: float = 120.0,
                 backend: Literal["gloo", "nccl"] = "gloo") -> None:
        self.num_ranks, self.timeout_s = num_ranks, timeout_s
        ctx = mp.get_context("spawn")
        # the gang's rendezvous, listening before its port is handed out; held until close()
        self._store = host_store(num_ranks, timeout_s=timeout_s)
        port = self._store.port
        self.inboxes = [ctx.Queue() for _ in range(num_ranks)]
        self.outboxes = [ctx.Queue() for _ in range(num_ranks)]
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(r, num_ranks, port, recipe, engine_config, placement, routing, misroute,
                                        threads_per_rank, timeout_s, backend, self.inboxes[r], self.outboxes[r]))
                      for r in range(num_ranks)]
        for proc in self.procs:
            proc.start()
        try:
            for r in range(num_ranks):
                self._receive(r, "ready")
        except BaseException:
            self.close()
            raise

    def _receive(self, rank: int, kind: str):
        waited = 0.0
        while True:
            try:
                got_kind, payload = self.outboxes[rank].get(timeout=1.0)
                break
            except queue.Empty:
                waited += 1.0
                if not self.procs[rank].is_alive():
                    raise GangError(f"rank {rank} exited (code {self.procs[rank].exitcode}) without a report")
                if waited > self.timeout_s:
                    raise GangError(f"rank {rank} sent nothing for {self.timeout_s:.0f} s")
        if got_kind == "error":
            raise GangError(payload)
        assert got_kind == kind, (got_kind, kind)
        return payload

    def step(self, commands: list[StepCommand]) -> list[StepReport]:
        """One lockstep step: ``commands[r]`` to rank r; every rank's report, in rank order."""
        assert len(commands) == self.num_ranks
        for inbox, command in zip(self.inboxes, commands):
            inbox.put(command)
        return [self._receive(r, "report") for r in range(self.num_ranks)]

    def close(self) -> None:
        for proc, inbox in zip(self.procs, self.inboxes):
            if proc.is_alive():
                inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():  # a rank stuck in a collective after a peer failed
                proc.kill()
                proc.join(timeout=5)
        self._store = None

    def __enter__(self) -> "LocalGang":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
