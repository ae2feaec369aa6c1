"""Running the choices of one OpenAI request (prompts x n) over the ``GenerationService``.

Design decisions:
- A request with several prompts (batch completions) or ``n > 1`` is several engine requests,
  one per choice, run concurrently; choice ``i`` of prompt ``p`` has index ``p * n + i`` (the
  OpenAI order). A seeded request gives choice ``i`` the seed ``seed + i`` so that its choices
  differ yet repeat run to run.
- Each choice's tokens pass through the served tokenizer's text stream (``text_stream``: stop
  strings excluded, characters whole, logprobs aligned). Non-streaming requests gather all
  choices; streaming ones merge the choices' events through one queue into the SSE body.
- One failing choice fails the request: the other choices are cancelled, which closes their
  service streams, which aborts them on their replicas (their KV is freed).
- Service errors map to statuses here (``service_error``): overloaded 429 with Retry-After,
  unavailable 503, an engine-side failure 500 naming the request id (the replica logged it),
  a user mistake 400, anything else a 500 with an id and nothing of the exception's text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.errors import ReplicaOverloadedError, RequestFailedError, ServiceUnavailableError
from rayfleet.serving.openai_api.errors import APIError, internal_error
from rayfleet.serving.openai_api.generation_service import GenerationService
from rayfleet.serving.openai_api.text_stream import Released
from rayfleet.serving.openai_api.tokenization import BYTE, ServedTokenizer

__all__ = ["ChoiceJob", "ChoiceEvent", "ChoiceResult", "run_choices", "stream_choices", "service_error",
           "choice_params"]


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    prompt_index: int
    prompt: list[int]
    params: SamplingParams
    request_id: str


@dataclass(frozen=True)
class ChoiceEvent:
    """New text of one choice (its chunks' tokens through the text stream: stop strings held
    back or cut, characters whole); ``finish_reason`` set on its last event. What the SSE body
    encodes (``responses``)."""

    index: int
    released: Released
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class ChoiceResult:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_generated: int = 0
    num_cached_tokens: int = 0


def service_error(exc: BaseException, request_id: str, *, retry_after_s: int) -> APIError:
    """The HTTP answer for an exception raised while serving ``request_id`` (module doc)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ReplicaOverloadedError):
        return APIError(429, str(exc), code="overloaded", headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"request {request_id} failed on the server; quote this id to the operator",
                        code="engine_error")
    if isinstance(exc, SpecError):
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, (ServiceUnavailableError, RayfleetError)):
        return APIError(503, str(exc), code="service_unavailable", headers={"Retry-After": str(retry_after_s)})
    return internal_error(exc, request_id)


async def _run_one(service: GenerationService, job: ChoiceJob, *, cache_salt: str | None,
                   emit: Callable[[ChoiceEvent], None] | None, tokenizer: ServedTokenizer) -> ChoiceResult:
    text = tokenizer.text_stream(job.params.stop)
    result = ChoiceResult(job.index, job.prompt_index)
    finish, stop_reason = None, None
    released = Released()
    stream = service.stream(job.prompt, job.params, cache_salt=cache_salt, request_id=job.request_id)
    try:
        async for chunk in stream:
            result.num_generated += len(chunk.token_ids)
            result.num_cached_tokens = max(result.num_cached_tokens, chunk.num_cached_tokens)
            released = text.feed(chunk.token_ids, chunk.logprobs)
            if chunk.finish_reason is not None:
                finish, stop_reason = chunk.finish_reason, chunk.stop_reason
            if text.done or finish is not None:
                break
            _collect(result, released, emit)
    finally:
        await stream.aclose()  # a stop string found here ends the engine request now
    if text.done:  # stop string excluded from the text (it may have been held back)
        finish, stop_reason = "stop", text.stop_hit
    else:
        released = _merge(released, text.finish())
    result.finish_reason, result.stop_reason = finish or "abort", stop_reason
    _collect(result, released, None)
    if emit is not None:
        emit(ChoiceEvent(job.index, released, result.finish_reason, stop_reason))
    return result


def _merge(a: Released, b: Released) -> Released:
    return Released(a.text + b.text, a.token_ids + b.token_ids, a.logprobs + b.logprobs)


def _collect(result: ChoiceResult, released: Released, emit: Callable[[ChoiceEvent], None] | None) -> None:
    result.text += released.text
    result.token_ids += released.token_ids
    result.logprobs += released.logprobs
    if emit is not None and (released.text or released.token_ids):
        emit(ChoiceEvent(result.index, released))


def _first_error(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


async def run_choices(service: GenerationService, jobs: list[ChoiceJob], *, cache_salt: str | None,
                      tokenizer: ServedTokenizer = BYTE) -> list[ChoiceResult]:
    """Every choice to completion, in index order; the first failure cancels the rest and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_run_one(service, j, cache_salt=cache_salt, emit=None, tokenizer=tokenizer))
                     for j in jobs]
    except BaseExceptionGroup as eg:
        raise _first_error(eg) from None
    return sorted((t.result() for t in tasks), key=lambda r: r.index)


async def stream_choices(service: GenerationService, jobs: list[ChoiceJob], *, cache_salt: str | None,
                         tokenizer: ServedTokenizer = BYTE) -> AsyncIterator[ChoiceEvent | list[ChoiceResult]]:
    """Events of all choices as they come, then the list of results. Closing the iterator (the
    client left) cancels every choice; a choice's failure is raised after the others stop."""
    queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
    runner = asyncio.create_task(_run_all(service, jobs, cache_salt, queue.put_nowait, tokenizer))
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, runner}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            yield runner.result()  # raises the first failure
            return
    finally:
        if not runner.done():
            runner.cancel()
            try:
                await runner
            except BaseException:  # noqa: BLE001 - cancelled on purpose; the client is gone
                pass


async def _run_all(service: GenerationService, jobs: list[ChoiceJob], cache_salt: str | None,
                   emit: Callable[[ChoiceEvent], None], tokenizer: ServedTokenizer) -> list[ChoiceResult]:
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_run_one(service, j, cache_salt=cache_salt, emit=emit, tokenizer=tokenizer))
                     for j in jobs]
    except BaseExceptionGroup as eg:
        raise _first_error(eg) from None
    return sorted((t.result() for t in tasks), key=lambda r: r.index)


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s parameters: ``seed + i`` for seeded requests (module doc)."""
    if params.seed is None or i == 0:
        return params
    seed = params.seed + i
    return replace(params, seed=seed if seed < 2**64 else seed - 2**64)
