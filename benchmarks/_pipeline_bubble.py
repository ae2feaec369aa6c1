"""Pipeline bubble measured beside the cost model's: 1F1B, interleaved 1F1B (VP2) and DualPipeV at
the same ``pp`` and micro-batch count (issue 28 item 7). A helper of ``train_scaling.py --part pipeline``.

What runs: the real train loop (``train_worker`` on gloo ranks through ``run_local_many``, the
same step code as a Ray Train job) of a tiny MoE over ``pp`` ranks, one plan after another in
the same processes.

How the bubble is measured: a hook installed in each rank wraps the compute calls of
``torch.distributed.pipelining``'s stages (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``) and the loss, and the whole ``PipelineRunner.forward_backward``,
with ``perf_counter``. A rank's *busy* time is the sum of its compute calls (the schedule waits
for received activations and gradients outside them); its pipeline time is the whole
``forward_backward``. Measured bubble = ``1 - busy / pipeline`` per rank and step, median over
the steps after warm-up (of every repeat), mean over ranks. The schedules run ``repeats`` times in
alternating order (1F1B, VP2, DualPipeV, then backwards), so a load change on a shared machine
does not fall on one schedule only.

The cost model's bubble: ``placement.pipeline_schedule.pipeline_seconds`` priced with each
rank's measured per-micro-batch busy time as its stage time (and, for DualPipeV, its measured
backward and weight-gradient times), then ``1 - m * mean(stage time) / pipeline_seconds``: the
mean idle share of a rank, as measured. The gap between the two is what the model leaves out
on this machine: point-to-point latency and Python overhead between actions, and cores shared
between ranks (the 1-minute load average is printed beside the table).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rayfleet.jobs.local_processes import run_local_many
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_state import TrainHooks
from rayfleet.placement.pipeline_schedule import pipeline_seconds
from rayfleet.placement.plan import ParallelPlan

__all__ = ["measure_bubbles", "print_bubbles"]

_ACTIVE: dict[str, float] | None = None  # the current step's timings on this rank (set by BubbleProbe)
_COMPUTE = ("forward", "backward", "backward_input", "backward_weight", "loss")


def _timed(key_of, fn):
    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            if _ACTIVE is not None:
                key = key_of(args, kwargs)
                _ACTIVE[key] += time.perf_counter() - start
                _ACTIVE[key + ":cpu"] += time.thread_time() - cpu
    wrapper.__wrapped_for_bubble__ = True
    return wrapper


def _install() -> None:
    """Wrap the stage compute calls and the runner once per process (class attributes)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from rayfleet.jobs.parallel.pipeline import PipelineRunner

    if getattr(_PipelineStageBase.forward_one_chunk, "__wrapped_for_bubble__", False):
        return
    full = lambda a, k: "backward" if k.get("full_backward", a[3] if len(a) > 3 else True) else "backward_input"
    _PipelineStageBase.forward_one_chunk = _timed(lambda a, k: "forward", _PipelineStageBase.forward_one_chunk)
    _PipelineStageBase.backward_one_chunk = _timed(full, _PipelineStageBase.backward_one_chunk)
    _PipelineStageBase.backward_weight_one_chunk = _timed(lambda a, k: "backward_weight",
                                                          _PipelineStageBase.backward_weight_one_chunk)
    PipelineRunner._call_loss = _timed(lambda a, k: "loss", PipelineRunner._call_loss)
    PipelineRunner.forward_backward = _timed(lambda a, k: "pipeline", PipelineRunner.forward_backward)


class BubbleProbe(TrainHooks):
    """Per rank: each step's compute and pipeline seconds, written as JSON at the end of each run."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.run, self.rank, self.steps = out_dir, -1, 0, []

    def on_start(self, *, rank: int, **_: Any) -> None:
        _install()
        self.run, self.rank, self.steps = self.run + 1, rank, []

    def before_step(self, step: int) -> None:
        global _ACTIVE
        _ACTIVE = defaultdict(float)

    def after_step(self, step: int, **_: Any) -> None:
        global _ACTIVE
        self.steps.append(dict(_ACTIVE or {}))
        _ACTIVE = None

    def on_end(self, summary: Any, **_: Any) -> None:
        Path(self.out_dir, f"run{self.run}-rank{self.rank}.json").write_text(json.dumps(self.steps))


def _plans(pp: int, mbs: int) -> list[tuple[str, ParallelPlan]]:
    return [("1F1B", ParallelPlan(pp=pp, micro_batch_size=mbs)),
            ("interleaved VP2", ParallelPlan(pp=pp, vpp=2, micro_batch_size=mbs)),
            ("DualPipeV", ParallelPlan(pp=pp, dualpipe=True, micro_batch_size=mbs))]


def _row(name: str, plan: ParallelPlan, ranks: list[list[dict[str, float]]], *, m: int) -> dict:
    """``ranks[r]``: rank ``r``'s measured steps (warm-up steps already dropped)."""
    def median(rank_steps: list[dict[str, float]], keys: tuple[str, ...]) -> float:
        return statistics.median(sum(s.get(k, 0.0) for k in keys) for s in rank_steps)

    idle = [statistics.median(1 - sum(s.get(k, 0.0) for k in _COMPUTE) / s["pipeline"] for s in steps)
            for steps in ranks]
    busy = [median(steps, _COMPUTE) / m for steps in ranks]  # per micro-batch, all chunks of the rank
    busy_cpu = [median(steps, tuple(f"{k}:cpu" for k in _COMPUTE)) / m for steps in ranks]
    backward = [median(steps, ("backward", "backward_input", "backward_weight")) / m for steps in ranks]
    weight = [median(steps, ("backward_weight",)) / m for steps in ranks]
    wall = statistics.mean(median(steps, ("pipeline",)) for steps in ranks)
    model_s = pipeline_seconds(busy, num_microbatches=m, vpp=plan.vpp, dualpipe=plan.dualpipe,
                               stage_backward_s=backward if plan.dualpipe else (),
                               stage_weight_grad_s=weight if plan.dualpipe else ())
    return {"schedule": name, "plan": plan.describe(), "pp": plan.pp, "microbatches": m,
            "measured_bubble": statistics.mean(idle), "model_bubble": 1 - m * statistics.mean(busy) / model_s,
            "pipeline_s": wall, "model_pipeline_s": model_s, "busy_s_per_microbatch": busy,
            "busy_cpu_s_per_microbatch": busy_cpu,
            "backward_s_per_microbatch": backward, "weight_grad_s_per_microbatch": weight}


def measure_bubbles(dataset: str, tmp: str, *, pp: int = 2, microbatches: int = 8, mbs: int = 2, seq: int = 64,
                    num_layers: int = 8, steps: int = 6, warmup: int = 2, repeats: int = 2) -> dict:
    """Run 1F1B, interleaved VP2 and DualPipeV with ``microbatches`` per step over ``pp`` ranks,
    ``repeats`` times in alternating order; one row per schedule (measured and modelled bubble, seconds)."""
    spec = TrainJobSpec.model_validate({
        "name": "bubble", "model": {"preset": "tiny", "config": {"num_layers": num_layers}},
        "data": {"uri": dataset, "seq_len": seq}, "steps": steps, "global_batch_size": microbatches * mbs,
        "precision": "fp32", "comm": {"a2a_overlap": False}})
    out_dir = Path(tmp, "bubble")
    out_dir.mkdir(parents=True, exist_ok=True)
    plans = _plans(pp, mbs)
    order = [i for rep in range(repeats) for i in (range(len(plans)) if rep % 2 == 0 else reversed(range(len(plans))))]
    run_local_many(spec, [(plans[i][1], {}) for i in order], hooks=BubbleProbe(str(out_dir)))
    measured: dict[int, list[list[dict[str, float]]]] = {i: [[] for _ in range(pp)] for i in range(len(plans))}
    for run, i in enumerate(order):
        for r in range(pp):
            measured[i][r] += json.loads(Path(out_dir, f"run{run}-rank{r}.json").read_text())[warmup:]
    rows = [_row(name, plan, measured[i], m=microbatches) for i, (name, plan) in enumerate(plans)]
    return {"rows": rows, "steps": steps, "warmup": warmup, "repeats": repeats, "tokens_per_microbatch": mbs * seq,
            "num_layers": num_layers, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}


def print_bubbles(result: dict) -> None:
    rows = result["rows"]
    print(f"\npipeline bubble: tiny MoE, {result['num_layers']} layers, PP{rows[0]['pp']}, {rows[0]['microbatches']} "
          f"micro-batches of {result['tokens_per_microbatch']} tokens, gloo ranks, median of steps "
          f"{result['warmup'] + 1}..{result['steps']} of {result['repeats']} runs each "
          f"(1-min load average at the end: {result['load_avg_1m_at_end']})")
    header = (f"{'schedule':<18}{'measured':>10}{'model':>8}{'pipeline s':>12}{'model s':>9}"
              f"{'busy ms/mb by rank':>22}{'of it CPU ms':>16}")
    print(header)
    print("-" * len(header))
    for r in rows:
        busy = " ".join(f"{1e3 * b:.1f}" for b in r["busy_s_per_microbatch"])
        cpu = " ".join(f"{1e3 * b:.1f}" for b in r["busy_cpu_s_per_microbatch"])
        print(f"{r['schedule']:<18}{r['measured_bubble']:>10.3f}{r['model_bubble']:>8.3f}{r['pipeline_s']:>12.3f}"
              f"{r['model_pipeline_s']:>9.3f}{busy:>22}{cpu:>16}")
    print("bubble = idle share of a rank's pipeline time (1 - compute / pipeline); model = "
          "placement/pipeline_schedule.py priced with the measured per-micro-batch compute of each rank; "
          "CPU = the compute calls' own thread CPU time (busy wall minus CPU: the rank computing without a core)")
