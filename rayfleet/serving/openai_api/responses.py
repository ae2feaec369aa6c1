"""Response bodies of the OpenAI API: choices, logprobs, usage, stream chunks.

Design decisions:
- Shapes follow the OpenAI reference as vLLM emits them: each choice has ``finish_reason``
  (``stop``, ``length`` or ``abort``) and vLLM's ``stop_reason`` (the stop string or stop
  token id that matched, else null). Completions logprobs are the legacy
  ``{tokens, token_logprobs, top_logprobs, text_offset}``; chat logprobs are
  ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
- Usage counts each prompt once (not once per choice) and every generated token, the stop
  string's included (as vLLM does); streaming ends with a usage chunk when asked
  (``stream_options.include_usage``), and ``continuous_usage_stats`` adds the running usage to
  every chunk.
"""

from __future__ import annotations

import json
from typing import Any

from rayfleet.serving.engine.sampling import TokenLogprobs
from rayfleet.serving.openai_api.tokenization import BYTE, ServedTokenizer

__all__ = ["completion_logprobs", "chat_logprobs", "usage", "sse"]


def _lp(value: float) -> float:
    """vLLM's clamp: -inf (and NaN) logprobs are reported as -9999.0, so JSON stays valid."""
    return max(value, -9999.0) if value == value else -9999.0


def completion_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs | None], *, offset: int,
                        tokenizer: ServedTokenizer = BYTE) -> dict[str, Any]:
    """Legacy completions logprobs; ``offset`` is the text length before these tokens; token
    strings are the served ``tokenizer``'s."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        text = tokenizer.token_text(t)
        tokens.append(text)
        offsets.append(offset)
        offset += tokenizer.text_len(t)
        token_lps.append(_lp(lp.logprob) if lp is not None else None)
        top: dict[str, float] = {}
        if lp is not None:
            top = {tokenizer.token_text(i): _lp(v) for i, v in lp.top}
            top.setdefault(text, _lp(lp.logprob))  # vLLM: the sampled token is always listed
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _entry(tokenizer: ServedTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tokenizer.token_text(token_id), "logprob": _lp(logprob),
            "bytes": tokenizer.token_bytes(token_id)}


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs | None], *,
                  tokenizer: ServedTokenizer = BYTE) -> dict[str, Any]:
    content = []
    for t, lp in zip(token_ids, logprobs):
        entry = _entry(tokenizer, t, lp.logprob if lp is not None else float("-inf"))
        entry["top_logprobs"] = [_entry(tokenizer, i, v) for i, v in lp.top] if lp is not None else []
        content.append(entry)
    return {"content": content}


def usage(num_prompt_tokens: int, num_generated: int, num_cached: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_generated,
                           "total_tokens": num_prompt_tokens + num_generated}
    if num_cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return out


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n".encode()
