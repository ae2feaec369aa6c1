"""What a training run is made of between steps, and the hooks that may read or replace it.

Design decisions:
- :class:`TrainState` is everything needed to continue a run exactly: model and optimizer
  state dicts (as ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns them:
  FQN-keyed, DTensor shards under FSDP/TP/EP, so DCP can reshard them to another world
  size), the data loader's global position, RNG states and the step. The learning rate is a
  pure function of the step (``optim.lr_at``), so there is no scheduler state.
- Hooks follow Ray Train v2's typed callbacks: the loop calls ``on_start``, ``before_step``,
  ``after_step`` and ``on_end`` and never knows what they do. Flash checkpoints (issue 6) are
  a hook that copies ``state_fn()`` into shared memory every N steps; NaN rollback is a hook
  that calls ``load_fn(snapshot)``; slow-rank detection reads ``metrics["step_time_s_per_rank"]``.
- ``state_fn()`` returns references to the live tensors (no copy, so snapshotting costs only
  the hook's own copy); they change at the next step: copy what you keep.
- Hooks run on every rank at the same point of every step; a hook that issues collectives must
  do so on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rayfleet.placement.plan import ParallelPlan

__all__ = ["TrainState", "TrainHooks", "HookChain", "TrainSummary", "StateFn", "LoadFn", "capture_rng", "restore_rng"]


@dataclass(frozen=True)
class TrainState:
    """A resumable point of a run, after ``step`` optimizer steps.

    Attributes:
        step: optimizer steps completed (the next step to run is ``step``, 0-based).
        model: model state dict (this rank's shards for parallel models).
        optimizer: optimizer state dict, keyed by parameter FQN.
        data: ``DistributedTokenLoader.state_dict()`` (global position in samples).
        rng: ``capture_rng()`` of this rank.
        extra: free-form additions (e.g. ``{"world_size": 4}``) that hooks may set.
    """

    step: int
    model: Mapping[str, Any]
    optimizer: Mapping[str, Any]
    data: Mapping[str, Any]
    rng: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)


StateFn = Callable[[], TrainState]
LoadFn = Callable[[TrainState], None]


class TrainHooks:
    """Override any method; the defaults do nothing. Called on every rank."""

    def on_start(self, *, rank: int, world_size: int, plan: ParallelPlan, step: int, state_fn: StateFn,
                 load_fn: LoadFn) -> None:
        """After the model, optimizer and data are built (and ``resume`` applied); ``step`` is the next step."""

    def before_step(self, step: int) -> None:
        """Before 0-based step ``step`` reads its data."""

    def after_step(self, step: int, *, metrics: Mapping[str, Any], sample_ids: tuple[int, ...], state_fn: StateFn,
                   load_fn: LoadFn) -> None:
        """After step ``step`` (``metrics["step"] == step + 1``) and its ``report``.

        ``sample_ids`` is the whole global batch of the step, in order. Calling ``load_fn``
        rewinds the run to that state: the loop continues from ``state.step``.
        """

    def on_end(self, summary: "TrainSummary", *, state_fn: StateFn) -> None:
        """After the last step (or a stop), before the final model is saved."""


class HookChain(TrainHooks):
    """Several hooks called in order (a health monitor beside a checkpoint hook)."""

    def __init__(self, hooks: Sequence[TrainHooks]) -> None:
        self.hooks = list(hooks)

    def on_start(self, **kwargs: Any) -> None:
        for hook in self.hooks:
            hook.on_start(**kwargs)

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def after_step(self, step: int, **kwargs: Any) -> None:
        for hook in self.hooks:
            hook.after_step(step, **kwargs)

    def on_end(self, summary: TrainSummary, **kwargs: Any) -> None:
        for hook in self.hooks:
            hook.on_end(summary, **kwargs)


@dataclass(frozen=True)
class TrainSummary:
    """What ``train_worker`` returns (on every rank).

    Attributes:
        steps_completed: optimizer steps done at the end (including resumed ones).
        losses: global-batch loss of each step run by this call, in order.
        first_step: 0-based step this call started at (``resume.step`` or 0).
        tokens: target tokens trained on by this call (global).
        wall_s: wall time of the step loop.
        stopped: True when ``should_stop`` ended the run before ``spec.steps``.
        output_uri: where the final servable model was written (rank 0), else None.
        sample_ids_hashes: ``metrics["sample_ids_hash"]`` of each step run.
    """

    steps_completed: int
    losses: tuple[float, ...]
    first_step: int
    tokens: int
    wall_s: float
    stopped: bool
    output_uri: str | None
    sample_ids_hashes: tuple[int, ...]

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's torch RNG states (CPU, and the device's when it is CUDA)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
