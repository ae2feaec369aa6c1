"""The train loop on the device: ``train_worker`` over a real NCCL process group of one rank
(what a Ray Train GPU worker runs, without Ray), against the same job on CPU over gloo.

Checks: fp32 losses on the device track the CPU run step for step (relative 1e-4 per step over
20 steps: both compute the same sums in different orders, and the gap may grow through the
optimizer but stays far below what a wrong gradient makes); a run resumed on the device from a
state captured mid-run (model, optimizer, data position, CPU and CUDA RNG) continues with the
same losses (relative 1e-5: MoE scatter-adds on CUDA use atomics, so bit-equality is not
promised); then tokens/s and MFU of BF16 and FP8 runs of the ``small`` preset (measured, priced
by the loop against the catalogue peak of the GPU it found).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import loop_config
from rayfleet.jobs.train_state import TrainHooks, TrainState
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.rendezvous import host_store
from rayfleet.storage.tokens import prepare_token_dataset

LOSS_RTOL, RESUME_RTOL = 1e-4, 1e-5


def _accelerator(ctx) -> str:
    name = torch.cuda.get_device_name(ctx.device) if ctx.on_cuda else ""
    return "H200" if "H200" in name else "H100"  # the catalogue prices MFU; CPU runs claim an H100


def _spec(ctx, dataset: str, *, preset: str, precision: str, steps: int, batch: int, seq: int) -> TrainJobSpec:
    return TrainJobSpec.model_validate({
        "name": f"gpu-check-{preset}-{precision}", "model": {"preset": preset},
        "data": {"uri": dataset, "seq_len": seq}, "steps": steps, "global_batch_size": batch,
        "precision": precision, "schedule": {"warmup_steps": 2}, "comm": {"a2a_overlap": False},
        "resources": {"accelerator": _accelerator(ctx)}})


class _Capture(TrainHooks):
    """Keeps a deep copy of the state after step ``at`` (what a checkpoint would hold)."""

    def __init__(self, at: int) -> None:
        self.at, self.state = at, None

    def after_step(self, step: int, *, state_fn, **_: Any) -> None:
        if step + 1 == self.at:
            live = state_fn()  # references to the live tensors: copy every field
            copy = lambda tree: pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                                tree)
            self.state = TrainState(step=live.step, model=copy(dict(live.model)), optimizer=copy(dict(live.optimizer)),
                                    data=copy(dict(live.data)), rng=copy(dict(live.rng)), extra=dict(live.extra))


def _run(loop, *, backend: str, device: str, **options: Any):
    """``train_worker`` in this process over a one-rank group of ``backend``; (summary, metrics)."""
    from rayfleet.jobs.loop import train_worker

    dist.init_process_group(backend, store=host_store(1), rank=0, world_size=1,
                            **({"device_id": torch.device(device)} if backend == "nccl" else {}))
    try:
        metrics: list[dict] = []
        summary = train_worker(loop, ParallelPlan(dp=1, micro_batch_size=loop.global_batch_size),
                               report=metrics.append, device=device, **options)
        return summary, metrics
    finally:
        dist.destroy_process_group()


def run(ctx) -> None:
    if ctx.on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if ctx.on_cuda else "gloo"
    device = str(ctx.device)
    steps, batch, seq = (6, 4, 32) if ctx.quick else (20, 8, 128)
    with tempfile.TemporaryDirectory(prefix="rayfleet-gpu-check-") as tmp:
        dataset = os.path.join(tmp, "tokens")
        src = os.path.join(os.path.dirname(os.__file__), "email")  # the standard library's own text
        prepare_token_dataset([src], dataset, shard_tokens=1 << 16, seq_len=seq)
        loop = loop_config(_spec(ctx, dataset, preset="tiny", precision="fp32", steps=steps, batch=batch, seq=seq))
        cpu_summary, _ = _run(loop, backend="gloo", device="cpu")
        capture = _Capture(steps // 2)
        summary, metrics = _run(loop, backend=backend, device=device, hooks=capture)
        rel = [abs(a - b) / abs(b) for a, b in zip(summary.losses, cpu_summary.losses)]
        ctx.record("fp32_losses_track_cpu", len(rel) == steps and max(rel) <= LOSS_RTOL,
                   f"{backend} on {device} vs gloo on cpu, {steps} steps: worst relative loss gap {max(rel):.2e} "
                   f"(tol {LOSS_RTOL:g}); first {summary.losses[0]:.4f}, last {summary.losses[-1]:.4f}",
                   worst_rel_gap=max(rel), losses_device=list(summary.losses), losses_cpu=list(cpu_summary.losses))
        state: TrainState = capture.state
        has_cuda_rng = "cuda" in state.rng
        resumed, _ = _run(loop, backend=backend, device=device, resume=state)
        tail = summary.losses[state.step:]
        gaps = [abs(a - b) / abs(b) for a, b in zip(resumed.losses, tail)]
        ok = len(gaps) == len(tail) > 0 and max(gaps) <= RESUME_RTOL and (has_cuda_rng or not ctx.on_cuda)
        ctx.record("resume_continues_exactly", ok,
                   f"resumed at step {state.step} on {device}: worst relative loss gap {max(gaps):.2e} over "
                   f"{len(gaps)} steps (tol {RESUME_RTOL:g}); CUDA RNG state captured: {has_cuda_rng}",
                   worst_rel_gap=max(gaps), resumed_at=state.step, cuda_rng_captured=has_cuda_rng)
        _throughput(ctx, dataset, backend, device, tmp)


def _throughput(ctx, dataset: str, backend: str, device: str, tmp: str) -> None:
    preset, steps, batch, seq = ("tiny", 4, 4, 32) if ctx.quick else ("small", 30, 16, 1024)
    if not ctx.quick:  # the small preset trains on 1024-token samples: a dataset cut for them
        dataset = os.path.join(tmp, "tokens-1024")
        lib = os.path.dirname(os.__file__)  # a few MB of the standard library's packages (never site-packages)
        prepare_token_dataset([os.path.join(lib, d) for d in ("asyncio", "email", "json", "unittest", "xml")],
                              dataset, shard_tokens=1 << 20, seq_len=seq, glob="*.py")
    for precision in ("bf16", "tensorwise"):
        if ctx.time_left_s() < 90:
            ctx.skip(f"throughput.{precision}", f"{ctx.time_left_s():.0f} s left of the run's budget")
            continue
        loop = loop_config(_spec(ctx, dataset, preset=preset, precision=precision, steps=steps, batch=batch, seq=seq))
        try:
            summary, metrics = _run(loop, backend=backend, device=device)
        except RuntimeError as exc:  # a precision the device refuses is a failed check, not a lost group
            ctx.record(f"throughput.{precision}", False, f"training raised {type(exc).__name__}: {str(exc)[:300]}")
            continue
        steady = metrics[len(metrics) // 3:]  # after compilation of kernels and allocator warm-up
        tps = sorted(m["tokens_per_s"] for m in steady)[len(steady) // 2]
        mfu = sorted(m["mfu"] for m in steady)[len(steady) // 2]
        ctx.record(f"throughput.{precision}", None,
                   f"{preset} preset, {batch}x{seq} tokens/step on {device}: {tps:,.0f} tokens/s, MFU {mfu:.3f} "
                   f"(of the catalogue {_accelerator(ctx)} peak for {precision}); loss {summary.losses[0]:.3f} -> "
                   f"{summary.losses[-1]:.3f}", tokens_per_s=tps, mfu=mfu, preset=preset, steps=steps,
                   first_loss=summary.losses[0], last_loss=summary.losses[-1])
