"""Pipeline parallelism with ``torch.distributed.pipelining``: stage modules and the 1F1B step.

Design decisions:
- A stage is a ``PipelineStageModule`` that *holds* the full model's submodules for its layer
  range (embeddings on the first stage, final norm and output on the last), under the same
  names: ``layers`` becomes a ``ModuleDict`` keyed by the global layer index, so state-dict keys
  are exactly the full model's and checkpoints of a pipelined run load anywhere. The rest of the
  model is dropped before any parallel wrapper runs, so each rank allocates only its stage.
- Stage boundaries are the plan's (``stage_ranges``): the planner may balance MoE and dense
  layers unevenly.
- 1F1B (``Schedule1F1B``) over the replica's micro-batches, with ``scale_grads=False``: the
  loop's loss function already scales each micro-batch's summed token loss for the global
  batch, so the schedule must not divide again. With FSDP2 inside a stage, the schedule
  handles gradient sync across micro-batches itself.
- The schedule and its stage are built on the first step for a given micro-batch count and
  reused, with the stage's input/output metadata given (no shape-inference forward).
- Expert load, loss and metrics stay per stage: the loop counts the loss on the last stage
  (``owns_loss``) and its metric all-gather spans every rank, so every rank reports the same
  global loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

__all__ = ["PipelineStageModule", "split_stage", "PipelineRunner"]


class PipelineStageModule(nn.Module):
    """Layers ``layer_range`` of an ``MoETransformer`` (plus embeddings / head on the ends)."""

    def __init__(self, model: nn.Module, layer_range: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_range})
        if last:
            self.norm = model.norm
            self.output = model.output

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: tokens ``[B, S]``; others: hidden states ``[B, S, dim]`` from the previous stage."""
        h = self.tok_embeddings(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        for layer in self.layers.values():
            h = layer(h, positions)
        return self.output(self.norm(h)) if self.last else h


def split_stage(model: nn.Module, *, stage: int, num_stages: int, layer_ranges: tuple[range, ...]) -> PipelineStageModule:
    """This rank's stage of ``model`` (the other stages' modules are no longer referenced)."""
    return PipelineStageModule(model, layer_ranges[stage], first=stage == 0, last=stage == num_stages - 1)


class PipelineRunner:
    """Runs one step's micro-batches through the pipeline with 1F1B (forward and backward)."""

    def __init__(self, stage_module: PipelineStageModule, *, stage: int, num_stages: int, device: torch.device,
                 group: Any) -> None:
        self.stage_module, self.stage, self.num_stages = stage_module, stage, num_stages
        self.device, self.group = device, group
        self._schedules: dict[int, Schedule1F1B] = {}
        self._loss_fn: Callable | None = None

    def _example_args(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of one micro-batch's stage input and output.

        Given up front, they make the schedule's metadata STATIC: no shape-inference forward (it
        would run the MoE all-to-alls, count expert load, and call the loss once more).
        Hidden states between stages are fp32 (the residual stream stays fp32 under autocast).
        """
        mb, seq = tokens.shape
        dim = self.stage_module.config.dim
        hidden = torch.empty(mb, seq, dim, dtype=torch.float32, device="meta")
        # A received activation must require grad, or the stage sends no gradient back.
        inp = torch.empty(mb, seq, dtype=tokens.dtype, device="meta") if self.stage == 0 \
            else torch.empty_like(hidden).requires_grad_(True)
        if self.stage < self.num_stages - 1:
            return inp, hidden
        dtype = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) \
            else torch.float32
        return inp, torch.empty(mb, seq, self.stage_module.config.vocab_size, dtype=dtype, device="meta")

    def _schedule(self, n: int, tokens: torch.Tensor) -> Schedule1F1B:
        if n not in self._schedules:
            inp, out = self._example_args(tokens)
            last = self.stage == self.num_stages - 1
            pipe_stage = PipelineStage(self.stage_module, self.stage, self.num_stages, self.device, group=self.group,
                                       input_args=(inp,), output_args=(out,),
                                       input_grads=(None,) if self.stage == 0 else (inp,),
                                       output_grads=(None,) if last else (out,))
            self._schedules[n] = Schedule1F1B(pipe_stage, n_microbatches=n, loss_fn=self._call_loss,
                                              scale_grads=False)
        return self._schedules[n]

    def _call_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def forward_backward(self, *, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self._loss_fn = loss_fn
        schedule = self._schedule(len(inputs), inputs[0])
        batch = torch.cat(inputs)  # the schedule splits it back into len(inputs) micro-batches
        if self.stage == 0 and self.num_stages == 1:
            schedule.step(batch, target=torch.cat(targets))
        elif self.stage == 0:
            schedule.step(batch)
        elif self.stage == self.num_stages - 1:
            schedule.step(target=torch.cat(targets))
        else:
            schedule.step()
