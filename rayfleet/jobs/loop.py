"""The train loop run by every worker: build, parallelize, then step with exact loss averaging.

Design decisions:
- The loop reads only its slice of the job, a frozen ``train_job.LoopConfig`` (model config,
  data, optimizer, schedule, precision), cut once from the validated spec in the driver.
- Fixed order, as torchtitan: build on meta -> materialize from the job's seed (identical on
  every rank) -> FP8 converter (before any wrapper, so FSDP/TP shard the converted modules'
  unchanged parameters) -> ``parallelize_model`` -> AdamW. The loop never branches on FP8:
  precision only picks the autocast dtype (BF16 around everything but FP8 GEMMs; FP32 none).
- Loss averaging: the step's loss is ``sum of token losses / tokens of the whole global
  batch``, whatever the split. Each micro-batch backpropagates ``sum(token losses) *
  grad_divide / global_tokens``, where ``grad_divide`` is what the data-parallel gradient
  reduction divides by (``ctx.grad_divide_factor``, default ``ctx.dp_size``: FSDP2 averages
  over data-distinct ranks). Replicas with more micro-batches (mixed fleets) thus weigh
  exactly by their tokens; averaging per-replica means instead is wrong whenever replicas
  hold different token counts (``loss_averaging="replica_mean_control"`` keeps that broken
  rule reachable for the test that must catch it).
- Gradient accumulation under FSDP2: gradient sync only on the last micro-batch. When the
  replicas' micro-batch counts differ, parameters also stay unsharded through the step, so
  every rank issues the same collectives (one all-gather, one reduce-scatter per group)
  whatever its count — otherwise a replica with more micro-batches would issue more
  all-gathers and the group would deadlock.
- One small all-gather per step carries (loss sum, tokens, step time, compute time, stop flag)
  of every rank: the reported loss, tokens/s, per-rank step and compute times and a stop
  decision that all ranks take at the same step come from it. Only one rank per data shard (TP rank 0, last PP stage)
  contributes loss and tokens, so TP peers are not double counted.
- Each rank's *compute* time (CPU time of the training thread over ``train_step``; the whole
  process's when torch runs several intra-op threads) is gathered beside its wall time: a
  blocking collective wait sleeps and adds nothing to it, so a straggler stands out while every
  rank's wall time is equal (they all leave the last collective together). This is what the
  slow-rank policy reads. On CUDA it is host time (kernels run asynchronously): not a measure
  of a slow GPU; the slow-rank check is validated on the CPU fleet only.
- Expert loads are summed over micro-batches, then over data-distinct ranks
  (``sync_expert_load``), then drive the router-bias update after the optimizer step, so every
  replica moves its biases identically and the run matches a single-process one.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rayfleet.jobs.data import DistributedTokenLoader, StepBatch, TokenSamples
from rayfleet.jobs.evaluation import build_evaluator, eval_metrics
from rayfleet.jobs.health.monitor import FaultInjection, burn_cpu
from rayfleet.jobs.train_metrics import expert_load_stats, mfu, model_flops_per_token
from rayfleet.jobs.optim import build_optimizer, lr_at, set_lr
from rayfleet.jobs.spec import is_fp8_precision
from rayfleet.jobs.train_job import LoopConfig
from rayfleet.jobs.train_state import HookChain, TrainHooks, TrainState, TrainSummary, capture_rng, restore_rng
from rayfleet.models import MoELayer, build_model, materialize
from rayfleet.models.fp8 import convert_to_fp8
from rayfleet.placement.plan import ParallelPlan

__all__ = ["train_worker", "LossAveraging", "loss_scale", "sample_ids_hash", "PolledFlag"]

LossAveraging = Literal["global_tokens", "replica_mean_control"]


def sample_ids_hash(ids: tuple[int, ...] | list[int]) -> int:
    """Order-sensitive 63-bit hash of a batch's sample ids (to compare runs cheaply)."""
    digest = hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def loss_scale(averaging: LossAveraging, *, local_tokens: int, global_tokens: int, grad_divide: float) -> float:
    """Factor on a micro-batch's *summed* token loss before backward.

    With gradients then averaged over ``grad_divide`` data-distinct ranks, ``"global_tokens"``
    yields the gradient of (all token losses of the global batch) / (its tokens) for any split.
    ``"replica_mean_control"`` is BROKEN ON PURPOSE (mean of per-replica means).
    """
    if averaging == "global_tokens":
        return grad_divide / global_tokens
    if averaging == "replica_mean_control":
        return 1.0 / local_tokens
    raise ValueError(f"unknown loss averaging {averaging!r}")


class PolledFlag:
    """A boolean a daemon thread refreshes from ``poll()`` every ``period_s`` (0 for a long poll;
    a raising poll is retried after 1 s); reading it never blocks: a stop signal in another
    process costs the step no round trip, the stop at most ``period_s``."""

    def __init__(self, poll: Callable[[], bool], *, period_s: float = 0.5) -> None:
        self._poll, self._period_s, self.value, self._done = poll, period_s, False, threading.Event()
        threading.Thread(target=self._run, name="rayfleet-stop-poll", daemon=True).start()

    def _run(self, wait_s: float = 0.0) -> None:
        while not self.value and not self._done.wait(wait_s or self._period_s):
            try:
                self.value, wait_s = bool(self._poll()), 0.0
            except Exception as exc:  # noqa: BLE001 - the signal's owner went away: keep training
                print(f"rayfleet: stop signal unreadable ({exc})", flush=True)
                wait_s = max(self._period_s, 1.0)

    def __call__(self) -> bool:
        return self.value

    def close(self) -> None:
        self._done.set()


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _local_logits(logits: torch.Tensor) -> torch.Tensor:
    full = getattr(logits, "full_tensor", None)  # a DTensor from a TP output layer
    return full() if callable(full) else logits


class _Run:
    """One worker's training run: the objects a step touches and their state."""

    def __init__(self, loop: LoopConfig, plan: ParallelPlan, ctx: Any, *, loss_averaging: LossAveraging,
                 par: ModuleType, grad_probe: str | None = None) -> None:
        self.loop, self.plan, self.ctx, self.par = loop, plan, ctx, par
        self.grad_probe = grad_probe
        self.device = torch.device(ctx.device)
        self.loss_averaging = loss_averaging
        self.config = loop.model
        model = build_model(self.config, device="meta")
        materialize(model, device=self.device, seed=loop.seed)
        if loop.hf is not None:  # start from an HF checkpoint (before FP8 and parallelization)
            from rayfleet.jobs.hf_init import load_hf_into

            load_hf_into(model, loop.hf)
        if is_fp8_precision(loop.precision):
            convert_to_fp8(model, loop.precision)
        self.model = par.parallelize_model(model, ctx)
        self.moe_layers = _moe_layers(self.model)
        self.moe_index = {id(m): i for i, m in enumerate(self.moe_layers)}
        self.expert_load = torch.zeros(len(self.moe_layers), self.config.num_experts, dtype=torch.int64)
        for layer in self.moe_layers:
            layer.register_forward_hook(self._count_load)
        opt = loop.optimizer
        self.optimizer = build_optimizer(self.model, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                         weight_decay=opt.weight_decay)
        samples = TokenSamples(loop.data.uri, loop.data.seq_len)
        self.loader = DistributedTokenLoader(
            samples, global_batch_size=loop.global_batch_size, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
            micro_batch_size=plan.micro_batch_size, replica_microbatches=plan.replica_microbatches,
            shuffle=loop.data.shuffle, seed=loop.data.seed)
        counts = plan.replica_microbatches
        self.uneven = counts is not None and len(set(counts)) > 1
        self.grad_divide = float(getattr(ctx, "grad_divide_factor", None) or ctx.dp_size)
        self.owns_loss = getattr(ctx, "tp_rank", 0) == 0 and getattr(ctx, "pp_rank", 0) == plan.loss_pp_rank
        self.evaluator = build_evaluator(loop, plan=plan, ctx=ctx, owns_loss=self.owns_loss, device=self.device,
                                         autocast=lambda: _autocast(self.device, loop.precision))
        self.step = 0
        self.flops_per_token = model_flops_per_token(self.config)
        types = plan.replica_accelerators
        self.rank_accelerators = [types[plan.coords(r).dp] if types else loop.accelerator
                                  for r in range(ctx.world_size)]

    # -- state ------------------------------------------------------------------------------
    def state(self) -> TrainState:
        fresh = not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if fresh:
            # get_state_dict creates missing optimizer state with a zero-lr step, which leaves
            # AdamW's step counter at 1 (wrong bias correction for the real first step): put it
            # back to 0 so asking for the state never changes the run.
            for param_state in self.optimizer.state.values():
                step = param_state.get("step")
                if isinstance(step, torch.Tensor):
                    step.zero_()
        self.par.to_checkpoint_layout(model_sd, optim_sd, self.ctx)
        return TrainState(step=self.step, model=model_sd, optimizer=optim_sd, data=self.loader.state_dict(),
                          rng=capture_rng(self.device), extra={"world_size": self.ctx.world_size})

    def load(self, state: TrainState) -> None:
        model_sd, optim_sd = dict(state.model), dict(state.optimizer)
        if "state" in optim_sd:
            optim_sd["state"] = dict(optim_sd["state"])
        self.par.from_checkpoint_layout(model_sd, optim_sd, self.model, self.ctx)
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        self.loader.load_state_dict(dict(state.data))
        restore_rng(state.rng, self.device)
        self.step = int(state.step)

    # -- one step -----------------------------------------------------------------------------
    def _set_accumulating(self, accumulating: bool) -> None:
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(not accumulating)
            if self.uneven:
                self.model.set_reshard_after_backward(not accumulating)

    def _count_load(self, module: MoELayer, _inputs: Any, _output: Any) -> None:
        # Forward hook, so pipeline schedules (which run micro-batches themselves) count too.
        # Skipped inside backward: activation recompute re-runs forwards there.
        if torch._C._current_graph_task_id() == -1:
            self.expert_load[self.moe_index[id(module)]] += module.last_tokens_per_expert.to(self.expert_load.device)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, *, local_tokens: int) -> torch.Tensor:
        """Scaled loss of one micro-batch to backpropagate; records its unscaled token-loss sum."""
        logits = _local_logits(logits)
        token_loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         reduction="sum")
        self.loss_sums.append(float(token_loss_sum.detach()))
        scale = loss_scale(self.loss_averaging, local_tokens=local_tokens, grad_divide=self.grad_divide,
                           global_tokens=self.loop.global_batch_size * self.loop.data.seq_len)
        return token_loss_sum * scale

    def forward_backward(self, batch: StepBatch) -> tuple[float, int, torch.Tensor]:
        """(local loss sum, local target tokens, local expert load ``[moe_layers, E]``)."""
        local_tokens = batch.num_local_tokens // self.plan.cp  # a CP rank holds 1/cp of each sequence
        self.loss_sums: list[float] = []
        self.expert_load.zero_()
        micro = [self.par.model_inputs(mb.to(self.device, non_blocking=True), cp_rank=getattr(self.ctx, "cp_rank", 0),
                                       cp=self.plan.cp) for mb in batch.microbatches]  # (inputs, targets)
        if self.plan.pp > 1:
            pipeline = getattr(self.par, "pipeline_forward_backward", None)
            if pipeline is None:
                raise RuntimeError("plan.pp > 1 needs rayfleet.jobs.parallel.pipeline_forward_backward")
            with _autocast(self.device, self.loop.precision):
                pipeline(self.model, self.ctx, inputs=[x for x, _ in micro], targets=[y for _, y in micro],
                         loss_fn=lambda logits, targets: self._loss(logits, targets, local_tokens=local_tokens))
            return sum(self.loss_sums), local_tokens, self.expert_load.clone()
        if self.uneven and hasattr(self.model, "set_reshard_after_forward"):
            self.model.set_reshard_after_forward(False)
        for i, (inputs, targets) in enumerate(micro):
            self._set_accumulating(i < len(micro) - 1)
            with _autocast(self.device, self.loop.precision):
                logits = self.model(inputs)
            self._loss(logits, targets, local_tokens=local_tokens).backward()
        return sum(self.loss_sums), local_tokens, self.expert_load.clone()

    def train_step(self) -> tuple[StepBatch, dict[str, float | list[float]], float, float]:
        """Run one optimizer step; returns (batch, partial metrics, loss sum, tokens)."""
        sched = self.loop.schedule
        lr = lr_at(self.step, lr=self.loop.optimizer.lr, total_steps=self.loop.steps,
                   warmup_steps=sched.warmup_steps, min_lr_ratio=sched.min_lr_ratio, kind=sched.kind)
        set_lr(self.optimizer, lr)
        batch = self.loader.next_batch()
        self.ctx.a2a.reset()
        loss_sum, tokens, load = self.forward_backward(batch)
        self.par.finalize_gradients(self.model, self.ctx)
        probe = self.par.full_grad(self.model, self.grad_probe, self.ctx) if self.grad_probe else None
        max_norm = self.loop.grad_clip if self.loop.grad_clip is not None else float("inf")
        grad_norm = float(self.par.clip_grad_norm_(self.model, max_norm, self.ctx))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        layers = self.moe_layers
        global_load = self.par.sync_expert_load(load.to(self.device), self.ctx) if layers else load
        for layer, layer_load in zip(layers, global_load):
            layer.update_router_bias(layer_load)
        high, mean = expert_load_stats(global_load)
        self.step += 1
        partial = {"lr": lr, "grad_norm": grad_norm, "expert_load_max": high, "expert_load_mean": mean}
        if probe is not None:
            partial["grad_probe"] = probe
        return batch, partial, loss_sum, tokens


def train_worker(loop: LoopConfig, plan: ParallelPlan, *, report: Callable[[dict], None],
                 should_stop: Callable[[], bool] | None = None, resume: TrainState | None = None,
                 hooks: TrainHooks | Sequence[TrainHooks] | None = None, device: torch.device | str | None = None,
                 loss_averaging: LossAveraging = "global_tokens", misroute_experts: bool = False,
                 grad_probe: str | None = None, cp_control: str = "none", etp_control: str = "none") -> TrainSummary:
    """Train ``loop`` (the job's loop slice) with ``plan`` on this rank; ``torch.distributed`` must be initialized.

    ``report(metrics)`` is called on every rank after every step (keys: ``metrics.METRIC_KEYS``).
    ``should_stop()`` is polled every step on every rank; when any rank says stop, all stop after
    the same step. ``resume`` continues from a saved :class:`TrainState`. ``hooks``: one, or several
    called in order. ``device`` defaults to the current CUDA device when CUDA is available, else
    CPU. At the end rank 0 writes the full model to ``loop.output_uri`` (all ranks take part in
    gathering it); a stopped run saves no final model (its state is the checkpoint hooks' business).
    ``misroute_experts``, ``cp_control``, ``etp_control``: the deliberately broken EP dispatch, CP attention
    (``CPControl``) and ETP reduce (``ETPControl``) the parity tests must catch (never set them otherwise).
    ``grad_probe`` names a parameter whose whole gradient (before clipping) is added to every
    step's metrics as ``grad_probe`` (a tensor; for tests, not for Ray reporting).
    """
    if not dist.is_initialized():
        raise RuntimeError("train_worker needs torch.distributed initialized (Ray Train or init_process_group)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    # Imported here so that this module's pure pieces (loss_scale, ...) import on their own.
    from rayfleet.jobs import parallel as par

    hooks = HookChain([h for h in hooks if h is not None]) if isinstance(hooks, (list, tuple)) else hooks or TrainHooks()
    ctx = par.build_parallel_context(plan, device=torch.device(device), a2a_overlap=loop.a2a_overlap,
                                     fp8_dispatch=loop.fp8_dispatch, misroute_experts=misroute_experts,
                                     cp_control=cp_control, cp_exchange=loop.cp_exchange, etp_control=etp_control)
    run = _Run(loop, plan, ctx, loss_averaging=loss_averaging, par=par, grad_probe=grad_probe)
    if resume is not None:
        run.load(resume)
    hooks.on_start(rank=ctx.rank, world_size=ctx.world_size, plan=plan, step=run.step, state_fn=run.state,
                   load_fn=run.load)  # a checkpoint hook may restore here (load_fn)
    first_step = run.step
    losses: list[float] = []
    hashes: list[int] = []
    total_tokens, stopped = 0, False
    started = time.perf_counter()
    faults = FaultInjection.from_env()
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
    own_compute = 0.0  # the previous step's compute without injected slowness (debug faults only)
    while run.step < loop.steps:
        if faults.hang_rank == ctx.rank and faults.hang_step == run.step and first_step == 0:
            print(f"rayfleet debug: rank {ctx.rank} hangs before step {run.step} (RAYFLEET_DEBUG_HANG_RANK)", flush=True)
            threading.Event().wait()  # forever: the other ranks block in this step's first collective
        hooks.before_step(run.step)
        t0, c0 = time.perf_counter(), cpu_clock()
        if faults.slow_rank == ctx.rank:  # before the step's first collective, so the peers wait inside it
            burn_cpu((faults.slow_factor - 1.0) * own_compute)
        burned = cpu_clock() - c0
        batch, partial, loss_sum, tokens = run.train_step()
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        compute_time, step_time = cpu_clock() - c0, time.perf_counter() - t0
        own_compute = compute_time - burned
        want_stop = bool(should_stop()) if should_stop is not None else False
        mine = torch.tensor([loss_sum if run.owns_loss else 0.0, tokens if run.owns_loss else 0, step_time,
                             compute_time, float(want_stop)], dtype=torch.float64, device=run.device)
        gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, mine)
        table = torch.stack(gathered).cpu()
        global_tokens = int(table[:, 1].sum())
        loss = float(table[:, 0].sum()) / max(1, global_tokens)
        times = table[:, 2].tolist()
        tokens_per_s = global_tokens / max(times)
        metrics: dict[str, Any] = {
            "step": run.step, "rank": ctx.rank, "loss": loss, "lr": partial["lr"], "grad_norm": partial["grad_norm"],
            "tokens": global_tokens, "tokens_per_s": tokens_per_s, "step_time_s": step_time,
            "step_time_s_per_rank": times, "compute_time_s": compute_time,
            "compute_time_s_per_rank": table[:, 3].tolist(),
            "mfu": mfu(tokens_per_s, flops_per_token=run.flops_per_token, accelerators=run.rank_accelerators,
                       precision=loop.precision),
            "expert_load_max": partial["expert_load_max"], "expert_load_mean": partial["expert_load_mean"],
            "a2a_hidden_fraction": _a2a_hidden_fraction(ctx), "sample_ids_hash": sample_ids_hash(batch.sample_ids),
            "time_unix_s": time.time(),
        }
        if "grad_probe" in partial:
            metrics["grad_probe"] = partial["grad_probe"]
        metrics.update(eval_metrics(run.evaluator, run.model, step=run.step, last_step=loop.steps))  # val_loss
        losses.append(loss)
        hashes.append(metrics["sample_ids_hash"])
        total_tokens += global_tokens
        report(metrics)
        hooks.after_step(batch.step, metrics=metrics, sample_ids=batch.sample_ids, state_fn=run.state,
                         load_fn=run.load)
        if float(table[:, 4].max()) > 0 and run.step < loop.steps:
            stopped = True
            break
    wall = time.perf_counter() - started
    output_uri = _save_output(run) if loop.output_uri is not None and not stopped else None
    summary = TrainSummary(steps_completed=run.step, losses=tuple(losses), first_step=first_step,
                           tokens=total_tokens, wall_s=wall, stopped=stopped, output_uri=output_uri,
                           sample_ids_hashes=tuple(hashes))
    hooks.on_end(summary, state_fn=run.state)
    return summary


def _a2a_hidden_fraction(ctx: Any) -> float | None:
    value = getattr(ctx, "a2a_hidden_fraction", None)
    value = value() if callable(value) else value
    return None if value is None else float(value)


def _save_output(run: _Run) -> str | None:
    """Gather the full model (collective) and write it as a servable from rank 0."""
    from rayfleet.storage.model_registry import save_servable

    full = run.par.full_state_dict(run.model, run.ctx)
    if full is None:
        return None
    # Keep exactly the plain model's keys: FP8 converters add scaling-state buffers that a
    # serving replica (which builds the unconverted model) must not be handed.
    keys = set(build_model(run.config, device="meta").state_dict())
    weights = {k: v for k, v in full.items() if k in keys}
    missing = keys - set(weights)
    if missing:
        raise RuntimeError(f"full_state_dict lacks {sorted(missing)[:3]}... of the model")
    loop = run.loop
    assert loop.output_uri is not None
    from rayfleet.jobs.hf_init import hf_origin

    origin, files = hf_origin(loop.hf)  # lets `rayfleet model export` write the HF model back
    return save_servable(loop.output_uri, config=run.config, state_dict=weights, metadata={
        "job": loop.name, "steps": run.step, "precision": loop.precision, "plan": run.plan.describe(),
        "dataset": loop.data.uri, "seq_len": loop.data.seq_len, **origin}, extra_files=files)
