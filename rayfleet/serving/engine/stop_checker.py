"""When a request stops: EOS, stop token ids, stop strings, max_tokens, max_model_len.

Design decisions:
- Pure function of the request's tokens and parameters; the scheduler applies the result.
- Stop strings are matched on the decoded *tail* of the output, not the whole text: the tail
  window is ``4 * len(longest stop) + 4`` tokens, enough for any stop string under a
  tokenizer whose tokens are at least one byte (a UTF-8 character is at most 4 bytes). A stop
  string found there ends the request on the step it first appears (it was not there the step
  before, or the request would have stopped then). Cost per step is O(window), not O(output).
- EOS wins over the other reasons, then stop token ids, then stop strings, then lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from rayfleet.serving.engine.request import FinishReason
from rayfleet.serving.engine.sampling import SamplingParams

__all__ = ["StopDecision", "check_stop"]


@dataclass(frozen=True)
class StopDecision:
    finish_reason: FinishReason
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


def check_stop(*, output_token_ids: Sequence[int], num_tokens: int, params: SamplingParams,
               eos_token_id: int | Collection[int] | None, max_model_len: int,
               detokenize: Callable[[Sequence[int]], str] | None) -> StopDecision | None:
    """Whether the request must finish after its last output token; ``None`` to go on.

    ``num_tokens`` counts prompt and outputs; ``eos_token_id`` is one id or several (HF models). ``detokenize`` is needed only for stop strings
    (``None`` ignores them). Pure; never raises.
    """
    last = output_token_ids[-1]
    is_eos = last == eos_token_id if isinstance(eos_token_id, int) else last in (eos_token_id or ())
    if is_eos and not params.ignore_eos:
        return StopDecision(FinishReason.STOP)
    if last in params.stop_token_ids:
        return StopDecision(FinishReason.STOP, last)
    if params.stop and detokenize is not None:
        window = 4 * max(len(s) for s in params.stop) + 4
        tail = detokenize(output_token_ids[-window:])
        for stop in params.stop:
            if stop in tail:
                return StopDecision(FinishReason.STOP, stop)
    if len(output_token_ids) >= params.max_tokens or num_tokens >= max_model_len:
        return StopDecision(FinishReason.LENGTH)
    return None
