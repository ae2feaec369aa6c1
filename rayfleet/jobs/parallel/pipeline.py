"""Pipeline parallelism with ``torch.distributed.pipelining``: stage modules and the step's
schedule -- 1F1B, interleaved 1F1B (virtual stages) or DualPipeV, as the plan says.

Design decisions:
- A virtual stage is a ``PipelineStageModule`` that *holds* the full model's submodules for its
  layers (embeddings on the first stage, final norm and output on the last), under the same
  names: ``layers`` becomes a ``ModuleDict`` keyed by the global layer index, so state-dict keys
  are exactly the full model's and checkpoints of a pipelined run load anywhere. The rest of the
  model is dropped before any parallel wrapper runs, so each rank allocates only its stages.
- Which layers each virtual stage runs and which rank runs it is the plan's
  (``ParallelPlan.virtual_stages``, ``placement/pipeline_chunks.py``): per-rank layer counts from
  its stage starts, split over ``vpp`` chunks (interleaved: rank ``r`` holds virtual stages
  ``r, r + pp, ...``) or two chunks in a V (DualPipeV: ``r`` and ``2 * pp - 1 - r``).
- A rank with one chunk hands its ``PipelineStageModule`` on as the model (1F1B, as before). A
  rank with several hands on a ``PipelineChunks``: it registers the chunks' submodules under the
  full model's names (one state dict with the full model's keys: DCP, flash checkpoints and the
  final export map parameters by name), while the chunk modules themselves stay unregistered
  (in a tuple), each the root of its own FSDP group, as torchtitan's model parts are.
- Schedules: ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleDualPipeV``, all with
  ``scale_grads=False``: the loop's loss function already scales each micro-batch's summed token
  loss for the global batch, so the schedule must not divide again. With FSDP2 inside a stage,
  the schedule handles gradient sync across micro-batches itself. DualPipeV splits backward into
  input- and weight-gradient passes (its zero-bubble part).
- The schedule and its stages are built on the first step for a given micro-batch count and
  reused, with each stage's input/output metadata given (no shape-inference forward).
- Autocast covers each stage's forward only, as in the loop's unpipelined path (forward under
  autocast; loss and backward outside it): the loop calls the runner inside autocast, and the
  runner turns it off around the schedule and back on inside each stage's forward. With the whole
  schedule under CPU autocast (1F1B before), bf16 gradients came out 0.1-0.3% off the
  single-process run's (router and attention weights), because backward ran under autocast.
- Expert load, loss and metrics stay per stage: the loop counts the loss on the rank holding the
  last virtual stage (``ParallelPlan.loss_pp_rank``) and its metric all-gather spans every rank,
  so every rank reports the same global loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
# torch.distributed.pipelining is imported where a stage is built: it imports torch._dynamo, about
# 1 CPU s of every training worker's start, and only pp > 1 needs it.

from rayfleet.placement.pipeline_chunks import VirtualStage, check_microbatches

__all__ = ["PipelineStageModule", "PipelineChunks", "split_stages", "stage_roots", "PipelineRunner"]


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
        self.autocast_dtype: torch.dtype | None = None  # set by PipelineRunner for each step

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: tokens ``[B, S]``; others: hidden states ``[B, S, dim]`` from the previous stage."""
        if self.autocast_dtype is None:
            return self._forward(x)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        for layer in self.layers.values():
            h = layer(h, positions)
        return self.output(self.norm(h)) if self.last else h


class PipelineChunks(nn.Module):
    """This rank's virtual stages (``chunks``, in schedule order) under the full model's names.

    ``forward`` is not for calling: the schedule runs each chunk itself.
    """

    def __init__(self, model: nn.Module, chunks: Sequence[PipelineStageModule]) -> None:
        super().__init__()
        self.config = model.config
        if any(c.first for c in chunks):
            self.tok_embeddings = model.tok_embeddings
        layers = sorted((int(k), m) for c in chunks for k, m in c.layers.items())
        self.layers = nn.ModuleDict({str(i): m for i, m in layers})
        if any(c.last for c in chunks):
            self.norm = model.norm
            self.output = model.output
        self.chunks = tuple(chunks)  # a tuple: not registered, so no key is duplicated

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("PipelineChunks runs through its pipeline schedule (PipelineRunner), chunk by chunk")


def split_stages(model: nn.Module, *, stages: Sequence[VirtualStage], pp_rank: int
                 ) -> PipelineStageModule | PipelineChunks:
    """This rank's virtual stages of ``model`` (``stages``: all of them, in the model's order);
    the other stages' modules are no longer referenced."""
    last = len(stages) - 1
    mine = [PipelineStageModule(model, s.layers, first=s.index == 0, last=s.index == last)
            for s in stages if s.rank == pp_rank]
    return mine[0] if len(mine) == 1 else PipelineChunks(model, mine)


def stage_roots(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules the schedule calls: FSDP2 makes each one a root (after the blocks)."""
    return model.chunks if isinstance(model, PipelineChunks) else (model,)


class PipelineRunner:
    """Runs one step's micro-batches through this rank's virtual stages with the plan's schedule."""

    def __init__(self, model: nn.Module, *, stage_indices: Sequence[int], num_stages: int, dualpipe: bool,
                 device: torch.device, group: Any) -> None:
        self.modules = stage_roots(model)
        assert len(self.modules) == len(stage_indices), (len(self.modules), stage_indices)
        self.stage_indices, self.num_stages, self.dualpipe = tuple(stage_indices), num_stages, dualpipe
        self.config = model.config
        self.device, self.group = device, group
        self.holds_first, self.holds_last = 0 in self.stage_indices, num_stages - 1 in self.stage_indices
        self._schedules: dict[tuple[int, torch.dtype | None], Any] = {}
        self._loss_fn: Callable | None = None

    def _example_args(self, index: int, tokens: torch.Tensor, autocast_dtype: torch.dtype | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of one micro-batch's input and output of virtual stage ``index``.

        Given up front, they make the schedule's metadata STATIC: no shape-inference forward (it
        would run the MoE all-to-alls, count expert load, and call the loss once more).
        Hidden states between stages are fp32 (the residual stream stays fp32 under autocast).
        """
        mb, seq = tokens.shape
        hidden = torch.empty(mb, seq, self.config.dim, dtype=torch.float32, device="meta")
        # A received activation must require grad, or the stage sends no gradient back.
        inp = torch.empty(mb, seq, dtype=tokens.dtype, device="meta") if index == 0 \
            else torch.empty_like(hidden).requires_grad_(True)
        if index < self.num_stages - 1:
            return inp, hidden
        dtype = autocast_dtype or torch.float32
        return inp, torch.empty(mb, seq, self.config.vocab_size, dtype=dtype, device="meta")

    def _stage(self, module: nn.Module, index: int, tokens: torch.Tensor, autocast_dtype: torch.dtype | None
               ) -> Any:  # torch.distributed.pipelining.PipelineStage
        from torch.distributed.pipelining import PipelineStage

        inp, out = self._example_args(index, tokens, autocast_dtype)
        last = index == self.num_stages - 1
        return PipelineStage(module, index, self.num_stages, self.device, group=self.group,
                             input_args=(inp,), output_args=(out,),
                             input_grads=(None,) if index == 0 else (inp,),
                             output_grads=(None,) if last else (out,))

    def _schedule(self, n: int, tokens: torch.Tensor, autocast_dtype: torch.dtype | None) -> Any:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B

        if (n, autocast_dtype) not in self._schedules:
            chunks = len(self.stage_indices)
            check_microbatches(n, pp=self.num_stages // chunks, vpp=1 if self.dualpipe else chunks,
                               dualpipe=self.dualpipe)
            stages = [self._stage(m, i, tokens, autocast_dtype) for m, i in zip(self.modules, self.stage_indices)]
            if len(stages) == 1:
                schedule = Schedule1F1B(stages[0], n_microbatches=n, loss_fn=self._call_loss, scale_grads=False)
            else:
                kind = ScheduleDualPipeV if self.dualpipe else ScheduleInterleaved1F1B
                schedule = kind(stages, n_microbatches=n, loss_fn=self._call_loss, scale_grads=False)
            self._schedules[(n, autocast_dtype)] = schedule
        return self._schedules[(n, autocast_dtype)]

    def _call_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def forward_backward(self, *, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self._loss_fn = loss_fn
        device = self.device.type
        autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        for module in self.modules:
            module.autocast_dtype = autocast_dtype
        schedule = self._schedule(len(inputs), inputs[0], autocast_dtype)
        # the schedule splits the whole batch back into len(inputs) micro-batches
        args = (torch.cat(inputs),) if self.holds_first else ()
        with torch.autocast(device, enabled=False):  # back on inside each stage's forward only
            schedule.step(*args, target=torch.cat(targets) if self.holds_last else None)
