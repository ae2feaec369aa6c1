"""Training throughput: tokens/s for 1, 2 and 4 workers beside the ideal, the communication
share of step time per parallel dimension, the a2a hidden fraction, and the MFU estimate.

    python benchmarks/train_scaling.py [--steps 8] [--json benchmarks/results/train_scaling.json]

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

Where CUDA is available, the same script also compares FP8 (tensorwise) with BF16 end to end
on the ``small`` preset in one process (goal: FP8 >= 1.2x BF16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rayfleet.jobs.local_processes import run_local_many  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.jobs.train_state import TrainHooks  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from rayfleet.storage.tokens import prepare_token_dataset  # noqa: E402

MICRO = 4
SEQ = 64
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/train_scaling.json")
    args = parser.parse_args()
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
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": platform.machine(), "cores": cores, "rows": rows,
                                               "gpu_fp8_vs_bf16": gpu}, indent=1))


if __name__ == "__main__":
    main()
