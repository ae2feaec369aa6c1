"""Request bodies of the OpenAI API as pydantic models (the reference's types and ranges).

Design decisions:
- Strict: a string is not a number, ``true`` is not 1, ``"false"`` is not a boolean, and NaN
  or Infinity (which Python's ``json`` accepts) is no number at all. Unknown fields are refused
  (400 naming the field), as OpenAI does: a parameter this server does not know would
  otherwise be silently ignored.
- Parameters the server knows but cannot honour are refused with a 400 naming them
  (``suffix``, ``tools``, ``response_format`` other than text, image parts, ``echo`` with
  ``logprobs``) by ``refusals()``; metadata that changes no output (``user``, ``metadata``,
  ``store``, ``service_tier``) is accepted.
- Limits that depend on the deployment (stop strings, ``n``, batch size) are checked in
  ``app`` against the spec's ``http.limits``; ranges fixed by the reference are here.
- Extensions as in vLLM: ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``,
  ``return_token_ids`` (adds ``token_ids`` to each choice, used by exactness tests).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "parse_request", "first_error"]

_Temperature = Annotated[float, Field(ge=0, le=2)]
_Penalty = Annotated[float, Field(ge=-2, le=2)]
_Seed = Annotated[int, Field(ge=-2**63, lt=2**64)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk


class _Sampling(_Body):
    """Fields shared by completions and chat."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: _Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: _Seed | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None  # 0 or -1: off
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    cache_salt: str | None = None
    return_token_ids: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1)] | _TokenIds | Annotated[
        list[_TokenIds], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def refusals(self) -> tuple[str, str] | None:
        """(param, why) of the first parameter this server cannot honour, or None."""
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this model; remove it"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "best_of other than n is not supported; remove it or set it equal to n"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs needs prompt logprobs, which this server does not compute"
        if self.echo and self.stream:
            return "echo", "echo is not supported with stream; request without streaming"
        return None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def refusals(self) -> tuple[str, str] | None:
        """(param, why) of the first parameter this server cannot honour, or None."""
        if self.tools:
            return "tools", "tool calling is not supported by this model; remove tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool calling is not supported by this model; remove tool_choice"
        if self.functions or self.function_call is not None:
            return "functions", "function calling is not supported by this model; remove functions"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", (f"response_format {self.response_format.type!r} is not supported; "
                                       "only {'type': 'text'}")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if isinstance(part, dict) and part.get("type") == "text":
                        return f"messages.{i}.content.{j}.text", "a text part needs a string text"
                    if not isinstance(part, TextPart):
                        return f"messages.{i}.content.{j}", "only text content parts are supported"
        return None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def first_error(exc: ValidationError) -> tuple[str | None, str]:
    """(dotted param, message) of a validation error's first entry, for a 400 that names it.
    The input is quoted only by type and length: it may be huge or hostile."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    # Union branches put the branch name in the path ("prompt.str", "prompt.list[int]"): drop it.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    if loc[:1] == ["prompt"]:
        return "prompt", ("prompt must be a non-empty string, list of strings, list of token ids or list "
                          "of token-id lists")
    if err.get("type") == "extra_forbidden":
        return param, f"unrecognized request argument supplied: {param}"
    value = err.get("input")
    shown = repr(value) if isinstance(value, (int, float, bool)) or value is None else type(value).__name__
    return param, f"{param}: {err.get('msg', 'invalid value')} (got {shown[:60]})"


def parse_request(model: type[_Body], body: Any) -> Any:
    """``model.model_validate(body)``; raises ``ValidationError``."""
    return model.model_validate(body)
