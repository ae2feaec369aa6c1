"""Run a training job on local processes with gloo, without Ray (tests, benchmarks, debugging).

Design decisions:
- Same ``train_worker`` as under Ray Train; only the process group comes from
  ``torch.multiprocessing`` spawn on 127.0.0.1 instead of Ray's worker group, so a run here
  and a run on the fleet execute identical step code.
- Results come back through files (``torch.save`` per rank in a temp dir): spawn has no return
  values, and a file also survives a rank that raises after some steps.
- ``world_size == 1`` runs in the calling process (a gloo group of one) unless asked
  otherwise: no spawn cost for single-process references.
- Each worker uses ``threads_per_rank`` intra-op threads so several ranks on a small machine do
  not oversubscribe its cores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import LoopConfig, loop_config
from rayfleet.jobs.train_state import TrainHooks, TrainSummary
from rayfleet.placement.plan import ParallelPlan

__all__ = ["LocalRunResult", "run_local", "run_local_many", "free_port", "run_script_ranks", "leave_after_barrier"]


@dataclass(frozen=True)
class LocalRunResult:
    """Per-rank summaries and metric dicts of a local run (index = rank)."""

    summaries: tuple[TrainSummary, ...]
    metrics: tuple[tuple[dict[str, Any], ...], ...]

    @property
    def losses(self) -> tuple[float, ...]:
        return self.summaries[0].losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, loop: LoopConfig, runs: list[tuple[ParallelPlan, dict]],
            out_dir: str, threads_per_rank: int, hooks: TrainHooks | None) -> None:
    from rayfleet.jobs.loop import train_worker

    torch.set_num_threads(threads_per_rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for index, (plan, options) in enumerate(runs):
            collected: list[dict[str, Any]] = []
            options = {"device": "cpu", **options}
            summary = train_worker(loop, plan, report=collected.append, hooks=hooks, **options)
            torch.save({"summary": summary, "metrics": collected}, os.path.join(out_dir, f"run{index}-rank{rank}.pt"))
        # No rank tears its connections down while a peer still completes its last exchange
        # (gloo aborts the peer's process when a connection closes under an in-flight send).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_local(spec: TrainJobSpec, plan: ParallelPlan, *, threads_per_rank: int = 1, in_process: bool | None = None,
              hooks: TrainHooks | None = None, **train_options: Any) -> LocalRunResult:
    """Train ``spec`` with ``plan`` on ``plan.world_size`` local CPU processes; returns every rank's results.

    ``train_options`` go to ``train_worker`` (e.g. ``loss_averaging``, ``resume``). ``hooks`` must
    pickle when more than one process runs.
    """
    return run_local_many(spec, [(plan, train_options)], threads_per_rank=threads_per_rank, in_process=in_process,
                          hooks=hooks)[0]


def run_local_many(spec: TrainJobSpec, runs: Sequence[tuple[ParallelPlan, dict[str, Any]]], *,
                   threads_per_rank: int = 1, in_process: bool | None = None,
                   hooks: TrainHooks | None = None) -> list[LocalRunResult]:
    """Several runs of ``spec`` (plan, train_worker options) one after another in the same processes.

    All plans must have the same world size; starting processes once saves their start-up
    (seconds each on a small machine).
    """
    sizes = {plan.world_size for plan, _ in runs}
    if len(sizes) != 1:
        raise ValueError(f"runs need one world size, got {sorted(sizes)}")
    world_size = sizes.pop()
    in_process = world_size == 1 if in_process is None else in_process
    if in_process and world_size != 1:
        raise ValueError("in_process runs need a plan of world size 1")
    if in_process and dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rayfleet-local-") as out_dir:
        # the spec is cut into the loop's slice once, here; the ranks receive it pickled
        args = (world_size, port, loop_config(spec), [(p, dict(o)) for p, o in runs], out_dir,
                threads_per_rank, hooks)
        if in_process:
            threads = torch.get_num_threads()
            try:
                _worker(0, *args)
            finally:
                torch.set_num_threads(threads)
        else:
            mp.start_processes(_worker, args=args, nprocs=world_size, join=True, start_method="spawn")
        results = []
        for index in range(len(runs)):
            ranks = [torch.load(os.path.join(out_dir, f"run{index}-rank{r}.pt"), weights_only=False)
                     for r in range(world_size)]
            results.append(LocalRunResult(summaries=tuple(r["summary"] for r in ranks),
                                          metrics=tuple(tuple(r["metrics"]) for r in ranks)))
    return results


def run_script_ranks(script: str, argv: Sequence[str], world_size: int, *, timeout_s: float = 240.0) -> list[str]:
    """Run ``python script *argv`` as ``world_size`` ranks (env:// rendezvous on 127.0.0.1, one
    intra-op thread each); return each rank's output, or raise with the failed ranks' tails.

    For code that must own its process group from the first line (tests of checkpoint
    resharding); ``run_local`` covers training runs.
    """
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, *argv],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                       WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world_size)]
    outputs = [(p.communicate(timeout=timeout_s)[0], p.returncode) for p in procs]
    failed = [f"rank {rank} rc={rc}:\n{out[-3000:]}" for rank, (out, rc) in enumerate(outputs) if rc != 0]
    if failed:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(argv)} at {world_size} ranks failed:\n"
                           + "\n".join(failed))
    return [out for out, _ in outputs]


def leave_after_barrier() -> None:
    """End a rank of ``run_script_ranks``: barrier, then exit without tearing gloo down.

    Once every rank is past the barrier nothing is in flight; destroying the group while the
    store host (rank 0) exits first can make a peer's gloo thread call ``std::terminate`` (seen
    in CI as "terminate called without an active exception").
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
