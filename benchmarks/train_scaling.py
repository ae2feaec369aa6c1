"""Training throughput: tokens/s for 1, 2 and 4 workers beside the ideal, the communication
share of step time per parallel dimension, the a2a hidden fraction, and the MFU estimate.

    python benchmarks/train_scaling.py [--quick] [--part all|scaling|platform|pipeline] [--steps 8]
                                       [--json benchmarks/results/train_scaling.json]

Platform against a bare loop (``--part platform``; issue 19): the same model (tiny MoE, fp32),
plan (the one the job resolves: DP 2) and data run (a) as a rayfleet job on a private one-node
local fleet (Ray job -> ``run_training`` -> Ray Train workers, metrics to the driver, Parquet and
Prometheus) and (b) as a hand-written ``torch.distributed`` loop in two spawned processes with
the same building blocks (model, ``parallelize_model``, optimizer, loader) and nothing else.
Throughput is wall time from the end of one step to the end of the last (so anything between
steps counts); the ratio (goal >= 0.97) and the platform's overhead per step in ms are printed.

Weak scaling: every worker gets the same per-worker batch (micro-batch 4 x 64 tokens), so the
ideal N-worker throughput is N x the 1-worker throughput measured in this run (the baseline).
On this machine the workers are CPU processes sharing its cores, so a second ideal, capped at
the core count, is printed too: beyond it a shortfall is core contention, not communication.

Communication per dimension comes from the torch profiler over the measured steps of rank 0:
``gloo:all_to_all`` is expert parallel (EP dispatch/combine), ``gloo:all_gather`` and
``gloo:reduce_scatter`` are FSDP2 over DP (and the TP token gather when EP folds onto TP),
``gloo:all_reduce`` is tensor parallel (DTensor) plus the small per-step metric and norm
reductions. Shares are of rank 0's wall time in those steps; collectives run on gloo's
threads, so overlapped time counts too (the a2a hidden fraction says how much of EP's is
hidden). MFU is against the catalogue's peak of the job's declared accelerator (H100), so on a
CPU it is tiny: it shows the estimate works, not GPU efficiency.

Pipeline bubble (``--part pipeline``; issue 28 item 7): 1F1B, interleaved 1F1B (VP2) and DualPipeV
at the same PP (2) and micro-batch count (8; quick: 4), each rank's measured idle share of the
pipeline beside the cost model's (``placement/pipeline_schedule.py``) priced with the measured
per-micro-batch compute; how it is measured is in ``benchmarks/_pipeline_bubble.py``.

Where CUDA is available, the same script also compares FP8 (tensorwise) with BF16 end to end
on the ``small`` preset in one process (goal: FP8 >= 1.2x BF16).

Over 400 lines: the scaling sweep and the platform-vs-bare comparison share the model, data and
fleet set-up and print one table; the pure helpers already live in ``rayfleet``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _pipeline_bubble import measure_bubbles, print_bubbles  # noqa: E402  (beside this script)
from common import Goal, Table, record_run  # noqa: E402  (benchmarks/common.py, beside this script)
from rayfleet.jobs.local_processes import run_local_many  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.jobs.train_state import TrainHooks  # noqa: E402
from rayfleet.jobs.worker_entry import THREADS_ENV  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from rayfleet.storage.tokens import prepare_token_dataset  # noqa: E402

MICRO = 4
SEQ = 64
PLATFORM_MICRO = 8  # per DP rank: about 0.15-0.3 s steps here, above the 0.1 s of the goal
CATEGORIES = {"gloo:all_to_all": "ep", "gloo:all_gather": "dp", "gloo:reduce_scatter": "dp",
              "gloo:all_reduce": "tp"}


class ProfileComm(TrainHooks):
    """Profiles rank 0's steps after warm-up; writes {dimension: seconds, wall: seconds} as JSON."""

    def __init__(self, out_path: str, warmup: int) -> None:
        self.out_path, self.warmup = out_path, warmup
        self.profiler = None
        self.rank = 0
        self.t0 = 0.0

    def on_start(self, *, rank, world_size, plan, step, state_fn, load_fn) -> None:
        self.rank = rank

    def before_step(self, step: int) -> None:
        if self.rank == 0 and step == self.warmup and self.profiler is None:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.t0 = time.perf_counter()

    def on_end(self, summary, *, state_fn) -> None:
        if self.profiler is None:
            return
        wall = time.perf_counter() - self.t0
        self.profiler.__exit__(None, None, None)
        seconds: dict[str, float] = defaultdict(float)
        for event in self.profiler.events():
            dim = CATEGORIES.get(event.name)
            if dim:
                seconds[dim] += event.cpu_time_total / 1e6
        Path(self.out_path).write_text(json.dumps({"wall": wall, **seconds}))


def _dataset(root: str) -> str:
    src = os.path.join(os.path.dirname(os.__file__), "email")  # the standard library's own text
    out = os.path.join(root, "tokens")
    prepare_token_dataset([src], out, shard_tokens=1 << 16, seq_len=SEQ)
    return out


def _spec(dataset: str, workers_in_dp: int, steps: int, *, overlap: bool, precision: str = "bf16",
          preset: str = "tiny") -> TrainJobSpec:
    return TrainJobSpec.model_validate({
        "name": "bench", "model": {"preset": preset}, "data": {"uri": dataset, "seq_len": SEQ},
        "steps": steps, "global_batch_size": MICRO * workers_in_dp, "precision": precision,
        "schedule": {"warmup_steps": 1}, "comm": {"a2a_overlap": overlap}})


def _measure(dataset: str, plan: ParallelPlan, *, steps: int, warmup: int, overlap: bool, data_ranks: int,
             tmp: str) -> dict:
    """One configuration; the global batch is MICRO x ``data_ranks`` sequences (weak scaling)."""
    spec = _spec(dataset, data_ranks, steps, overlap=overlap)
    prof_path = os.path.join(tmp, f"prof-{plan.describe().replace(' ', '_')}-{overlap}.json")
    threads = 1  # one core per rank, the baseline included, so N ranks can at best be N x faster
    (result,) = run_local_many(spec, [(plan, {})], threads_per_rank=threads,
                               hooks=ProfileComm(prof_path, warmup), in_process=False)
    rows = [m for m in result.metrics[0] if m["step"] > warmup]
    comm = json.loads(Path(prof_path).read_text()) if os.path.exists(prof_path) else {"wall": 0.0}
    wall = comm.pop("wall") or 1.0
    hidden = [m["a2a_hidden_fraction"] for m in rows if m["a2a_hidden_fraction"] is not None]
    return {"plan": plan.describe(), "workers": plan.world_size, "overlap": overlap,
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in rows),
            "step_time_s": statistics.median(m["step_time_s"] for m in rows),
            "mfu": statistics.median(m["mfu"] for m in rows),
            "comm_share": {dim: comm.get(dim, 0.0) / wall for dim in ("dp", "tp", "ep")},
            "a2a_hidden_fraction": statistics.median(hidden) if hidden else None,
            "final_loss": result.losses[-1]}


def _gpu_fp8_vs_bf16(dataset: str, steps: int) -> list[dict]:
    """Single-process FP8 vs BF16 on CUDA (the small preset); [] without a GPU."""
    if not torch.cuda.is_available():
        return []
    out = []
    for precision in ("bf16", "tensorwise"):
        spec = _spec(dataset, 8, steps, overlap=False, precision=precision, preset="small")
        (result,) = run_local_many(spec, [(ParallelPlan(dp=1, micro_batch_size=MICRO), {"device": "cuda"})],
                                   in_process=True)
        rows = result.metrics[0][2:]
        out.append({"precision": precision, "tokens_per_s": statistics.median(m["tokens_per_s"] for m in rows),
                    "mfu": statistics.median(m["mfu"] for m in rows)})
    return out


# -- the platform against a bare torch.distributed loop (issue 19) ----------------------------------
def _bare_worker(rank: int, world_size: int, port: int, spec_dict: dict, plan: ParallelPlan, steps: int,
                 out_path: str, threads: int) -> None:
    """The same model, plan, data and optimizer as the rayfleet job, in a hand-written loop:
    no Ray, no metrics, no hooks. Writes rank 0's (step end ``time.time()``, step CPU seconds)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from rayfleet.jobs import parallel as par
    from rayfleet.jobs.data import DistributedTokenLoader, TokenSamples
    from rayfleet.jobs.optim import build_optimizer
    from rayfleet.models import MoELayer, build_model, materialize
    from rayfleet.platform.rendezvous import join_group

    torch.set_num_threads(threads)
    join_group("gloo", host="127.0.0.1", port=port, rank=rank, world_size=world_size)
    spec = TrainJobSpec.model_validate(spec_dict)
    ctx = par.build_parallel_context(plan, device=torch.device("cpu"))
    model = build_model(spec.model.to_config(), device="meta")
    materialize(model, device=torch.device("cpu"), seed=spec.model.seed)
    model = par.parallelize_model(model, ctx)
    opt = spec.optimizer
    optimizer = build_optimizer(model, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    loader = DistributedTokenLoader(TokenSamples(spec.data.uri, spec.data.seq_len),
                                    global_batch_size=spec.global_batch_size, dp_rank=ctx.dp_rank,
                                    dp_size=ctx.dp_size, micro_batch_size=plan.micro_batch_size,
                                    shuffle=spec.data.shuffle, seed=spec.data.seed)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    ends = []
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time  # as train_worker
    for _ in range(steps):
        c0 = cpu_clock()  # this rank's CPU in the step: what the platform's compute_time_s counts
        batch = loader.next_batch()
        load = torch.zeros(len(layers), spec.model.to_config().num_experts, dtype=torch.int64)
        for mb in batch.microbatches:
            logits = model(mb[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mb[:, 1:].reshape(-1)).backward()
            load += torch.stack([layer.last_tokens_per_expert for layer in layers])
        par.finalize_gradients(model, ctx)
        par.clip_grad_norm_(model, spec.grad_clip or float("inf"), ctx)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for layer, layer_load in zip(layers, par.sync_expert_load(load, ctx)):
            layer.update_router_bias(layer_load)
        ends.append((time.time(), cpu_clock() - c0))
    if rank == 0:
        Path(out_path).write_text(json.dumps(ends))
    dist.barrier()
    dist.destroy_process_group()


def _threads_per_rank(world_size: int, spare_cores: int = 0) -> int:
    """Intra-op threads per rank for every run of the comparison (the rayfleet job gets the same
    through ``RAYFLEET_CPU_THREADS_PER_WORKER``): the host's cores less ``spare_cores`` (left to
    the platform's own processes), shared equally among the ranks."""
    return max(1, ((os.cpu_count() or 1) - spare_cores) // world_size)


def _bare_run(spec: TrainJobSpec, plan: ParallelPlan, *, tmp: str, tag: str, threads: int) -> list[list[float]]:
    import torch.multiprocessing as mp

    from rayfleet.platform.rendezvous import host_store

    out = os.path.join(tmp, f"bare-{tag}.json")
    store = host_store(plan.world_size)  # the ranks join it as clients; held until they end
    mp.start_processes(_bare_worker, args=(plan.world_size, store.port, spec.model_dump(mode="json"), plan,
                                           spec.steps, out, threads), nprocs=plan.world_size, join=True,
                       start_method="spawn")
    return json.loads(Path(out).read_text())


def _platform_run(fleet, spec: TrainJobSpec, *, env: dict[str, str], timeout_s: float) -> list[dict]:
    """Submit ``spec`` as a rayfleet job (Ray job -> run_training -> Ray Train) with extra worker
    ``env``; returns rank 0's metric rows (``time_unix_s`` is the end of each step)."""
    from ray.job_submission import JobSubmissionClient

    from rayfleet.jobs.training_run import TrainingRun, encode_spec

    client = JobSubmissionClient(fleet.dashboard_url)
    job_id = client.submit_job(entrypoint=f"python -m rayfleet.jobs.train --spec-b64 {encode_spec(spec.to_dict())}",
                               runtime_env={"env_vars": {"RAY_AUTH_MODE": "token", **env}})
    run = TrainingRun(job_id=job_id, dashboard_url=fleet.dashboard_url, name=spec.name, _client=client)
    run.wait(timeout_s=timeout_s)
    rows = {int(r["step"]): r for r in run.metrics().rows}
    return [rows[s] for s in sorted(rows)]


def _step_s(ends: list[float], warmup: int) -> float:
    """Median wall seconds per step after ``warmup`` steps, from the end of one step to the end of
    the next: compute, collectives and everything between steps (reporting, hooks) are inside.
    A median, because other work on a shared machine lands as bursts on a few steps."""
    return statistics.median(b - a for a, b in zip(ends[warmup - 1:], ends[warmup:]))


def _between_steps_s(rows: list[dict], warmup: int) -> float:
    """Median time rank 0 spent outside ``train_step`` per step (the loop's all-gather, reporting,
    hooks, Ray): measured inside one run, so the machine's load cancels out."""
    ends = [r["time_unix_s"] for r in rows]
    return statistics.median(b - a - r["step_time_s"] for a, b, r in zip(ends[warmup - 1:], ends[warmup:],
                                                                          rows[warmup:]))


LOOP_NO_RAY = "rayfleet loop, no Ray"


def platform_vs_bare(*, steps: int, warmup: int, quick: bool, tmp: str, dataset: str, workers: int = 2,
                     spare_cores: int = 0) -> dict:
    """Tokens/s of the same job (a) through rayfleet + Ray Train and (b) as a bare loop, one run.

    Bare and platform runs alternate (bare first and last) and the medians of each kind are
    compared: the machine is shared, so a single pair would mostly measure the neighbours (the
    quick run, a pipeline check, runs each kind once). Without ``quick`` the platform also runs once with ``RAYFLEET_TRAIN_REPORT_INTERVAL_S=0``:
    ``ray.train.report`` every step, the paced behaviour issue 19 removed. ``LOOP_NO_RAY`` is
    rayfleet's own step loop (``train_worker``: metrics, hooks, health timing) on spawned gloo
    processes without Ray: it splits the overhead into the loop's and Ray's process environment's.
    ``workers`` ranks (1 or 2) share the same global batch and every run computes with the same
    intra-op threads per rank (``_threads_per_rank``). With ``spare_cores`` 0 the ranks take every
    core of the host; with 1 a core is left to the platform's own processes (raylet, GCS, Ray
    Train's controller, the job driver, the fleet's agents), as an accelerator server has cores
    to spare beside its ranks.
    """
    from rayfleet.jobs.local_processes import run_local
    from rayfleet.jobs.planning import job_plan, plan_inputs
    from rayfleet.platform.launcher import LocalFleet
    from rayfleet.platform.topology import build_topology

    spec = TrainJobSpec.model_validate({
        "name": "bench-platform", "model": {"preset": "tiny", "seed": 0}, "data": {"uri": dataset, "seq_len": SEQ},
        "plan": {"dp": workers, "micro_batch_size": PLATFORM_MICRO}, "precision": "fp32", "steps": steps,
        "global_batch_size": PLATFORM_MICRO * 2, "schedule": {"warmup_steps": 1},
        "resources": {"accelerator": "H100", "num_workers": workers}})
    tokens = spec.global_batch_size * SEQ
    plan = job_plan(plan_inputs(spec), world_size=workers, accelerator="H100").plan  # what the job itself will run
    threads = _threads_per_rank(workers, spare_cores)
    home = tempfile.mkdtemp(prefix="rayfleet-bench-home-", dir=tmp)
    local = LocalFleet.up(build_topology(num_nodes=1, accelerator="H100", accelerators_per_node=2), home=home)
    order = ["bare", LOOP_NO_RAY, "rayfleet"] if quick else \
        ["bare", LOOP_NO_RAY, "rayfleet", "bare", "rayfleet, report every step", "bare", LOOP_NO_RAY, "rayfleet",
         "bare"]
    runs: dict[str, list[list[dict]]] = defaultdict(list)
    try:
        for i, name in enumerate(order):
            if name == "bare":
                ends = _bare_run(spec, plan, tmp=tmp, tag=str(i), threads=threads)
                runs[name].append([{"time_unix_s": t, "compute_time_s": cpu} for t, cpu in ends])
            elif name == LOOP_NO_RAY:
                runs[name].append(list(run_local(spec, plan, threads_per_rank=threads,
                                                 in_process=False).metrics[0]))
            else:
                env = {THREADS_ENV: str(threads)}
                if "every step" in name:
                    env["RAYFLEET_TRAIN_REPORT_INTERVAL_S"] = "0"
                runs[name].append(_platform_run(local, spec, env=env, timeout_s=900))
            print(f"  measured {name}: {_step_s([r['time_unix_s'] for r in runs[name][-1]], warmup) * 1e3:.1f} "
                  f"ms/step", flush=True)
    finally:
        local.down()
        shutil.rmtree(local.temp_dir, ignore_errors=True)
    per_run = {name: [_step_s([r["time_unix_s"] for r in rows], warmup) for rows in rs] for name, rs in runs.items()}
    base_s = statistics.median(per_run["bare"])
    out = []
    for name, values in per_run.items():
        s = statistics.median(values)
        between = [_between_steps_s(rows, warmup) * 1e3 for rows in runs[name]] if name != "bare" else None
        cpu = statistics.median(r["compute_time_s"] for rows in runs[name] for r in rows[warmup:]) * 1e3
        out.append({"run": "bare torch.distributed (baseline)" if name == "bare" else name, "s_per_step": s,
                    "runs_s_per_step": values, "tokens_per_s": tokens / s, "ratio": base_s / s,
                    "overhead_ms_per_step": (s - base_s) * 1e3,
                    "between_steps_ms": statistics.median(between) if between else None,
                    "step_cpu_ms": cpu})
    return {"plan": plan.describe(), "model": "tiny", "precision": "fp32", "tokens_per_step": tokens,
            "steps": steps, "warmup": warmup, "order": order, "rows": out, "threads_per_rank": threads,
            "spare_cores": spare_cores, "cores": os.cpu_count(),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}


def print_platform(result: dict) -> None:
    rows = result["rows"]
    print(f"\nplatform vs bare loop: {result['plan']}, tiny MoE fp32, {result['tokens_per_step']} tokens/step, "
          f"{result.get('threads_per_rank', '?')} thread(s) per rank, {result.get('spare_cores', 0)} of "
          f"{result.get('cores', '?')} cores left to the platform, "
          f"median step-end to step-end after step {result['warmup']} of {result['steps']}, runs in the order "
          f"{' / '.join(result['order'])}")
    header = (f"{'run':<34}{'s/step':>8}{'tok/s':>9}{'ratio':>7}{'overhead ms/step':>18}{'between steps ms':>18}"
              f"{'step CPU ms':>13}  each run s/step")
    print(header)
    print("-" * len(header))
    for r in rows:
        between = "-" if r["between_steps_ms"] is None else f"{r['between_steps_ms']:.1f}"
        each = " ".join(f"{v:.3f}" for v in r["runs_s_per_step"])
        print(f"{r['run']:<34}{r['s_per_step']:>8.3f}{r['tokens_per_s']:>9.0f}{r['ratio']:>7.3f}"
              f"{r['overhead_ms_per_step']:>18.1f}{between:>18}{r['step_cpu_ms']:>13.1f}  {each}")
    print(f"goal: ratio >= 0.97 for steps >= 0.1 s. 'between steps' is rank 0's time outside train_step in the "
          f"same run (the loop's all-gather, reporting, hooks), independent of the machine's load. 'step CPU' is "
          f"rank 0's CPU time inside the step (median): equal CPU with a longer step means the rank waited "
          f"(for its peer or for a core), not that the platform added work to the step "
          f"(1-min load average at the end: {result['load_avg_1m_at_end']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/train_scaling.json")
    parser.add_argument("--quick", action="store_true",
                        help="fewer plans and steps; each platform-comparison run once, without the paced variant")
    parser.add_argument("--part", choices=("all", "scaling", "platform", "pipeline"), default="all")
    parser.add_argument("--platform-steps", type=int, default=60)
    parser.add_argument("--platform-workers", default=None,
                        help="comma-separated RANKS[:SPARE_CORES] for the platform comparison: SPARE_CORES of the "
                             "host are left to the platform's processes (default: 2,1:1; quick: 2)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.platform_steps = min(args.steps, 5), min(args.warmup, 2), 20
    platform_result, platform_more, bubbles = None, {}, None
    if args.part in ("all", "pipeline"):
        with tempfile.TemporaryDirectory(prefix="rayfleet-bench-") as tmp:
            bubbles = measure_bubbles(_dataset(tmp), tmp, microbatches=4 if args.quick else 8, steps=args.steps,
                                      warmup=args.warmup, repeats=1 if args.quick else 2)
        print_bubbles(bubbles)
        if args.part == "pipeline":
            _write_json(args.json, {"pipeline_bubble": bubbles})
            _record(args, [], bubbles=bubbles)
            return
    if args.part in ("all", "platform"):
        counts = [tuple(int(x) for x in (c + ":0").split(":")[:2])
                  for c in (args.platform_workers or ("2" if args.quick else "2,1:1")).split(",")]
        with tempfile.TemporaryDirectory(prefix="rayfleet-bench-") as tmp:
            dataset = _dataset(tmp)
            for count, spare in counts:
                result = platform_vs_bare(steps=args.platform_steps, warmup=5, quick=args.quick, tmp=tmp,
                                          dataset=dataset, workers=count, spare_cores=spare)
                if (count, spare) == counts[0]:
                    platform_result = result
                else:
                    platform_more[f"platform_vs_bare_{count}_workers_{spare}_spare"] = result
        if args.part == "platform":
            for result in [platform_result, *platform_more.values()]:
                print_platform(result)
            _write_json(args.json, {"platform_vs_bare": platform_result, **platform_more})
            _record(args, [platform_result, *platform_more.values()])
            return
    configs = [  # (plan, a2a overlap); global batch = MICRO x workers
        (ParallelPlan(dp=1, micro_batch_size=MICRO), False),
        (ParallelPlan(dp=2, micro_batch_size=MICRO), False),
        (ParallelPlan(dp=2, ep=2, micro_batch_size=MICRO), False),
        (ParallelPlan(dp=2, ep=2, micro_batch_size=MICRO), True),
        (ParallelPlan(tp=2, micro_batch_size=MICRO * 2), False),
        (ParallelPlan(dp=4, micro_batch_size=MICRO), False),
        (ParallelPlan(dp=4, ep=4, micro_batch_size=MICRO), False),
        (ParallelPlan(dp=4, ep=4, micro_batch_size=MICRO), True),
        (ParallelPlan(dp=2, tp=2, ep=2, micro_batch_size=MICRO * 2), True),
    ]
    if args.quick:  # the baseline, and EP with and without the overlap (the a2a hidden fraction)
        configs = [configs[0], configs[2], configs[3]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-") as tmp:
        dataset = _dataset(tmp)
        started = time.perf_counter()
        for plan, overlap in configs:
            # TP peers share data, so TP plans use tp x the micro-batch: the global batch is
            # MICRO x workers for every plan.
            row = _measure(dataset, plan, steps=args.steps, warmup=args.warmup, overlap=overlap,
                           data_ranks=plan.world_size, tmp=tmp)
            rows.append(row)
            print(f"  measured {row['plan']:<28} overlap={overlap!s:<5} {row['tokens_per_s']:8.0f} tok/s", flush=True)
        gpu = _gpu_fp8_vs_bf16(dataset, args.steps)
        elapsed = time.perf_counter() - started
    base = rows[0]["tokens_per_s"]
    cores = os.cpu_count() or 1
    print(f"\ntrain_scaling on {platform.machine()} {cores} cores, torch {torch.__version__}, gloo, tiny MoE "
          f"(bf16 autocast), {MICRO}x{SEQ} tokens per worker per step, median of steps {args.warmup + 1}..{args.steps}")
    header = (f"{'plan':<28}{'ovl':>4}{'wrk':>4}{'tok/s':>9}{'ideal':>8}{'ideal@cores':>12}{'eff':>6}"
              f"{'dp comm':>9}{'tp comm':>9}{'ep comm':>9}{'a2a hid':>8}{'MFU(H100)':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        n = r["workers"]
        ideal, capped = base * n, base * min(n, cores)
        r.update(ideal_tokens_per_s=ideal, core_capped_ideal=capped, efficiency_vs_capped=r["tokens_per_s"] / capped)
        share = r["comm_share"]
        hidden = "-" if r["a2a_hidden_fraction"] is None else f"{r['a2a_hidden_fraction']:.2f}"
        print(f"{r['plan']:<28}{'on' if r['overlap'] else 'off':>4}{n:>4}{r['tokens_per_s']:>9.0f}{ideal:>8.0f}"
              f"{capped:>12.0f}{r['efficiency_vs_capped']:>6.2f}{share['dp']:>9.1%}{share['tp']:>9.1%}"
              f"{share['ep']:>9.1%}{hidden:>8}{r['mfu']:>11.2e}")
    for g in gpu:
        print(f"GPU {g['precision']:<10} {g['tokens_per_s']:.0f} tok/s, MFU {g['mfu']:.1%}")
    if len(gpu) == 2:
        print(f"GPU FP8/BF16 end-to-end: {gpu[1]['tokens_per_s'] / gpu[0]['tokens_per_s']:.2f}x (goal >= 1.2x)")
    elif not gpu:
        print("FP8 vs BF16 speed: not measured (no CUDA device here; CPU FP8 GEMMs are emulated-speed)")
    print(f"total {elapsed:.0f} s")
    for result in [platform_result, *platform_more.values()] if platform_result is not None else []:
        print_platform(result)
    if bubbles is not None:
        print_bubbles(bubbles)
    _write_json(args.json, {"machine": platform.machine(), "cores": cores, "rows": rows, "gpu_fp8_vs_bf16": gpu,
                            "platform_vs_bare": platform_result, **platform_more, "pipeline_bubble": bubbles})
    _record(args, [platform_result, *platform_more.values()] if platform_result is not None else [], rows, gpu,
            bubbles=bubbles)


def _record(args, platform_results: list[dict], rows: list[dict] | None = None, gpu: list[dict] | None = None,
            *, bubbles: dict | None = None) -> None:
    """This run's ledger entry: the platform/bare goal (>= 0.97) for each platform comparison, FP8/BF16 on a GPU."""
    goals, table_rows = [], []
    for result in platform_results:
        bare = next(r for r in result["rows"] if r["run"].startswith("bare"))
        where = f"{result['plan']}, {result.get('spare_cores', 0)} core(s) spare"
        for r in result["rows"]:
            if r is bare:
                continue
            goals.append(Goal(f"{where}: {r['run']} tokens/s / bare loop's", ">=", 0.97, r["ratio"]))
            table_rows.append([where, " ".join(f"{v:.3f}" for v in bare["runs_s_per_step"]),
                               " ".join(f"{v:.3f}" for v in r["runs_s_per_step"]), f"{r['ratio']:.3f}",
                               str(result["load_avg_1m_at_end"])])
    if gpu and len(gpu) == 2:
        goals.append(Goal("GPU FP8 / BF16 tokens/s", ">=", 1.2, gpu[1]["tokens_per_s"] / gpu[0]["tokens_per_s"]))
    tables = {}
    if bubbles is not None:
        tables["pipeline_bubble"] = Table(
            ["schedule", "plan", "micro-batches", "measured bubble", "model bubble", "pipeline s", "model s"],
            [[r["schedule"], r["plan"], str(r["microbatches"]), f"{r['measured_bubble']:.3f}",
              f"{r['model_bubble']:.3f}", f"{r['pipeline_s']:.3f}", f"{r['model_pipeline_s']:.3f}"]
             for r in bubbles["rows"]])
    if table_rows:
        tables["platform_vs_bare"] = Table(["plan / cores left to the platform", "bare s/step", "rayfleet s/step",
                                            "platform/bare", "load at end"], table_rows)
    record_run(name="train_scaling", quick=args.quick,
               params={"part": args.part, "steps": args.steps, "warmup": args.warmup,
                       "platform_steps": args.platform_steps, "platform_workers": args.platform_workers},
               figures={"platform_vs_bare": platform_results, "rows": rows, "gpu_fp8_vs_bf16": gpu,
                        "pipeline_bubble": bubbles},
               goals=goals, tables=tables)


def _write_json(path: str, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
