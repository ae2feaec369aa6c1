"""Run a training job on local processes with gloo, without Ray (tests, benchmarks, debugging).

Design decisions:
- Same ``train_worker`` as under Ray Train; only the process group comes from
  ``torch.multiprocessing`` on 127.0.0.1 instead of Ray's worker group, so a run here
  and a run on the fleet execute identical step code.
- Ranks start from a fork server that has imported torch and the train loop once (where the
  platform has one; spawn elsewhere): a spawned rank spends about 3 s of CPU importing them,
  which made rank start-up most of a short multi-rank test on 2 cores. A forked rank inherits the
  server's environment, not the caller's, so the caller's ``os.environ`` travels with the
  arguments and replaces the rank's before it trains (fault-injection variables are set by the
  caller right before a run).
- Results come back through files (``torch.save`` per rank in a temp dir): spawn has no return
  values, and a file also survives a rank that raises after some steps.
- ``world_size == 1`` runs in the calling process (a gloo group of one) unless asked
  otherwise: no spawn cost for single-process references.
- Each worker uses ``threads_per_rank`` intra-op threads so several ranks on a small machine do
  not oversubscribe its cores.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import LoopConfig, loop_config
from rayfleet.jobs.train_state import TrainHooks, TrainSummary
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.rendezvous import agent_store_env, host_store, join_group

__all__ = ["LocalRunResult", "run_local", "run_local_many", "run_local_jobs", "run_script_ranks", "leave_after_barrier",
           "rank_start_method"]


@dataclass(frozen=True)
class LocalRunResult:
    """Per-rank summaries and metric dicts of a local run (index = rank)."""

    summaries: tuple[TrainSummary, ...]
    metrics: tuple[tuple[dict[str, Any], ...], ...]

    @property
    def losses(self) -> tuple[float, ...]:
        return self.summaries[0].losses


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "rayfleet.jobs.loop")
"""What the fork server imports once, so that a rank starts without importing it. ``torch._dynamo``:
torch's optimizers import it on their first call (``Optimizer.__init__`` is wrapped by
``torch._disable_dynamo``, ``step`` calls ``torch._dynamo.graph_break``), about 0.6 s of CPU per rank here."""


def rank_start_method() -> str:
    """``forkserver`` (preloading :data:`PRELOAD`) where the platform has it, else ``spawn``.

    Never plain ``fork``: the caller may hold threads (pytest, Ray, gloo) that a fork would copy
    mid-lock; the fork server is a fresh single-threaded process.
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _worker(rank: int, world_size: int, port: int, runs: list[tuple[LoopConfig, ParallelPlan, dict]],
            out_dir: str, threads_per_rank: int, hooks: TrainHooks | None, environ: dict[str, str],
            store: Any = None) -> None:
    """One rank; ``store`` is the launcher's rendezvous store when the rank runs in its process."""
    from rayfleet.jobs.loop import train_worker

    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(threads_per_rank)
    join_group("gloo", host="127.0.0.1", port=port, rank=rank, world_size=world_size, store=store)
    try:
        for index, (loop, plan, options) in enumerate(runs):
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
    return run_local_jobs([(spec, plan, options) for plan, options in runs], threads_per_rank=threads_per_rank,
                          in_process=in_process, hooks=hooks)


def run_local_jobs(runs: Sequence[tuple[TrainJobSpec, ParallelPlan, dict[str, Any]]], *,
                   threads_per_rank: int = 1, in_process: bool | None = None,
                   hooks: TrainHooks | None = None) -> list[LocalRunResult]:
    """:func:`run_local_many` for runs of different jobs (models, precisions) in the same processes."""
    sizes = {plan.world_size for _, plan, _ in runs}
    if len(sizes) != 1:
        raise ValueError(f"runs need one world size, got {sorted(sizes)}")
    world_size = sizes.pop()
    in_process = world_size == 1 if in_process is None else in_process
    if in_process and world_size != 1:
        raise ValueError("in_process runs need a plan of world size 1")
    if in_process and dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process")
    store = host_store(world_size)  # listening before its port is handed out: no other process can take it
    with tempfile.TemporaryDirectory(prefix="rayfleet-local-") as out_dir:
        # each spec is cut into the loop's slice here; the ranks receive it pickled
        args = (world_size, store.port, [(loop_config(spec), p, dict(o)) for spec, p, o in runs], out_dir,
                threads_per_rank, hooks, dict(os.environ))
        if in_process:
            threads = torch.get_num_threads()
            try:
                _worker(0, *args, store=store)
            finally:
                torch.set_num_threads(threads)
        else:
            mp.start_processes(_worker, args=args, nprocs=world_size, join=True, start_method=rank_start_method())
        results = []
        for index in range(len(runs)):
            ranks = [torch.load(os.path.join(out_dir, f"run{index}-rank{r}.pt"), weights_only=False)
                     for r in range(world_size)]
            results.append(LocalRunResult(summaries=tuple(r["summary"] for r in ranks),
                                          metrics=tuple(tuple(r["metrics"]) for r in ranks)))
    return results


def _script_rank(script: str, argv: list[str], environ: dict[str, str], output: str) -> None:
    """One rank of ``run_script_ranks`` in a process from the fork server: what ``python script
    *argv`` would do (``__main__``, ``sys.argv``, the script's folder first on ``sys.path``), with
    stdout and stderr going to ``output``."""
    import runpy

    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def run_script_ranks(script: str, argv: Sequence[str], world_size: int, *, timeout_s: float = 240.0) -> list[str]:
    """Run ``python script *argv`` as ``world_size`` ranks (env:// rendezvous on 127.0.0.1, one
    intra-op thread each); return each rank's output, or raise with the failed ranks' tails.

    For code that must own its process group from the first line (tests of checkpoint
    resharding); ``run_local`` covers training runs. The ranks start from the same fork server
    as ``run_local``'s (:func:`rank_start_method`), so they do not import torch again.
    """
    import multiprocessing

    store = host_store(world_size)  # held for the ranks' lifetime; they all join it as clients
    ctx = multiprocessing.get_context(rank_start_method())
    with tempfile.TemporaryDirectory(prefix="rayfleet-script-ranks-") as out_dir:
        outputs = [os.path.join(out_dir, f"rank{rank}.log") for rank in range(world_size)]
        procs = [ctx.Process(target=_script_rank, daemon=True,
                             args=(script, list(argv), dict(os.environ, **agent_store_env(store), RANK=str(rank),
                                                            WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1"),
                                   outputs[rank]))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        late = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in late:
            procs[rank].kill()
            procs[rank].join()
        texts = [Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in outputs]
    failed = [f"rank {rank} {'timed out after %gs' % timeout_s if rank in late else f'rc={p.exitcode}'}:\n"
              f"{texts[rank][-3000:]}" for rank, p in enumerate(procs) if rank in late or p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(argv)} at {world_size} ranks failed:\n"
                           + "\n".join(failed))
    return texts


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
