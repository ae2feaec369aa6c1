"""One replica's span of a split long prefill, computed layer by layer (plain torch: no Ray, no
asyncio); the split's policy is ``long_prefill`` (torch-free, so the ingress's router can plan
splits without loading torch). ``split_prefill`` drives spans on replicas;
``split_prefill_in_process`` runs a whole split in one process (the unit test's reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rayfleet.errors import SpecError
from rayfleet.models import MoETransformer, PagedBatch, PagedKVCache

__all__ = ["SpanPrefill", "split_prefill_in_process"]


class SpanPrefill:
    """One replica's span ``[start, end)`` of a prompt, computed layer by layer.

    Owns a scratch ``PagedKVCache`` of ``ceil(end / block_size)`` blocks holding positions
    ``[0, end)``: ``import_kv`` writes earlier spans' KV into it, ``run_layer`` computes the next
    layer of this span (writing its KV), ``export_kv`` copies this span's KV of one layer out.
    Not thread-safe; call it where the model's forward may run (the engine thread).
    """

    def __init__(self, model: MoETransformer, prompt_token_ids: Sequence[int], *, start: int, end: int,
                 block_size: int) -> None:
        if not 0 <= start < end <= len(prompt_token_ids) or start % block_size:
            raise SpecError("span", (start, end), f"must be a block-aligned range inside the prompt of "
                            f"{len(prompt_token_ids)} tokens", "plan spans with LongPrefillPolicy")
        param = next(model.parameters())
        self.model, self.start, self.end, self.block_size = model, start, end, block_size
        self.num_layers = model.config.num_layers
        num_blocks = -(-end // block_size)
        self.cache = PagedKVCache.for_config(model.config, num_blocks=num_blocks, block_size=block_size,
                                             dtype=param.dtype, device=param.device)
        positions = torch.arange(start, end, device=param.device).unsqueeze(0)
        self.batch = PagedBatch.from_blocks(positions=positions, block_size=block_size,
                                            block_tables=torch.arange(num_blocks, device=param.device).unsqueeze(0))
        tokens = torch.tensor([list(prompt_token_ids[start:end])], dtype=torch.long, device=param.device)
        with torch.inference_mode():
            self.hidden = model.tok_embeddings(tokens)
        self.next_layer = 0

    @property
    def first_block(self) -> int:
        return self.start // self.block_size

    def import_kv(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write an earlier span's layer-``layer`` KV ``[num_blocks, bs, kv_heads, head_dim]``
        (blocks from ``start / block_size`` on). Raises ``SpecError`` if it does not fit before
        this span."""
        first = start // self.block_size
        if start % self.block_size or first + k.shape[0] > self.first_block or k.shape != v.shape:
            raise SpecError("kv", (start, tuple(k.shape)), f"does not fit before this span's block "
                            f"{self.first_block}", "import only earlier, block-aligned spans")
        self.cache.k[layer, first:first + k.shape[0]] = k.to(self.cache.k.dtype)
        self.cache.v[layer, first:first + k.shape[0]] = v.to(self.cache.v.dtype)

    @torch.inference_mode()
    def run_layer(self) -> int:
        """Compute the next layer of this span over the KV imported so far; returns its index."""
        layer = self.next_layer
        assert layer < self.num_layers, "every layer of this span is done"
        kv = (self.cache.k[layer], self.cache.v[layer])
        self.hidden = self.model.layers[layer](self.hidden, self.batch.positions, kv=kv, paged=self.batch)
        self.next_layer += 1
        return layer

    def export_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This span's KV of ``layer``: copies ``[num_span_blocks, bs, kv_heads, head_dim]``."""
        blocks = slice(self.first_block, self.cache.num_blocks)
        return self.cache.k[layer, blocks].clone(), self.cache.v[layer, blocks].clone()

    @torch.inference_mode()
    def last_logits(self) -> torch.Tensor:
        """Next-token logits ``[vocab]`` after the span's last token (all layers done)."""
        assert self.next_layer == self.num_layers, "run every layer first"
        return self.model.output(self.model.norm(self.hidden[:, -1:]))[0, -1]


def split_prefill_in_process(model: MoETransformer, prompt_token_ids: Sequence[int],
                             bounds: Sequence[int], *, block_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference driver: the spans ``[bounds[i], bounds[i+1])`` one after another in this process,
    in wavefront order (layer by layer, KV handed over as the replicas would). Returns the whole
    prompt's ``k``/``v`` ``[L, ceil(N / bs), bs, kv_heads, head_dim]`` and the last logits."""
    spans = [SpanPrefill(model, prompt_token_ids, start=s, end=e, block_size=block_size)
             for s, e in zip(bounds[:-1], bounds[1:])]
    for layer in range(model.config.num_layers):
        for i, span in enumerate(spans):
            span.run_layer()
            k, v = span.export_kv(layer)
            for later in spans[i + 1:]:
                later.import_kv(layer, span.start, k, v)
    last = spans[-1]
    return last.cache.k, last.cache.v, last.last_logits()
