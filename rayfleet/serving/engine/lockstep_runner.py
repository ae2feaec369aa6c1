"""A model runner whose forwards line up across the ranks of a wide-EP gang.

Design decisions:
- Every MoE layer of a wide-EP rank exchanges tokens with all other ranks, so every rank must
  run the same number of forwards per step, through the same MoE layers in the same order.
  ``ModelRunner`` runs up to two forwards per step (decodes, then prefill chunks), or none when
  idle. Here the ranks first agree (one all-reduce of two flags per step) on which of the two
  forwards anyone needs; a rank with nothing for an agreed forward runs an *empty forward*:
  every MoE layer, in model order, on zero tokens. It sends nothing, but it receives and
  computes the rows other ranks route to the experts it holds, so no rank waits on an idle
  one and the others' tokens still reach every expert.
- The empty forward skips attention and the dense layers: they hold no collective, and a rank
  with no tokens has nothing to attend to. The KV cache is untouched.
- Busy time is measured here (seconds inside forwards that carried this rank's own tokens)
  so the front can report per-rank busy time beside queue depth.
- A failure inside a forward leaves the gang out of step; recovering the gang (re-forming it
  and retrying its requests) is the gang's fault handling, not this runner's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from rayfleet.models import MoETransformer
from rayfleet.serving.engine.model_runner import ModelRunner, StepLogits
from rayfleet.serving.engine.scheduler import SchedulerOutput

__all__ = ["LockstepModelRunner"]


class LockstepModelRunner(ModelRunner):
    """``ModelRunner`` for one rank of a gang (mutates the KV cache and the step counters)."""

    def __init__(self, model: MoETransformer, *, num_blocks: int, block_size: int, group: dist.ProcessGroup) -> None:
        super().__init__(model, num_blocks=num_blocks, block_size=block_size)
        self.group = group
        self.busy_s = 0.0  # forwards carrying this rank's tokens
        self.num_empty_forwards = 0

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepLogits:
        chunks = output.chunks
        groups = [[i for i, c in enumerate(chunks) if len(c.token_ids) == 1],
                  [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]]
        needed = torch.tensor([bool(g) for g in groups], dtype=torch.int64, device=self.device)
        dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=self.group)
        picked: dict[int, torch.Tensor] = {}
        for group, anyone in zip(groups, needed.tolist()):
            if not anyone:
                continue
            if group:
                started = time.perf_counter()
                picked.update(self._forward([chunks[i] for i in group], group))
                self.busy_s += time.perf_counter() - started
            else:
                self.empty_forward()
        order = sorted(picked)
        logits = (torch.stack([picked[i] for i in order]) if order
                  else torch.empty(0, self.model.config.vocab_size, device=self.device))
        return StepLogits(tuple(chunks[i].request_id for i in order), logits)

    @torch.inference_mode()
    def empty_forward(self) -> None:
        """Every MoE layer on zero tokens, in model order (see module doc)."""
        param = next(self.model.parameters())
        empty = torch.zeros(0, self.model.config.dim, dtype=param.dtype, device=self.device)
        for layer in self.model.moe_layers():
            layer(empty)
        self.num_empty_forwards += 1
