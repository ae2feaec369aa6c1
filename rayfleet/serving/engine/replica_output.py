"""What an engine replica answers: a stream of ``GenerationChunk``s, or a ``PrefillReply``.

Design decisions:
- One frozen chunk type from the engine to the OpenAI app: ``AsyncEngine`` makes it from the
  engine's per-step ``RequestOutput`` (which stays inside the engine: it carries error text and
  counters the outside must not see), the Serve replica and the clients pass it on unchanged (a
  replica stamps its id on the first one), ``InferenceService`` only restates the prompt length
  and the finish across resumptions, and the OpenAI app turns its tokens into text. A dict per
  chunk once changed shape three times on that path and nothing checked its keys.
- It pickles (plain fields and ``TokenLogprobs``): Serve streams it from replica to ingress.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.serving.engine.kv_connector import KVHandle
from rayfleet.serving.engine.sampling import TokenLogprobs

__all__ = ["GenerationChunk", "PrefillReply"]


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request from one replica.

    ``finish_reason`` (``stop``/``length``/``abort``) and ``stop_reason`` (the stop string or
    token id) are set on the last chunk (``finished``). ``queue_time_s`` is on a replica's first
    chunk only (the time the request waited before its first step there). ``committed`` marks the
    token-less first chunk of a decode: the handed-off KV is in this pool, so the prefill
    replica's lease may be released. ``replica`` names the replica that produced it.
    """

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for them
    queue_time_s: float | None = None
    committed: bool = False
    replica: str = ""


@dataclass(frozen=True)
class PrefillReply:
    """A prefill replica's answer: the first token, and either a finish or a KV handle."""

    request_id: str
    first_token_id: int
    finish_reason: str | None
    stop_reason: str | int | None
    handle: KVHandle | None
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time_s: float
    first_logprobs: tuple[TokenLogprobs, ...] = ()  # of the first token, when asked for
