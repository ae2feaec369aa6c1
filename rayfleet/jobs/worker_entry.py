"""The function every Ray Train worker runs: re-rank, then the train loop, reporting each step.

Design decisions:
- Workers take the job as the driver cut it (``train_job``): the loop's ``LoopConfig`` and the
  checkpoint hook's ``CheckpointSettings``, frozen dataclasses pickled in ``train_loop_config``,
  and the ``ParallelPlan``. The spec was validated once, at the job's edge: nothing here parses it.
- Ray Train has initialized the default process group (gloo on CPU, NCCL on GPU) before this
  runs; ``rerank_process_group`` rebuilds it so that ``dist.get_rank()`` is the layout rank.
- Reporting per step goes three ways from rank 0: a ``RAYFLEET_METRICS`` log line (what
  ``rayfleet train`` and ``TrainingRun.metrics()`` read), a Parquet file per run in storage,
  and Ray metrics (Prometheus via Ray's metrics agent), all fed by one background thread
  (``metrics.StepStream``): the step never waits on them. Every rank also calls
  ``ray.train.report``, but only every ``RAYFLEET_TRAIN_REPORT_INTERVAL_S`` of step time
  (default 30 s, never under 2 x Ray Train's poll interval; ``metrics.ReportPacer``): a per-step
  report blocks until the controller's next poll and paced short steps to it (issue 19).
- ``resources.host_cpu_share`` keeps each worker's CPU under that share of its wall time
  (``host_share.HostShareHook``, after every step).
- Health: ``health.monitor.HealthMonitor`` judges slow ranks on compute time and restarts the
  group on a hung collective (``RAYFLEET_HANG_TIMEOUT_S``, default 120 s).
- On CPU each worker gets an equal share of the host's cores (workers of a local fleet share
  one machine) unless ``RAYFLEET_CPU_THREADS_PER_WORKER`` says how many; on a GPU node the device
  is the one Ray made visible.
"""

from __future__ import annotations

import os
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.jobs.train_job import CheckpointSettings

__all__ = ["THREADS_ENV", "cpu_threads_per_worker", "train_loop_per_worker"]

THREADS_ENV = "RAYFLEET_CPU_THREADS_PER_WORKER"


def _device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
    return torch.device("cpu")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray
    import ray.train
    import torch.distributed as dist

    from rayfleet.jobs.health.monitor import HealthMonitor
    from rayfleet.jobs.health.policy import SlowRankPolicy
    from rayfleet.jobs.host_share import HostShareHook
    from rayfleet.jobs.loop import PolledFlag, train_worker
    from rayfleet.jobs.train_metrics import MetricsWriter, ReportPacer, StepStream, write_run_plot
    from rayfleet.jobs.worker_ranks import rerank_note

    slots, assignment = _join_worker_group(config)
    rank = dist.get_rank()
    loop, plan = config["loop"], config["plan"]
    writer = MetricsWriter(os.path.join(config["run_dir"], "metrics")) if rank == 0 else None
    hooks = _checkpoint_hook(config["checkpoint"], run_dir=config["run_dir"], slots=slots, rank=rank)
    health = HealthMonitor(slow_rank_policy=SlowRankPolicy(),
                           hang_timeout_s=float(os.environ.get("RAYFLEET_HANG_TIMEOUT_S", "120")),
                           on_decision=_decision_recorder(os.path.basename(config["run_dir"].rstrip("/")), slots)
                           if rank == 0 else None)
    announced, announced_ranks = [False], [False]
    stream = StepStream(_metric_sinks(config, job=loop.name, writer=writer) if rank == 0 else [])
    # Metrics reach the driver, Parquet and Prometheus through ``stream``; Ray Train's report only
    # feeds its dashboard, and each one holds a cross-rank barrier through an actor (seen in a
    # py-spy profile: ~1% of a 0.12 s step when due every second). Every 30 s of steps is plenty;
    # never closer than twice the controller's poll, or it would block.
    poll_s = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
    pacer = ReportPacer(float(os.environ.get("RAYFLEET_TRAIN_REPORT_INTERVAL_S", max(2 * poll_s, 30.0))))

    def report(metrics: dict[str, Any]) -> None:
        row = dict(metrics)
        if rank == 0:
            row.setdefault("rail_matches", assignment.rail_matches)
            if not announced_ranks[0]:
                announced_ranks[0] = True  # the driver logs a re-formed group once
                if (note := rerank_note(assignment)) is not None:
                    row["rank_note"] = note
            restored = getattr(hooks, "restored", None)
            if restored is not None and restored.step is not None and not announced[0]:
                announced[0] = True  # the driver logs where this worker group resumed from
                row.update(restored_step=restored.step, restored_from=restored.source,
                           restore_reason=restored.reason)
            stream.put(row)
        if pacer.due(max(metrics["step_time_s_per_rank"])):  # the same answer on every rank
            ray.train.report({k: v for k, v in row.items() if isinstance(v, (int, float))})

    control = config.get("control")  # elastic jobs: the driver asks all ranks to stop to re-form
    # A long poll: each call returns when the driver raises the flag, or after 30 s (no wait between)
    should_stop = (PolledFlag(lambda: ray.get(control.wait_stop.remote()), period_s=0.0)
                   if control is not None and config.get("watch_stop") else None)
    try:
        share = HostShareHook(loop.host_cpu_share) if loop.host_cpu_share else None
        train_worker(loop, plan, report=report, hooks=[health, hooks, share], should_stop=should_stop)
    finally:
        if should_stop is not None:
            should_stop.close()
        stream.close()
        if writer is not None:
            writer.close()
            try:  # loss and tokens/s of the whole run so far, beside its Parquet metrics
                write_run_plot(config["run_dir"])
            except Exception as exc:  # noqa: BLE001 - a missing plot must not fail the job
                print(f"rayfleet: no metrics plot ({exc})", flush=True)


def _join_worker_group(config: dict[str, Any]) -> tuple[list[tuple[str, int]], Any]:
    """Take this worker's share of the host's cores (CPU) and re-form the default process group
    with layout ranks; returns the layout's slots and this worker's rank assignment."""
    import ray
    import ray.train
    import torch

    from rayfleet.jobs.worker_ranks import rerank_process_group
    from rayfleet.platform import labels as L

    device = _device()
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_worker(ray.train.get_context().get_local_world_size()))
    node = ray.get_runtime_context().get_node_labels().get(L.NODE, "")
    slots = [tuple(s) for s in config["slots"]]
    assignment = rerank_process_group(slots, node=node, backend="nccl" if device.type == "cuda" else "gloo")
    return slots, assignment


def cpu_threads_per_worker(workers_on_node: int, env: dict[str, str] | None = None) -> int:
    """Intra-op threads of a CPU worker: ``RAYFLEET_CPU_THREADS_PER_WORKER`` if set (leave cores
    to the platform's own processes, or to other jobs on the host), else an equal share of the
    host's cores among the job's workers on it."""
    env = os.environ if env is None else env
    raw = env.get(THREADS_ENV)
    if raw is None:
        return max(1, (os.cpu_count() or 1) // max(1, workers_on_node))
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise SpecError(THREADS_ENV, raw, "must be a whole number of threads >= 1",
                        "set it to e.g. 1, or unset it for an equal share of the host's cores")
    return threads


def _metric_sinks(config: dict[str, Any], *, job: str, writer: Any) -> list:
    """Where rank 0's step rows go: the driver (its formation's control actor; else the log),
    Parquet, Ray metrics."""
    import ray

    from rayfleet.jobs.train_metrics import export_ray_metrics
    from rayfleet.jobs.training_run import format_metrics_line

    control = config.get("control")
    to_driver = ((lambda row: ray.get(control.put.remote({k: v for k, v in row.items() if not hasattr(v, "shape")})))
                 if control is not None else (lambda row: print(format_metrics_line(row), flush=True)))
    return [to_driver, writer.write, lambda row: export_ray_metrics(row, job=job)]


def _checkpoint_hook(ck: CheckpointSettings | None, *, run_dir: str, slots: list, rank: int):
    """Flash checkpoints + health policies for a job with a ``checkpoint`` section, else None.

    Snapshots go to the node's shared memory (owned by its snapshot actor, so they outlive this
    process); every ``persist_every``-th goes to ``checkpoint.uri`` (default: the run directory).
    On a worker-group restart (same run), each rank restores from its snapshot, else storage.
    Rank 0 records each loss decision with the fleet controller (slow ranks: ``HealthMonitor``).
    """
    if ck is None:
        return None
    from rayfleet.jobs.checkpoint.hook import FlashCheckpointHook
    from rayfleet.jobs.health.policy import LossAnomalyPolicy

    run_name = os.path.basename(run_dir.rstrip("/"))
    uri = ck.uri or os.path.join(run_dir, "checkpoints")
    on_decision = _decision_recorder(run_name, slots) if rank == 0 else None
    return FlashCheckpointHook(job=run_name, snapshot_every=ck.every_n_steps, persist_every=ck.persist_every,
                               checkpoint_uri=uri, keep=ck.keep, use_node_actor=True,
                               loss_policy=LossAnomalyPolicy(), slow_rank_policy=None,  # HealthMonitor's
                               on_decision=on_decision)


def _decision_recorder(run_name: str, slots: list):
    def record(decision: Any) -> None:
        from dataclasses import asdict

        from rayfleet.platform.fleet_events import record_fleet_event

        # cause and action travel as the event's own fields (a duplicate "cause" keyword made the
        # controller's fire-and-forget call fail, so the event never showed in `rayfleet status`)
        detail = {k: v for k, v in asdict(decision).items()
                  if k not in ("cause", "action") and isinstance(v, (int, float, str, tuple))}
        if not record_fleet_event(f"job:{run_name}", decision.action, decision.cause, detail):
            print(f"rayfleet: could not record {decision.action} (no fleet controller)", flush=True)
        if decision.action == "cordon_and_reform":
            try:
                from rayfleet.platform.controller import get_controller

                node = slots[decision.rank][0]
                get_controller().cordon.remote(node, f"slow training rank {decision.rank} of {run_name}: {decision.cause}")
            except Exception as exc:  # noqa: BLE001 - no controller (plain Ray cluster): log and go on
                print(f"rayfleet: could not cordon for {decision.action}: {exc}", flush=True)
        print(f"rayfleet health: {decision.action}: {decision.cause}", flush=True)
    return record
