"""AdamW with decoupled weight decay on matrices, and a warmup + cosine learning-rate schedule.

Design decisions:
- ``torch.optim.AdamW`` as is (it handles DTensor/FSDP2 parameters): no custom optimizer.
  Weight decay applies to 2-D+ weights only; norms, the router's expert bias (a buffer, not a
  parameter) and 1-D parameters are not decayed, as in GPT-style recipes.
- The schedule is a pure function of the step (:func:`lr_at`), set on the param groups before
  each optimizer step. No ``LRScheduler`` object means no scheduler state to checkpoint: a
  resumed run recomputes the same rate from the step it restored.
- Schedule: linear warmup from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps`` steps,
  then cosine decay to ``min_lr_ratio * lr`` at the last step (``constant`` keeps ``lr``
  after warmup). Steps are 0-based: step 0 is the first optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["lr_at", "build_optimizer", "set_lr"]


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1,
          kind: str = "cosine") -> float:
    """Learning rate of 0-based optimizer ``step`` out of ``total_steps``.

    Worked example (lr=1, total=10, warmup=2, min_lr_ratio=0.1, cosine):
    step 0 -> 0.5, step 1 -> 1.0, step 2 -> 1.0 (decay starts), step 9 -> 0.1.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if kind == "constant":
        return lr
    if kind != "cosine":
        raise ValueError(f"unknown schedule kind {kind!r}")
    decay_steps = total_steps - warmup_steps - 1
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = lr * min_lr_ratio
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in named:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, *, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (matrices decayed, vectors not)."""
    # foreach=False: the foreach kernels group tensors by device/dtype and do not accept a mix of
    # DTensors over different meshes (EP experts vs FSDP dense), which parallel models have.
    return torch.optim.AdamW(_param_groups(model.named_parameters(), weight_decay), lr=lr, betas=betas, eps=eps,
                             foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
