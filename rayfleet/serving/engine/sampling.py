"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request.

Design decisions:
- ``temperature == 0`` means greedy (argmax), as in the OpenAI API and vLLM; greedy never
  touches a random generator.
- A request with a ``seed`` owns a ``torch.Generator`` seeded once at admission, and its
  tokens are drawn from that generator only, one draw per token. So its output does not depend
  on which other requests share the batch, on chunking, or on preemption (a recomputed request
  keeps its generator state: tokens already drawn are kept, not redrawn).
- Unseeded requests share one engine generator (itself seeded from the engine config), so a
  whole engine run is reproducible too, though not per request.
- ``vocab_limit`` masks ids at and above it before any choice (greedy included): models pad
  their embedding table beyond the tokenizer (the byte tokenizer has 259 ids, the model 320),
  and a padded id is a token no client could read. Serving sets it to the tokenizer's size;
  raw token-id users of the engine may leave it off.
- Per-row sampling loops over requests for the random draws: a batch holds tens of requests
  and each draw is one ``multinomial`` over the vocabulary; the filtering is batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayfleet.errors import SpecError

__all__ = ["SamplingParams", "sample_tokens"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI-style fields).

    ``stop`` strings are matched on the decoded output; ``stop_token_ids`` and the tokenizer's
    EOS (unless ``ignore_eos``) end generation with ``finish_reason="stop"``; ``max_tokens``
    with ``"length"``. Raises ``SpecError`` on construction for out-of-range values.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # the OpenAI API accepts one string
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise SpecError("max_tokens", self.max_tokens, "must generate at least one token",
                            "pass max_tokens >= 1")
        if self.temperature < 0:
            raise SpecError("temperature", self.temperature, "must be non-negative",
                            "pass 0 for greedy decoding or a value > 0 to sample")
        if not 0 < self.top_p <= 1:
            raise SpecError("top_p", self.top_p, "must be in (0, 1]", "pass 1.0 to disable nucleus sampling")
        if self.top_k < 0:
            raise SpecError("top_k", self.top_k, "must be non-negative", "pass 0 to disable top-k")
        if any(not s for s in self.stop):
            raise SpecError("stop", self.stop, "an empty stop string would stop immediately",
                            "remove the empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf. ``logits`` ``[V]``; returns a copy."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly above it already reach top_p; the top token
        # always survives, so the nucleus is never empty.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        logits[order[drop_sorted]] = float("-inf")
    return logits


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator], *, vocab_limit: int | None = None) -> list[int]:
    """One token id per row of ``logits`` ``[B, V]`` (any float dtype).

    ``generators[b]`` is request b's own generator (seeded requests) or the engine's shared
    one; it is advanced by exactly one draw for non-greedy rows and untouched for greedy rows.
    Ids ``>= vocab_limit`` (when given) are never chosen. Mutates only the generators.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    greedy_ids = logits.argmax(dim=-1).tolist()
    out = []
    for b, p in enumerate(params):
        if p.greedy:
            out.append(int(greedy_ids[b]))
            continue
        filtered = _filter_logits(logits[b] / p.temperature, top_k=p.top_k, top_p=p.top_p)
        probs = filtered.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[b]).item()))
    return out
