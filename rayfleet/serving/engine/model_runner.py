"""Turns a ``SchedulerOutput`` into one paged forward of the real model and returns logits.

Design decisions:
- The runner owns the KV tensors (``rayfleet.models.PagedKVCache``, allocated from the model's
  config and dtype) and nothing else: block ids come from the scheduler, so the runner never
  decides anything and a KV-transfer connector can read or fill blocks by id beside it.
- Per step, at most two forwards over the padded ``[B, S]`` batches that the model's paged
  interface takes: one for decodes (``S = 1``) and one for prefill chunks (``S`` = longest
  chunk), so a mixed step does not pad every decode to the prefill length. Padding positions
  are -1 and their logits are dropped; only the last position of chunks that sample goes to
  the sampler. (The model still projects every position to the vocabulary; a
  ``logits_at=`` argument on its forward would save that.)
- ``torch.inference_mode`` and ``model.eval()``: serving never builds autograd graphs and
  never moves the router's balancing bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayfleet.models import MoETransformer, PagedBatch, PagedKVCache
from rayfleet.serving.engine.request import RequestId
from rayfleet.serving.engine.scheduler import ScheduledChunk, SchedulerOutput

__all__ = ["ModelRunner", "StepLogits"]


@dataclass(frozen=True)
class StepLogits:
    """Next-token logits ``[len(request_ids), vocab]`` for the chunks that sample, in order."""

    request_ids: tuple[RequestId, ...]
    logits: torch.Tensor


class ModelRunner:
    """Executes steps of one model over its own paged KV cache (mutated by every step)."""

    def __init__(self, model: MoETransformer, *, num_blocks: int, block_size: int) -> None:
        self.model = model.eval()
        param = next(model.parameters())
        self.device = param.device
        self.block_size = block_size
        self.kv_cache = PagedKVCache.for_config(model.config, num_blocks=num_blocks, block_size=block_size,
                                                dtype=param.dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepLogits:
        """Run the step's chunks; writes their K/V into ``kv_cache``. Empty output: no forward."""
        chunks = output.chunks
        # Single-token chunks (decodes) and longer ones (prefill) run as separate forwards so
        # that decodes are not padded to the longest prefill chunk. The two are independent:
        # a step never reads KV that another request writes in the same step (blocks become
        # shareable only after the step that wrote them).
        groups = [[i for i, c in enumerate(chunks) if len(c.token_ids) == 1],
                  [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]]
        picked: dict[int, torch.Tensor] = {}
        for group in groups:
            picked.update(self._forward([chunks[i] for i in group], group))
        order = sorted(picked)
        logits = (torch.stack([picked[i] for i in order]) if order
                  else torch.empty(0, self.model.config.vocab_size, device=self.device))
        return StepLogits(tuple(chunks[i].request_id for i in order), logits)

    def _forward(self, chunks: list[ScheduledChunk], indices: list[int]) -> dict[int, torch.Tensor]:
        """One padded ``[B, S]`` paged forward; last-position logits of sampling chunks by index."""
        if not chunks:
            return {}
        width = max(len(c.token_ids) for c in chunks)
        max_blocks = max(len(c.block_ids) for c in chunks)
        tokens = torch.zeros(len(chunks), width, dtype=torch.long)
        positions = torch.full((len(chunks), width), -1, dtype=torch.long)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
        for b, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            tokens[b, :n] = torch.tensor(chunk.token_ids, dtype=torch.long)
            positions[b, :n] = torch.arange(chunk.start_position, chunk.start_position + n)
            tables[b, :len(chunk.block_ids)] = torch.tensor(chunk.block_ids, dtype=torch.long)
        batch = PagedBatch.from_blocks(positions=positions.to(self.device),
                                       block_tables=tables.to(self.device), block_size=self.block_size)
        logits = self.model(tokens.to(self.device), kv_cache=self.kv_cache, paged=batch)
        return {i: logits[b, len(c.token_ids) - 1] for b, (i, c) in enumerate(zip(indices, chunks)) if c.sample}
