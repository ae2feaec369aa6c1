"""Recovery from killed training workers: time to the next step, steps lost, effective training time.

On a private local fleet (2 nodes x 8 fake H100) the same tiny-MoE job (fp32, DP2, flash
snapshots every ``--every`` steps, persisted to storage every 5th snapshot) runs twice in one process:

1. the baseline: uninterrupted;
2. the same spec while the benchmark SIGKILLs one Ray Train worker ``--kills`` times, spaced
   through the run (``checkpoint.max_failures`` = kills + 1).

Per failure it measures, with the kill's wall time ``t_kill`` (``time.time()`` just before
``os.kill``) and the ``time_unix_s`` / ``step_time_s`` of the ``RAYFLEET_METRICS`` rows (same host
clock):
- kill -> next step: the end of the first step completed after the restart minus ``t_kill``.
  Goal <= 15 s. Split into phases: *detect* = kill -> the failed attempt's end (Ray Train's
  controller polls worker health every 2 s and sees the dead actor) and *teardown* = that -> the
  next attempt's start (old group shut down), both from Ray Train's run-attempt records
  (``RAY_TRAIN_ENABLE_STATE_TRACKING=1`` is set for the fleet); *actors* (placement group and two
  new worker processes up), *ctx init* (Ray Train's ``init_train_context`` on them: their first
  call, which unpickles the run context) and *gloo* (Ray Train's own process group), from the
  controller's own DEBUG timings in its session log; *fn -> step* = group started -> the first
  resumed step's start (rayfleet's re-ranked process group, model build, the restore from shared
  memory, data loader); *step* = that step's own compute. The restore is not timed apart: the
  driver prints "restored step N" when the first resumed step's metrics arrive, so the line
  carries no restore timing (``benchmarks/checkpoint.py`` times restores: milliseconds at this
  model's size);
- steps lost: the last step completed before ``t_kill`` minus the step restored from (the
  driver's "rayfleet checkpoint: restored step N from SRC" line). Goal <= the snapshot interval;
- where the restore came from (``shm`` or ``storage``).

Effective training time ratio of the run (ETTR, after Llama 3's "time spent on useful training
over the elapsed time"): ``baseline span / failure-run span``, where a span is the wall time from
the start of step 1 (its ``time_unix_s - step_time_s``) to the end of the last step. Job submission
and the first worker-group start are outside both spans, so the ratio charges exactly the failures:
detection, restarts, restores and recomputed steps. The JSON also holds the other definition,
``sum(step_time_s of the surviving row of each step) / failure-run span``.

Fleet model (``effective_training_fraction``, pure; inputs printed):
- a 16,384-H100 job interrupted once every 54 days x 24 h / 419 = 3.09 h (Llama 3 report, "The
  Llama 3 Herd of Models", arXiv:2407.21783, section 3.3.4: 419 unexpected interruptions in a
  54-day snapshot of 405B pre-training on 16,384 H100s; Meta reports > 90 % effective training time);
- a 4 GB per-GPU state: the top of the 1 MB - 4 GB of model state per GPU that the same report
  (section 3.3.1) says it saved;
- snapshot blocking = that size x the warm flash-snapshot s/GiB measured here by
  ``benchmarks/checkpoint.py``'s ``run_size`` (host memcpy on this CPU; an H100's device-to-host
  copy differs), every N steps with N from Young's rule sqrt(2 x blocking x MTBF);
- downtime per failure = the median measured kill -> resumed-step start; lost work = half the
  snapshot interval, recomputed;
- step time 5.9 s = 6 x 405e9 params x 16M tokens / (16,384 x 400 TFLOP/s): the report's final
  batch and about its per-GPU throughput at 16K GPUs.
Goal >= 97 %. The downtime measured on 2 local workers is a floor for 16,384 ranks (scheduling,
NCCL init and loading take longer at that scale): the table also prints the largest downtime per
failure that still meets the goal.

The table's "between steps" figure is rank 0's time from the end of one step to the start of the
next (reporting + hooks). Ray Train's per-worker result queue holds one report and is drained
only when the controller polls (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``: Ray Train's default 2 s,
rayfleet's job driver sets 0.5 s); when
rayfleet called ``ray.train.report`` every step, steps shorter than the poll interval were paced
by it (measured: ~1.9 s between 0.1-0.3 s steps). It now reports to Ray Train only once per
``RAYFLEET_TRAIN_REPORT_INTERVAL_S`` of step time and streams metrics from a background thread
(issue 19), so this figure is milliseconds. ``--health-check-interval-s`` sets the poll interval
for the fleet (it also cuts *detect*).

    python benchmarks/recovery.py                 # ~4.5 min here (load average 2-10)
    python benchmarks/recovery.py --steps 16 --kills 1 --health-check-interval-s 0.5

Writes benchmarks/results/recovery.json; prints the table last.

Over 400 lines: the baseline run, the kill schedule and the per-failure accounting must read the
same metrics rows in one process; split, they would each need the cluster and the job again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import cpu_name, run_size  # noqa: E402  (benchmarks/checkpoint.py)
from common import Goal, Table, record_run  # noqa: E402  (benchmarks/common.py)

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1 << 30
RESTORED_LINE = re.compile(r"^rayfleet checkpoint: restored step (\d+) from (\w+)")
METRICS_PREFIX = "RAYFLEET_METRICS "
GOAL_KILL_TO_STEP_S = 15.0
GOAL_FLEET_FRACTION = 0.97

# Llama 3 report (arXiv:2407.21783, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100s.
LLAMA3_MTBF_S = 54 * 86400 / 419
LLAMA3_STATE_GIB_PER_GPU = 4e9 / GIB  # "1 MB to 4 GB per GPU" of saved model state: the top end
LLAMA3_STEP_S = 6 * 405e9 * 16e6 / (16384 * 400e12)  # 6 N D / (GPUs x achieved FLOP/s) = 5.9 s


# -- the fleet model (pure) -----------------------------------------------------------------------
def young_interval_steps(*, snapshot_blocking_s: float, mtbf_s: float, step_s: float) -> int:
    """Young's optimal checkpoint interval sqrt(2 C M), in whole steps (>= 1)."""
    return max(1, round(math.sqrt(2 * snapshot_blocking_s * mtbf_s) / step_s))


def effective_training_fraction(*, mtbf_s: float, step_s: float, snapshot_blocking_s: float,
                                snapshot_every_steps: int, downtime_s: float) -> float:
    """Share of wall time spent on steps that count, first-order in failures (interval << MTBF).

    Snapshots cost ``snapshot_blocking_s`` per ``snapshot_every_steps`` steps of ``step_s``; each
    failure (one per ``mtbf_s``) costs ``downtime_s`` (detection + restart + restore) plus the
    recomputed work, half a snapshot interval on average.
    """
    interval_s = snapshot_every_steps * step_s + snapshot_blocking_s
    snapshot_overhead = snapshot_blocking_s / interval_s
    lost_per_failure_s = downtime_s + 0.5 * interval_s
    return max(0.0, 1 - lost_per_failure_s / mtbf_s) * (1 - snapshot_overhead)


def max_downtime_for(goal: float, *, mtbf_s: float, step_s: float, snapshot_blocking_s: float,
                     snapshot_every_steps: int) -> float:
    """The largest ``downtime_s`` for which ``effective_training_fraction`` still reaches ``goal``."""
    interval_s = snapshot_every_steps * step_s + snapshot_blocking_s
    keep = 1 - snapshot_blocking_s / interval_s
    return mtbf_s * (1 - goal / keep) - 0.5 * interval_s


# -- reading a run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """The rows one worker group printed, in order; ``restored_*`` is None for the first."""

    restored_step: int | None
    restored_from: str | None
    rows: tuple[dict, ...]


def segments_of(log: str) -> list[Segment]:
    """Split a driver log at each "restored step N" line (the driver prints them in row order)."""
    segments: list[list] = [[None, None, []]]
    for line in log.splitlines():
        if match := RESTORED_LINE.match(line):
            segments.append([int(match.group(1)), match.group(2), []])
        elif line.startswith(METRICS_PREFIX):
            try:
                segments[-1][2].append(json.loads(line[len(METRICS_PREFIX):]))
            except json.JSONDecodeError:
                continue
    return [Segment(s, src, tuple(rows)) for s, src, rows in segments]


def span_s(rows: list[dict]) -> float:
    """Start of the first step to the end of the last one."""
    first = rows[0]
    return rows[-1]["time_unix_s"] - (first["time_unix_s"] - first["step_time_s"])


def run_attempts(run_name_prefix: str) -> list[dict]:
    """Ray Train's attempts of the newest run named ``run_name_prefix-*``: start/end (s), status, pid->rank."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    if actor is None:
        return []
    runs = [r for r in ray.get(actor.get_train_runs.remote()).values() if r.name.startswith(run_name_prefix + "-")]
    if not runs:
        return []
    run = max(runs, key=lambda r: r.start_time_ns)
    attempts = ray.get(actor.get_train_run_attempts.remote()).get(run.id, {})
    return [{"start_s": a.start_time_ns / 1e9, "end_s": a.end_time_ns / 1e9 if a.end_time_ns else None,
             "status": str(a.status.value), "pid_to_rank": {w.pid: w.world_rank for w in a.workers}}
            for a in attempts.values()]


# -- running jobs ---------------------------------------------------------------------------------
def job_spec(name: str, data_uri: str, *, steps: int, every: int, ckpt_uri: str, max_failures: int) -> dict:
    return {"name": name, "model": {"preset": "tiny", "seed": 0}, "data": {"uri": data_uri, "seq_len": 64},
            "plan": {"dp": 2}, "precision": "fp32", "steps": steps, "global_batch_size": 4,
            "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1},
            "resources": {"accelerator": "H100", "num_workers": 2},
            "checkpoint": {"every_n_steps": every, "persist_every": 5, "uri": ckpt_uri, "max_failures": max_failures}}


def last_step_seen(run) -> tuple[int, int]:
    """(number of restore lines, step of the newest row) in the job's log so far."""
    segs = segments_of(run.logs())
    rows = segs[-1].rows
    return len(segs) - 1, (int(rows[-1]["step"]) if rows else -1)


GROUP_START_TIMINGS = {  # Ray Train controller debug lines -> field (seconds)
    "actors_s": re.compile(r"\[Worker Group Initialization\] \d+ worker actors created in ([\d.]+)s"),
    "train_context_s": re.compile(r"\[Worker Group Initialization\] Train context initialized on workers in ([\d.]+)s"),
    "backend_setup_s": re.compile(r"BackendSetupCallback: ([\d.]+)s"),
    "group_startup_s": re.compile(r"\[Worker Group Initialization\] Worker group startup completed in ([\d.]+)s"),
}


def group_start_timings(temp_dir: str, run_name_prefix: str) -> list[dict]:
    """Each worker-group start of the run, from Ray Train's own controller log (JSON lines at DEBUG
    in ``<temp_dir>/session_latest/logs/train/ray-train-sys-controller-*.log``), in order."""
    starts: list[dict] = []
    for path in sorted(Path(temp_dir, "session_latest", "logs", "train").glob("ray-train-sys-controller-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not str(record.get("run_name", "")).startswith(run_name_prefix + "-"):
                continue
            message = record.get("message", "")
            for key, pattern in GROUP_START_TIMINGS.items():
                if match := pattern.search(message):
                    if key == "actors_s":
                        starts.append({})
                    if starts and key not in starts[-1]:  # BackendSetupCallback: the after_worker_group_start line
                        starts[-1][key] = float(match.group(1))
    return starts


def run_with_kills(fleet, dashboard_url: str, spec: dict, *, kill_at: list[int], timeout_s: float) -> tuple:
    """Submit ``spec``; SIGKILL a Ray Train worker when the run reaches each step in ``kill_at``."""
    from ray.util.state import list_actors

    run = fleet.train(spec)
    kills, killed_pids = [], set()
    deadline = time.monotonic() + timeout_s
    for k, target in enumerate(kill_at):
        # wait for the k-th restart to be producing rows, and for the target step
        while True:
            if time.monotonic() > deadline or run.status() in ("FAILED", "STOPPED", "SUCCEEDED"):
                raise RuntimeError(f"run ended or timed out before kill {k + 1}:\n{run.logs()[-3000:]}")
            restores, step = last_step_seen(run)
            if restores >= k and step >= target:
                break
            time.sleep(0.25)
        alive = {a.pid for a in list_actors(address=dashboard_url, filters=[("class_name", "=", "RayTrainWorker"),
                                                                           ("state", "=", "ALIVE")])} - killed_pids
        if not alive:
            raise RuntimeError("no live Ray Train worker to kill")
        attempts = run_attempts(spec["name"])
        rank_of = {pid: rank for pid, rank in (attempts[-1]["pid_to_rank"] if attempts else {}).items() if pid in alive}
        # alternate ranks 0, 1, ...; by pid order when Ray Train's state tracking has no record
        order = sorted(rank_of, key=rank_of.get) if len(rank_of) == len(alive) else sorted(alive)
        victim = order[k % len(order)]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)  # local fleet: every node's processes are on this host
        killed_pids.add(victim)
        kills.append({"t_kill": t_kill, "pid": victim, "target_step": target})
        print(f"  kill {k + 1}: SIGKILL worker pid {victim} (rank {rank_of.get(victim, '?')}) after step {step} "
              f"was seen", flush=True)
    status = run.wait(timeout_s=max(60.0, deadline - time.monotonic()))
    return run, kills, status


def analyse_failures(segs: list[Segment], kills: list[dict], attempts: list[dict], group_starts: list[dict], *,
                     every: int) -> list[dict]:
    out = []
    for k, kill in enumerate(kills):
        before, after = segs[k], segs[k + 1]
        t_kill = kill["t_kill"]
        done = [int(r["step"]) for r in before.rows if r["time_unix_s"] <= t_kill]
        last_done = max(done) if done else (segs[k].restored_step or 0)
        first = after.rows[0]
        first_start = first["time_unix_s"] - first["step_time_s"]
        row = {"kill": k + 1, "pid": kill["pid"], "t_kill": t_kill, "last_step_before_kill": last_done,
               "restored_step": after.restored_step, "restored_from": after.restored_from,
               "steps_lost": last_done - after.restored_step, "snapshot_every": every,
               "kill_to_next_step_s": first["time_unix_s"] - t_kill, "downtime_s": first_start - t_kill,
               "first_step_s": first["step_time_s"]}
        failed = attempts[k] if len(attempts) > k + 1 else None
        if failed and failed["end_s"]:
            row["victim_rank"] = failed["pid_to_rank"].get(kill["pid"])
            row["detect_s"] = failed["end_s"] - t_kill
            row["teardown_s"] = attempts[k + 1]["start_s"] - failed["end_s"]
            row["start_restore_s"] = first_start - attempts[k + 1]["start_s"]
        if len(group_starts) > k + 1 and "group_startup_s" in group_starts[k + 1]:
            row.update(group_starts[k + 1])  # start k+1 is the restart after kill k
            if "start_restore_s" in row:  # the train fn runs from the group's startup to the first step
                row["train_fn_to_step_s"] = row["start_restore_s"] - row["group_startup_s"]
        out.append(row)
    return out


def snapshot_gap_s(rows: list[dict], every: int) -> dict:
    """Between-step time (report + hooks) after snapshot steps vs after the others, medians (s)."""
    snap, other = [], []
    for prev, row in zip(rows, rows[1:]):
        gap = (row["time_unix_s"] - row["step_time_s"]) - prev["time_unix_s"]
        (snap if int(prev["step"]) % every == 0 else other).append(gap)
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"after_snapshot_step_s": med(snap), "after_other_step_s": med(other),
            "snapshot_blocking_estimate_s": med(snap) - med(other)}


# -- main -----------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # A step of this job takes ~0.1-0.3 s (no per-step report pacing): each kill needs tens of steps
    # after it, or the job finishes before the kill is seen (1 kill, 0 restores).
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=3, help="snapshot every N steps")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--health-check-interval-s", type=float, default=None,
                        help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for the fleet (default: rayfleet's 0.5 s, "
                             "jobs.elastic.formation.TRAIN_CONTROLLER_POLL_S; Ray Train's own is 2 s)")
    parser.add_argument("--snapshot-s-per-gib", type=float, default=None,
                        help="skip the flash-snapshot measurement and use this warm s/GiB")
    parser.add_argument("--quick", action="store_true",
                        help="60 steps, one kill, a 64 MiB snapshot measurement (what the tests run)")
    parser.add_argument("--json", type=Path, default=None, help="where the results go (default: results/recovery.json)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kills = min(args.steps, 60), min(args.kills, 1)
    spacing = args.steps // (args.kills + 1)
    kill_at = [spacing * (k + 1) + k for k in range(args.kills)]  # + k: kills land at varied snapshot phases

    work = tempfile.mkdtemp(prefix="rayfleet-recovery-")  # tokens, checkpoint URIs
    try:
        run_benchmark(args, kill_at=kill_at, work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_benchmark(args: argparse.Namespace, *, kill_at: list[int], work: str) -> None:
    import ray

    from rayfleet.platform.launcher import LocalFleet
    from rayfleet.platform.topology import build_topology
    from rayfleet.sdk import connect
    from rayfleet.storage.tokens import prepare_token_dataset

    os.environ["RAY_TRAIN_ENABLE_STATE_TRACKING"] = "1"  # inherited by the fleet: run-attempt timestamps
    if args.health_check_interval_s is not None:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval_s)
    machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
               "ray_train_health_check_interval_s": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5 (rayfleet's default)")}
    print(f"machine: {machine}", flush=True)
    stdlib = os.path.dirname(os.__file__)
    prepare_token_dataset([os.path.join(stdlib, "json"), os.path.join(stdlib, "email")], f"{work}/tokens",
                          shard_tokens=1 << 16, seq_len=128)
    if args.snapshot_s_per_gib is None:  # before the fleet starts, so its processes do not compete
        # quick: a smaller state, fewer repeats (13 s of the quick run's 86 s at 0.25 GiB x 5)
        size_gib, repeats = (0.0625, 2) if args.quick else (0.25, 5)
        print(f"flash snapshot cost at {size_gib:g} GiB (benchmarks/checkpoint.py run_size)", flush=True)
        disk = Path(tempfile.mkdtemp(prefix="recovery-ckpt-", dir=work))
        shm_root = f"/dev/shm/rayfleet-recovery-{os.getpid()}"
        try:
            ck = run_size(size_gib, shm_root=shm_root, disk_dir=disk, repeats=repeats)
        finally:
            shutil.rmtree(shm_root, ignore_errors=True)
        s_per_gib, s_per_gib_min = ck["warm_snapshot_s_per_gib"], ck["warm_snapshot_min_s_per_gib"]
        s_per_gib_src = f"measured now: checkpoint.run_size({size_gib:g} GiB), median of {repeats} warm snapshots"
    else:
        s_per_gib = s_per_gib_min = args.snapshot_s_per_gib
        s_per_gib_src = "--snapshot-s-per-gib"
    t0 = time.monotonic()
    home = tempfile.mkdtemp(prefix="rayfleet-recovery-home-")
    local = LocalFleet.up(build_topology(num_nodes=2, accelerator="H100", accelerators_per_node=8), home=home)
    try:
        fleet = connect(local.address)
        deadline = time.monotonic() + 90
        while not (len(fleet.status().nodes) == 2 and all(r.health == "healthy" for r in fleet.status().nodes)):
            if time.monotonic() > deadline:
                raise RuntimeError("node agents did not report healthy within 90 s")
            time.sleep(0.5)
        print(f"fleet up in {time.monotonic() - t0:.1f} s; baseline run ({args.steps} steps)", flush=True)
        base_spec = job_spec("recovery-baseline", f"{work}/tokens", steps=args.steps, every=args.every,
                             ckpt_uri=f"{work}/ckpt-base", max_failures=args.kills + 1)
        base = fleet.train(base_spec)
        base.wait(timeout_s=300)
        base_rows = list(segments_of(base.logs())[0].rows)
        print(f"failure run: kills when the run reaches steps {kill_at}", flush=True)
        spec = {**base_spec, "name": "recovery-kills",
                "checkpoint": {**base_spec["checkpoint"], "uri": f"{work}/ckpt-kills"}}
        run, kills, status = run_with_kills(fleet, local.dashboard_url, spec, kill_at=kill_at, timeout_s=400)
        segs = segments_of(run.logs())
        attempts = run_attempts("recovery-kills")
        group_starts = group_start_timings(local.temp_dir, "recovery-kills")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        local.down()  # frees what its jobs left in /dev/shm (each formation frees its own as it ends)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(local.temp_dir, ignore_errors=True)  # this fleet's private Ray temp dir (session logs)

    machine["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    if len(segs) != len(kills) + 1:  # each kill must have caused exactly one restore
        last = int(segs[-1].rows[-1]["step"]) if segs[-1].rows else -1
        raise RuntimeError(f"{len(kills)} kills but {len(segs) - 1} restores in the log (last step {last} of "
                           f"{args.steps}; a kill after the last step restores nothing: raise --steps); see {run.job_id}")
    failures = analyse_failures(segs, kills, attempts, group_starts, every=args.every)
    all_rows = [r for s in segs for r in s.rows]
    surviving = {int(r["step"]): r for r in all_rows}  # the last row of each step is the one that counts
    base_span, run_span = span_s(base_rows), span_s(all_rows)
    ettr = base_span / run_span
    productive = sum(r["step_time_s"] for r in surviving.values()) / run_span
    same_losses = all(abs(surviving[int(r["step"])]["loss"] - r["loss"]) <= 1e-6 * abs(r["loss"]) for r in base_rows)
    gaps = snapshot_gap_s(base_rows, args.every)

    downtime = statistics.median(f["downtime_s"] for f in failures)
    blocking = LLAMA3_STATE_GIB_PER_GPU * s_per_gib
    every_fleet = young_interval_steps(snapshot_blocking_s=blocking, mtbf_s=LLAMA3_MTBF_S, step_s=LLAMA3_STEP_S)
    model_inputs = {"accelerators": 16384, "mtbf_s": LLAMA3_MTBF_S, "step_s": LLAMA3_STEP_S,
                    "state_gib_per_gpu": LLAMA3_STATE_GIB_PER_GPU, "snapshot_s_per_gib": s_per_gib,
                    "snapshot_min_s_per_gib": s_per_gib_min, "snapshot_s_per_gib_source": s_per_gib_src,
                    "snapshot_blocking_s": blocking, "snapshot_every_steps": every_fleet, "downtime_s": downtime}
    fraction = effective_training_fraction(mtbf_s=LLAMA3_MTBF_S, step_s=LLAMA3_STEP_S, snapshot_blocking_s=blocking,
                                           snapshot_every_steps=every_fleet, downtime_s=downtime)
    max_down = max_downtime_for(GOAL_FLEET_FRACTION, mtbf_s=LLAMA3_MTBF_S, step_s=LLAMA3_STEP_S,
                                snapshot_blocking_s=blocking, snapshot_every_steps=every_fleet)

    out = args.json or RESULTS / "recovery.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": machine, "steps": args.steps, "snapshot_every": args.every, "kill_at_steps": kill_at,
        "final_status": status, "failures": failures, "group_starts": group_starts,
        "attempts": [{k: v for k, v in a.items() if k != "pid_to_rank"} for a in attempts],
        "baseline_span_s": base_span, "failure_run_span_s": run_span, "ettr": ettr,
        "productive_step_time_fraction": productive, "losses_match_baseline": same_losses,
        "baseline_step_time_median_s": statistics.median(r["step_time_s"] for r in base_rows),
        "snapshot_gaps": gaps, "fleet_model": {"inputs": model_inputs, "effective_training_fraction": fraction,
                                               "max_downtime_s_for_goal": max_down},
        "goals": {"kill_to_next_step_s": GOAL_KILL_TO_STEP_S, "steps_lost": f"<= snapshot_every ({args.every})",
                  "fleet_effective_training_fraction": GOAL_FLEET_FRACTION},
    }, indent=1, default=str))
    print(f"wrote {out}")

    base_step_s = statistics.median(r["step_time_s"] for r in base_rows)
    phases = {"detect": "detect_s", "teardown": "teardown_s", "actors": "actors_s", "ctx init": "train_context_s",
              "gloo": "backend_setup_s", "fn->step": "train_fn_to_step_s", "step": "first_step_s"}
    phase_medians = {name: statistics.median(f[key] for f in failures) for name, key in phases.items()
                     if all(f.get(key) is not None for f in failures)}
    dominant = max(phase_medians, key=phase_medians.get) if phase_medians else "?"

    print(f"\nrecovery from SIGKILLed Ray Train workers: tiny MoE fp32 DP2, {args.steps} steps, snapshot every "
          f"{args.every}, 2 local nodes x 8 fake H100")
    print(f"ran on {machine['cpu']} ({machine['cpus']} cpus), load average {machine['load_avg_1m_at_start']} at "
          f"start, {machine['load_avg_1m_at_end']} at the end (shared machine); final status {status}; "
          f"losses {'match' if same_losses else 'DIFFER FROM'} the baseline's")
    cols = [("kill", 4), ("rank", 4), ("last done", 9), ("restored", 8), ("from", 5), ("lost", 4), ("goal", 5),
            ("kill->step s", 12), ("goal", 5), ("detect", 6), ("teardown", 8), ("actors", 6), ("ctx init", 8),
            ("gloo", 4), ("fn->step", 8), ("step", 4)]
    hdr = " ".join(f"{name:>{w}}" for name, w in cols)
    print(hdr)
    print("-" * len(hdr))
    fmt = lambda r, k: f"{r[k]:.1f}" if r.get(k) is not None else "?"  # noqa: E731
    for r in failures:
        cells = [r["kill"], r.get("victim_rank", "?"), r["last_step_before_kill"], r["restored_step"],
                 r["restored_from"], r["steps_lost"], f"<={args.every}", f"{r['kill_to_next_step_s']:.1f}", "<=15",
                 fmt(r, "detect_s"), fmt(r, "teardown_s"), fmt(r, "actors_s"), fmt(r, "train_context_s"),
                 fmt(r, "backend_setup_s"), fmt(r, "train_fn_to_step_s"), f"{r['first_step_s']:.1f}"]
        print(" ".join(f"{str(c):>{w}}" for c, (_, w) in zip(cells, cols)))
    print(f"dominant phase: {dominant} (medians, s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in phase_medians.items()) + ")")
    print(f"ETTR of the run = baseline span / failure-run span = {base_span:.1f} s / {run_span:.1f} s = {ettr:.1%} "
          f"({(run_span - base_span) / len(kills):.1f} s per failure); productive step time / span {productive:.1%}")
    print(f"between steps (report + hooks) {gaps['after_other_step_s']:.2f} s vs step {base_step_s:.2f} s; "
          f"snapshot blocking in-run (tiny model) {gaps['snapshot_blocking_estimate_s'] * 1e3:.0f} ms")
    print(f"fleet model: 16,384 H100, MTBF {LLAMA3_MTBF_S / 3600:.2f} h (Llama 3: 419 in 54 d), "
          f"step {LLAMA3_STEP_S:.1f} s, state {LLAMA3_STATE_GIB_PER_GPU:.2f} GiB/GPU")
    print(f"  x {s_per_gib:.3f} s/GiB (min {s_per_gib_min:.3f}) = {blocking:.2f} s blocking per snapshot, "
          f"every {every_fleet} steps (Young), downtime {downtime:.1f} s per failure (measured median)")
    print(f"  effective training time {fraction:.2%} (goal >= {GOAL_FLEET_FRACTION:.0%}); the goal holds up to "
          f"{max_down:.0f} s of downtime per failure")
    goals = [Goal("fleet model: effective training fraction, 16,384 H100", ">=", GOAL_FLEET_FRACTION, fraction)]
    table_rows = []
    for r in failures:
        goals += [Goal(f"kill {r['kill']}: kill to next step s", "<=", GOAL_KILL_TO_STEP_S, r["kill_to_next_step_s"]),
                  Goal(f"kill {r['kill']}: steps lost", "<=", args.every, r["steps_lost"])]
        table_rows.append([str(r["kill"]), str(r.get("victim_rank", "?")), str(r["last_step_before_kill"]),
                           str(r["restored_step"]), str(r["restored_from"]), str(r["steps_lost"]),
                           f"{r['kill_to_next_step_s']:.1f}", fmt(r, "detect_s"), fmt(r, "teardown_s"),
                           fmt(r, "actors_s"), fmt(r, "train_context_s"), fmt(r, "backend_setup_s"),
                           fmt(r, "train_fn_to_step_s"), f"{r['first_step_s']:.1f}"])
    record_run(name="recovery", quick=args.quick, params={"steps": args.steps, "snapshot_every": args.every,
                                                          "kill_at_steps": kill_at},
               figures={"failures": failures, "ettr": ettr, "productive_step_time_fraction": productive,
                        "losses_match_baseline": same_losses, "phase_medians_s": phase_medians,
                        "fleet_model": {"inputs": model_inputs, "effective_training_fraction": fraction,
                                        "max_downtime_s_for_goal": max_down}},
               goals=goals,
               tables={"kills": Table(["kill", "rank", "last done", "restored", "from", "lost", "kill->step s", "detect",
                                       "teardown", "actors", "ctx init", "gloo", "fn->step", "step"], table_rows)})


if __name__ == "__main__":
    main()
