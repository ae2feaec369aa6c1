"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, penalties,
logit bias and logprobs, seeded per request, failing per row.

Design decisions:
- ``temperature`` below ``1e-5`` means greedy (argmax), as in vLLM: dividing logits by a
  subnormal temperature overflows to inf and the softmax to NaN. Greedy never touches a
  random generator. ``SamplingParams`` refuses NaN/inf anywhere and temperature above 2 (the
  OpenAI range), so a bad value is an error at the edge, not a crash in the engine.
- A request with a ``seed`` owns a ``torch.Generator`` seeded once at admission, and its
  tokens are drawn from that generator only, one draw per token. So its output does not depend
  on which other requests share the batch, on chunking, or on preemption.
- Unseeded requests share one engine generator (itself seeded from the engine config).
- ``vocab_limit`` masks ids at and above it before any choice (greedy included): models pad
  their embedding table beyond the tokenizer, and a padded id is a token no client could read.
- Order of logit processing (OpenAI's and vLLM's): logit bias, then presence/frequency
  penalties over the request's output tokens, then temperature, top-k, top-p. Logprobs are
  the model's raw distribution (vLLM's default ``raw_logprobs``): log-softmax of the masked
  logits before any processing, so they describe the model, not the sampler settings.
- Failure isolation: ``sample_rows`` samples row by row and returns an exception in place of
  the token of a row that failed (a corrupted parameter that slipped past validation, a NaN
  distribution); the engine fails that request alone and keeps the others' tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first sampled row: the OpenAI ingress imports only the params
    import torch

from rayfleet.errors import SpecError

__all__ = ["SamplingParams", "SampledToken", "TokenLogprobs", "sample_tokens", "sample_rows",
           "GREEDY_EPS", "MAX_TOP_LOGPROBS"]

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound


def _finite(name: str, value: float, fix: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecError(name, value, "must be a finite number", fix)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI-style fields).

    ``stop`` strings are matched on the decoded output; ``stop_token_ids`` and the tokenizer's
    EOS (unless ``ignore_eos``) end generation with ``finish_reason="stop"``; ``max_tokens``
    with ``"length"``. ``logprobs``: None for none, k >= 0 for the sampled token's logprob plus
    the k most likely. ``logit_bias`` maps token id -> bias in [-100, 100]. Raises
    ``SpecError`` on construction for out-of-range values.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    _bias: Mapping[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # the OpenAI API accepts one string
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = dict(self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in bias.items())))
        object.__setattr__(self, "_bias", dict(self.logit_bias))
        if self.max_tokens < 1:
            raise SpecError("max_tokens", self.max_tokens, "must generate at least one token",
                            "pass max_tokens >= 1")
        _finite("temperature", self.temperature, "pass 0 for greedy decoding or a value in (0, 2]")
        if not 0 <= self.temperature <= 2:
            raise SpecError("temperature", self.temperature, "must be in [0, 2]",
                            "pass 0 for greedy decoding or a value in (0, 2] to sample")
        _finite("top_p", self.top_p, "pass 1.0 to disable nucleus sampling")
        if not 0 < self.top_p <= 1:
            raise SpecError("top_p", self.top_p, "must be in (0, 1]", "pass 1.0 to disable nucleus sampling")
        if self.top_k < 0:
            raise SpecError("top_k", self.top_k, "must be non-negative", "pass 0 to disable top-k")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise SpecError("seed", self.seed, "does not fit in 64 bits", "pass a seed in [-2**63, 2**64)")
        for name in ("presence_penalty", "frequency_penalty"):
            _finite(name, getattr(self, name), f"pass {name} in [-2, 2]")
            if not -2 <= getattr(self, name) <= 2:
                raise SpecError(name, getattr(self, name), "must be in [-2, 2]", f"pass {name} in [-2, 2]")
        for token_id, b in self.logit_bias:
            _finite("logit_bias", b, "pass biases in [-100, 100]")
            if not -100 <= b <= 100 or token_id < 0:
                raise SpecError("logit_bias", {token_id: b}, "biases must be in [-100, 100] for token ids >= 0",
                                "pass biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SpecError("logprobs", self.logprobs, f"must be in [0, {MAX_TOP_LOGPROBS}]",
                            "ask for at most 20 top logprobs")
        if any(not s for s in self.stop):
            raise SpecError("stop", self.stop, "an empty stop string would stop immediately",
                            "remove the empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's raw logprob and the ``k`` most likely (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


def _filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf. ``logits`` ``[V]``; returns a copy."""
    import torch

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
        # ... also when top_p underflows the logits' dtype (1e-308 is 0.0 in float32: 0 >= 0)
        drop_sorted[0] = False
        logits[order[drop_sorted]] = float("-inf")
    return logits


def _process(row: torch.Tensor, p: SamplingParams, output_ids: Sequence[int]) -> torch.Tensor:
    """Logit bias, then presence/frequency penalties (``row`` ``[V]``; returns a copy)."""
    import torch

    row = row.clone()
    vocab = row.shape[-1]
    for token_id, b in p.logit_bias:
        if token_id < vocab:
            row[token_id] += b
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _sample_row(raw: torch.Tensor, p: SamplingParams, generator: torch.Generator,
                output_ids: Sequence[int], greedy_id: int) -> SampledToken:
    import torch

    row = _process(raw, p, output_ids) if p.processes_logits else raw
    if p.greedy:
        token = greedy_id if not p.processes_logits else int(row.argmax())
    else:
        probs = _filter_logits(row / p.temperature, top_k=p.top_k, top_p=p.top_p).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator).item())
    if p.logprobs is None:
        return SampledToken(token)
    logprobs = raw.log_softmax(-1)
    top = ()
    if p.logprobs:
        values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return SampledToken(token, TokenLogprobs(float(logprobs[token]), top))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                *, vocab_limit: int | None = None,
                output_token_ids: Sequence[Sequence[int]] | None = None) -> list[SampledToken | Exception]:
    """One ``SampledToken`` per row of ``logits`` ``[B, V]`` (any float dtype), or the
    exception that row raised (see module doc); other rows are unaffected.

    ``generators[b]`` is request b's own generator (seeded requests) or the engine's shared
    one; it is advanced by exactly one draw for non-greedy rows and untouched for greedy rows.
    ``output_token_ids[b]``: the request's tokens so far (penalties). Ids ``>= vocab_limit``
    are never chosen. Mutates only the generators.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits[:, :vocab_limit]  # ids past the tokenizer are never chosen nor reported
    greedy_ids = logits.argmax(dim=-1).tolist() if len(params) else []
    out: list[SampledToken | Exception] = []
    for b, p in enumerate(params):
        try:
            out.append(_sample_row(logits[b], p, generators[b],
                                   output_token_ids[b] if output_token_ids is not None else (), int(greedy_ids[b])))
        except Exception as exc:  # noqa: BLE001 - handed to the engine, which fails this request alone
            out.append(exc)
    return out


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator], *, vocab_limit: int | None = None) -> list[int]:
    """Token ids of ``sample_rows`` (no penalties history); raises the first row's error."""
    tokens = []
    for r in sample_rows(logits, params, generators, vocab_limit=vocab_limit):
        if isinstance(r, Exception):
            raise r
        tokens.append(r.token_id)
    return tokens
