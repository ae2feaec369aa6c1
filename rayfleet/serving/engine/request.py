"""One request's mutable state inside an engine, and what the engine reports back.

Design decisions:
- A request is a growing token list (prompt + outputs) and one cursor, ``num_computed_tokens``
  (tokens whose KV is in the cache). Prefill, chunked prefill, decode and recompute after
  preemption are all "compute tokens ``[num_computed_tokens, num_tokens)``"; there is no phase
  field to keep in sync (vLLM v1's model).
- The request keeps its own full-block hashes, extended as tokens are appended, so that prefix
  lookups and caching never re-hash a prompt.
- ``Request`` is internal and mutable (scheduler and manager advance it); what leaves the
  engine is the frozen ``RequestOutput``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:  # the annotation only: the ingress imports this without torch
    import torch

from rayfleet.serving.engine.block_hash import BlockHash, hash_full_blocks
from rayfleet.serving.engine.sampling import SamplingParams, TokenLogprobs

__all__ = ["RequestId", "RequestStatus", "FinishReason", "Request", "RequestOutput"]

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted (then it recomputes its tokens)
    RUNNING = "running"  # holds KV blocks
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """OpenAI's ``finish_reason`` values (plus ``abort``)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the engine's max_model_len
    ABORT = "abort"  # cancelled by the caller, or failed inside the engine (``error`` says so)


@dataclass(eq=False)
class Request:
    """Mutated by the scheduler (status, cursor, outputs) and the KV manager (nothing else)."""

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_size: int
    root_hash: BlockHash
    arrival_index: int
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hit of the first admission; -1 until admitted
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        """Add a sampled token (its KV is computed next step) and hash any block it fills."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self._rehash()

    def _rehash(self) -> None:
        self.block_hashes = hash_full_blocks(self.all_token_ids, block_size=self.block_size,
                                             root=self.root_hash, known=self.block_hashes)


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request.

    ``new_token_ids`` are the tokens sampled this step (empty while a prompt is still being
    prefilled in chunks, or for an aborted request); ``num_cached_tokens`` is the prefix-cache
    hit when the request was first admitted. ``logprobs`` has one entry per new token when
    the request asked for them. ``error`` is set (with ``finish_reason=abort``) when the
    engine failed this request alone (see ``LLMEngine.step``); the message names no internals.
    """

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    error: str | None = None
