"""Validation loss during training: the same held-out samples, every N steps, on every rank.

Design decisions:
- *Which samples*: the first ``batches x global_batch_size`` sample ids of one fixed permutation
  (seed 0) of the validation split's samples, sorted so shards are read in order. They depend
  only on the split, ``seq_len`` and the batch, never on the step, the training seed or the
  world size: two runs (or one run before and after a restart) are compared on the same tokens.
  nanoGPT instead draws fresh random windows for each estimate; a fixed set removes that noise
  from a comparison between runs.
- *Who computes what*: DP replica ``r`` takes ids ``r, r + dp, r + 2 dp, ...``; TP/EP peers of a
  replica read the same ids (as in training). Every rank runs the same number of forwards, in
  micro-batches of the plan's size: FSDP2's all-gathers and expert parallel's all-to-alls are
  collectives that every rank must join. A rank whose slice runs out first repeats its last
  micro-batch with weight 0 (computed, not counted).
- *The number*: the sum of token cross-entropies over all evaluated tokens divided by their count
  (the loss-owning rank of each data shard contributes: TP rank 0, as in the train loop), summed
  over ranks with one ``all_reduce``: the mean over the whole set, whatever the split.
- *No side effects*: ``model.eval()`` and ``torch.no_grad()`` for the forwards, ``train()`` after;
  FP8 delayed scaling's amax histories (updated by every forward) are saved and put back, so a run
  with validation trains exactly as one without. MoE load counted by the loop's forward hooks is
  reset at the next step's start, and router biases move only after training steps.
- An evaluation runs between two steps, where the hang detector (``health.monitor``) sees no
  progress: keep it well under ``RAYFLEET_HANG_TIMEOUT_S`` (120 s; 20 batches of the quality
  benchmark take ~1 s) or the group is restarted as hung. Its time is reported as ``eval_time_s``.
- Pipeline-parallel plans are refused (``planning.validate_job``): their forward runs inside a
  schedule that also backpropagates.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rayfleet.jobs.data import TokenSamples
from rayfleet.jobs.train_job import EvalSettings, LoopConfig
from rayfleet.models.fp8.functional import AmaxHistory
from rayfleet.placement.plan import ParallelPlan

__all__ = ["EvalResult", "Evaluator", "build_evaluator", "eval_metrics", "eval_sample_ids", "is_eval_step",
           "replica_eval_ids"]

_EVAL_ORDER_SEED = 0


def eval_sample_ids(num_samples: int, count: int) -> np.ndarray:
    """The ``count`` validation sample ids every evaluation uses (sorted; fixed by ``num_samples``)."""
    if count > num_samples:
        raise ValueError(f"validation needs {count} samples, the split holds {num_samples}")
    rng = np.random.Generator(np.random.PCG64(_EVAL_ORDER_SEED))
    return np.sort(rng.permutation(num_samples)[:count])


def replica_eval_ids(ids: np.ndarray, *, dp_rank: int, dp_size: int) -> np.ndarray:
    """DP replica ``dp_rank``'s share of ``ids`` (strided: shares differ by at most one sample)."""
    return ids[dp_rank::dp_size]


def is_eval_step(step: int, *, every_n_steps: int, last_step: int) -> bool:
    """Evaluate after 1-based step ``step``: every ``every_n_steps`` steps and after the last one."""
    return step % every_n_steps == 0 or step == last_step


@dataclass(frozen=True)
class EvalResult:
    """Mean validation loss per target token, over ``tokens`` tokens, computed in ``time_s``."""

    loss: float
    tokens: int
    time_s: float


class Evaluator:
    """Computes the validation loss of a (parallelized) model on this rank's share of the samples."""

    def __init__(self, settings: EvalSettings, *, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, owns_loss: bool, device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager], cp_rank: int = 0, cp: int = 1) -> None:
        self.settings = settings
        self.samples = TokenSamples(settings.uri, seq_len)
        ids = eval_sample_ids(self.samples.num_samples, settings.batches * global_batch_size)
        self.local_ids = replica_eval_ids(ids, dp_rank=dp_rank, dp_size=dp_size)
        self.micro_batch_size = micro_batch_size
        # the same number of forwards on every rank (collectives inside): the longest share's
        longest_share = math.ceil(len(ids) / dp_size)
        self.num_forwards = math.ceil(longest_share / micro_batch_size)
        self.owns_loss, self.device, self.autocast = owns_loss, device, autocast
        self.cp_rank, self.cp = cp_rank, cp  # CP ranks share samples; each scores its chunks
        self._batches: list[tuple[torch.Tensor, bool]] | None = None

    def due(self, step: int, *, last_step: int) -> bool:
        return is_eval_step(step, every_n_steps=self.settings.every_n_steps, last_step=last_step)

    def _micro_batches(self) -> list[tuple[torch.Tensor, bool]]:
        """(tokens ``[b, seq_len + 1]``, counted) per forward; read once, kept (a few MB at most)."""
        if self._batches is None:
            mbs, ids = self.micro_batch_size, self.local_ids
            batches = [(self.samples.get(ids[i:i + mbs]), True) for i in range(0, len(ids), mbs)]
            filler = batches[-1][0] if batches else self.samples.get([0])
            batches += [(filler, False)] * (self.num_forwards - len(batches))
            self._batches = batches
        return self._batches

    def evaluate(self, model: nn.Module) -> EvalResult:
        """Mean validation loss over the whole sample set (a collective: every rank calls it)."""
        from rayfleet.jobs.parallel.context_parallel import model_inputs

        start = time.perf_counter()
        histories = [m for m in model.modules() if isinstance(m, AmaxHistory)]
        saved = [h.history.clone() for h in histories]
        was_training = model.training
        model.eval()
        loss_sum, tokens = 0.0, 0
        try:
            with torch.no_grad():
                for batch, counted in self._micro_batches():
                    inputs, targets = model_inputs(batch.to(self.device), cp_rank=self.cp_rank, cp=self.cp)
                    with self.autocast():
                        logits = model(inputs)
                    full = getattr(logits, "full_tensor", None)  # a DTensor from a TP output layer
                    logits = full() if callable(full) else logits
                    if counted and self.owns_loss:
                        loss_sum += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                          targets.reshape(-1), reduction="sum"))
                        tokens += targets.numel()
        finally:
            model.train(was_training)
            for history, old in zip(histories, saved):
                history.history.copy_(old)
        total = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        count = int(total[1].item())
        return EvalResult(loss=float(total[0].item()) / max(1, count), tokens=count,
                          time_s=time.perf_counter() - start)


def build_evaluator(loop: LoopConfig, *, plan: ParallelPlan, ctx: Any, owns_loss: bool, device: torch.device,
                    autocast: Callable[[], contextlib.AbstractContextManager]) -> Evaluator | None:
    """The job's evaluator (``ctx``: the parallel context, for its DP rank and size), or None when
    its spec has no ``eval`` section."""
    if loop.eval is None:
        return None
    if plan.pp > 1:
        raise ValueError(f"validation does not run pipeline-parallel plans (pp={plan.pp}); planning refuses them")
    return Evaluator(loop.eval, seq_len=loop.data.seq_len, global_batch_size=loop.global_batch_size,
                     micro_batch_size=plan.micro_batch_size, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                     owns_loss=owns_loss, device=device, autocast=autocast, cp_rank=getattr(ctx, "cp_rank", 0),
                     cp=plan.cp)


def eval_metrics(evaluator: Evaluator | None, model: nn.Module, *, step: int, last_step: int) -> dict[str, float]:
    """``val_loss`` (with ``val_tokens`` and ``eval_time_s``) when ``step`` is an evaluation step, else ``{}``.

    A collective on evaluation steps: every rank calls it after every step.
    """
    if evaluator is None or not evaluator.due(step, last_step=last_step):
        return {}
    result = evaluator.evaluate(model)
    return {"val_loss": result.loss, "val_tokens": result.tokens, "eval_time_s": result.time_s}
