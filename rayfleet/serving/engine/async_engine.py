"""``AsyncEngine``: an ``LLMEngine`` driven by an asyncio loop, the body of every engine replica.

Design decisions:
- Every engine call (add, abort, reserve, commit, step, stats) runs on one dedicated thread
  (a one-worker executor), so the engine stays single-threaded while the replica's event loop
  keeps streaming tokens and accepting requests during a forward. Commands queue FIFO between
  steps: no lock, no partially applied state.
- One loop task steps while there is work and sleeps on an event otherwise; outputs go to one
  ``asyncio.Queue`` per request. A request's async generator aborts it in ``finally`` if it did
  not finish, so a cancelled caller (client disconnect, ingress cancellation propagated by
  Serve) frees its blocks without any extra call.
- Three entry points match the three replica roles: ``generate`` (colocated), ``prefill``
  (prefill-only, returns the first token and a ``KVHandle``), ``decode`` (pre-allocate blocks,
  fetch the KV, commit, stream). Lease expiry of handed-off KV runs on the loop, at least once
  per second, idle or not.
- No Ray here: Serve deployments (``deployments``) and in-process tests wrap the same class.
- Never a crash loop: the loop body catches everything. A request the engine failed alone
  ends its stream with ``RequestFailedError``; a step failure that names no request fails
  every request in flight (clean errors, blocks freed) and counts against the replica's
  health. ``check_health`` (Serve calls it on engine replicas) raises when the loop task died,
  when a step has run longer than ``max_step_s`` (wedged), or after ``max_step_failures``
  failed steps in a row, so Serve replaces the replica instead of leaving it stuck.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle, KVPayload, KVTransport
from rayfleet.serving.engine.llm_engine import LLMEngine, PrefillResult
from rayfleet.serving.engine.replica_output import GenerationChunk, PrefillReply
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaState
from rayfleet.serving.engine.request import RequestOutput
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.errors import ReplicaUnavailableError, RequestFailedError

log = logging.getLogger(__name__)
__all__ = ["AsyncEngine", "handoff_reply"]

_LOOP_DIED = object()  # put in every request queue when the loop dies (see ``_run``)


def handoff_reply(request_id: str, result: PrefillResult | None, transport: KVTransport, *, now: float,
                  queue_time_s: float, first_logprobs: tuple) -> PrefillReply:
    """A finished prefill as the reply a prefill replica returns: its KV leased in ``transport``
    (unless the first token already ended the request). ``None`` (aborted) raises CancelledError."""
    if result is None:
        raise asyncio.CancelledError(f"prefill of {request_id} was aborted")
    handle = None
    if result.finish_reason is None:
        payload = KVPayload.from_tensors(prompt_token_ids=result.prompt_token_ids,
                                         first_token_id=result.first_token_id, k=result.k, v=result.v,
                                         generator_state=result.generator_state)
        handle = transport.put(payload, now=now)
    return PrefillReply(request_id=request_id, first_token_id=result.first_token_id,
                        finish_reason=result.finish_reason.value if result.finish_reason else None,
                        stop_reason=result.stop_reason, handle=handle, num_prompt_tokens=len(result.prompt_token_ids),
                        num_cached_tokens=result.num_cached_tokens, queue_time_s=queue_time_s,
                        first_logprobs=first_logprobs)


class AsyncEngine:
    """One engine replica's runtime. Create inside a running event loop's process."""

    def __init__(self, engine: LLMEngine, *, name: str, transport: KVTransport | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 after_step: Callable[[], None] | None = None, max_step_s: float = 120.0,
                 max_step_failures: int = 3) -> None:
        self.engine = engine
        self.max_step_s = max_step_s
        self.max_step_failures = max_step_failures
        self._step_started: float | None = None  # clock() at the start of the running step
        # Engine seconds spent on prompt tokens: each step's time times its prompt tokens' share of
        # the tokens it computed (reported beside the engine's prompt-token total, ``poll_state``).
        self.prefill_seconds_total = 0.0
        self._num_step_failures = 0  # failed steps in a row
        self._loop_error: BaseException | None = None
        self._closing = False
        # Runs on the engine thread after every step that did work (e.g. the expert balancer's
        # window accounting and placement updates), so it never overlaps a forward.
        self.after_step = after_step
        self.name = name
        self.transport = transport
        self.clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}")
        self._queues: dict[str, asyncio.Queue] = {}
        self._arrival: dict[str, float] = {}
        self._queue_time: dict[str, float] = {}
        self._wake: asyncio.Event | None = None
        self._stepped: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # -- plumbing -------------------------------------------------------------------------------

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the engine thread, between two steps (never during a
        forward). Split-prefill spans and expert placement updates go through here."""
        return await self._call(fn, *args, **kwargs)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._ensure_loop()
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _ensure_loop(self) -> None:
        if self._loop_error is not None:  # never a crash loop: fail fast until Serve replaces us
            raise ReplicaUnavailableError(self.name, f"its engine loop died ({type(self._loop_error).__name__})")
        if self._task is None or self._task.done():
            self._wake, self._stepped = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> tuple[list[RequestOutput], dict[str, PrefillResult], bool]:
        """Runs on the engine thread: one step, queue times, prefill results popped."""
        outputs = []
        if self.engine.has_unfinished_requests():
            self._step_started = started = self.clock()
            try:
                self.engine.last_step_prefill_tokens = 0  # a failed step computed nothing
                outputs = self.engine.step()
                if self.engine.last_step_prefill_tokens:
                    self.prefill_seconds_total += (self.clock() - started) * (
                        self.engine.last_step_prefill_tokens / max(1, self.engine.last_step_tokens))
                if self.after_step is not None:
                    self.after_step()
                self._num_step_failures = 0
            except Exception as exc:  # noqa: BLE001 - no request to blame: fail them all, stay up
                self._num_step_failures += 1
                log.error("replica %s: a step failed (%d in a row); failing its %d requests", self.name,
                          self._num_step_failures, len(self.engine.scheduler.requests), exc_info=exc)
                for rid in list(self.engine.scheduler.requests):
                    self.engine.scheduler.abort_requests([rid], error="the engine step failed")
                outputs = self.engine.scheduler.take_aborted_outputs()
            finally:
                self._step_started = None
        now = self.clock()
        for rid in self.engine.last_scheduled_ids:
            if rid not in self._queue_time and rid in self._arrival:
                self._queue_time[rid] = now - self._arrival[rid]
        results = {}
        for out in outputs:
            if out.finished:
                result = self.engine.pop_prefill_result(out.request_id)
                if result is not None:
                    results[out.request_id] = result
        return outputs, results, self.engine.has_unfinished_requests()

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:  # check_health reports it; Serve replaces the replica
            if self._closing or "cannot schedule new futures" in str(exc):
                return  # shutdown() or interpreter exit stopped the executor under the loop
            self._loop_error = exc
            for queue in self._queues.values():  # no request waits on a loop that is gone
                queue.put_nowait(_LOOP_DIED)
            log.error("replica %s: the engine loop died", self.name, exc_info=exc)
            raise

    async def _next(self, queue: asyncio.Queue) -> tuple[RequestOutput, PrefillResult | None]:
        item = await queue.get()
        if item is _LOOP_DIED:
            raise ReplicaUnavailableError(self.name, f"its engine loop died ({type(self._loop_error).__name__})")
        return item

    def check_health(self) -> None:
        """Raise ``RuntimeError`` if the loop died, a step is wedged or steps keep failing
        (see module doc). Cheap: reads fields, never waits for the engine thread."""
        if self._loop_error is not None:
            raise RuntimeError(f"engine replica {self.name}: the engine loop died: {self._loop_error!r}")
        started = self._step_started
        if started is not None and self.clock() - started > self.max_step_s:
            raise RuntimeError(f"engine replica {self.name}: a step has run for {self.clock() - started:.0f} s "
                               f"(limit {self.max_step_s:g} s); the engine is wedged")
        if self._num_step_failures >= self.max_step_failures:
            raise RuntimeError(f"engine replica {self.name}: {self._num_step_failures} steps failed in a row")

    async def _loop(self) -> None:
        next_expiry = 0.0
        while True:
            self._wake.clear()
            outputs, results, more = await asyncio.get_running_loop().run_in_executor(self._executor, self._step)
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait((out, results.get(out.request_id)))
            self._stepped.set()
            self._stepped = asyncio.Event()
            if self.transport is not None and self.clock() >= next_expiry:
                self.transport.expire(now=self.clock())
                next_expiry = self.clock() + 1.0
            if not more:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass

    def _open(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            from rayfleet.errors import SpecError

            raise SpecError("request_id", request_id, "is already in flight on this replica",
                            "use a unique id per request")
        self._queues[request_id] = asyncio.Queue()
        self._arrival[request_id] = self.clock()
        return self._queues[request_id]

    def _close(self, request_id: str, *, finished: bool) -> None:
        self._queues.pop(request_id, None)
        self._arrival.pop(request_id, None)
        self._queue_time.pop(request_id, None)
        if not finished:  # cancelled or failed: free the blocks; do not wait (we may be cancelled)
            try:
                asyncio.get_running_loop().run_in_executor(self._executor, self.engine.abort, request_id)
            except RuntimeError:  # the loop or the engine is shutting down: nothing left to free
                return
            self._wake.set()

    def _chunk(self, request_id: str, out: RequestOutput, *, first: bool) -> GenerationChunk:
        if out.error is not None:
            raise RequestFailedError(request_id, self.name)
        return GenerationChunk(
            token_ids=tuple(out.new_token_ids), finished=out.finished,
            finish_reason=out.finish_reason.value if out.finish_reason else None, stop_reason=out.stop_reason,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
            logprobs=tuple(out.logprobs), queue_time_s=self._queue_time.get(request_id, 0.0) if first else None,
            replica=self.name)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[GenerationChunk]:
        finished = False
        first = True
        try:
            while not finished:
                out, _ = await self._next(queue)
                finished = out.finished
                yield self._chunk(request_id, out, first=first)
                first = False
        finally:
            self._close(request_id, finished=finished)

    # -- entry points ---------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream ``GenerationChunk``s until the request ends.
        Raises ``SpecError`` (before the first chunk) for a bad request."""
        queue = self._open(request_id)
        try:
            await self._call(self.engine.add_request, request_id, prompt_token_ids, params, cache_salt=cache_salt)
        except BaseException:
            self._close(request_id, finished=True)
            raise
        self._wake.set()
        async for chunk in self._stream(request_id, queue):
            yield chunk

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                      cache_salt: str | None = None) -> PrefillReply:
        """Compute the prompt's KV and first token; hand the KV off under a lease (unless the
        first token already ends the request). Cancellation aborts the prefill."""
        if self.transport is None:
            raise RuntimeError(f"replica {self.name} has no KV transport (not a prefill replica)")
        queue = self._open(request_id)
        finished = False
        try:
            await self._call(self.engine.add_request, request_id, prompt_token_ids, params,
                             cache_salt=cache_salt, prefill_only=True)
            self._wake.set()
            while True:
                out, result = await self._next(queue)
                if out.finished:
                    finished = True
                    break
            if out.error is not None:
                raise RequestFailedError(request_id, self.name)
            queue_time = self._queue_time.get(request_id, 0.0)
        finally:
            self._close(request_id, finished=finished)
        return handoff_reply(request_id, result, self.transport, now=self.clock(), queue_time_s=queue_time,
                             first_logprobs=tuple(out.logprobs))

    def release_kv(self, handoff_id: HandoffId) -> bool:
        """The decode side has the KV: drop the lease now rather than at expiry."""
        return self.transport.release(handoff_id) if self.transport is not None else False

    async def decode(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                     params: SamplingParams, handle: KVHandle, transport: KVTransport, *,
                     cache_salt: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Reserve blocks, fetch the KV through ``transport``, commit, then stream like
        ``generate``. The first chunk (``committed``, no tokens) tells the caller
        the KV is in this pool (release the lease). Raises ``KVTransferError`` if the KV is gone."""
        queue = self._open(request_id)
        finished = False
        try:
            while True:  # pre-allocate before the transfer; wait for room if the pool is full
                block_ids = await self._call(self.engine.reserve_prefilled, request_id, prompt_token_ids,
                                             first_token_id, params, cache_salt=cache_salt)
                if block_ids is not None:
                    break
                stepped = self._stepped
                self._wake.set()
                try:
                    await asyncio.wait_for(stepped.wait(), timeout=0.05)
                except asyncio.TimeoutError:
                    pass
            payload = await transport.fetch(handle)
            k, v = payload.tensors()
            await self._call(self.engine.commit_prefilled, request_id, k, v,
                             generator_state=payload.generator_tensor())
            self._wake.set()
            yield GenerationChunk(token_ids=(), committed=True, replica=self.name)
            first = True
            while not finished:
                out, _ = await self._next(queue)
                finished = out.finished
                yield self._chunk(request_id, out, first=first)
                first = False
        finally:
            self._close(request_id, finished=finished)

    async def abort(self, request_id: str) -> None:
        await self._call(self.engine.abort, request_id)
        self._wake.set()

    async def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes (benchmarks, operators); False if requests hold blocks."""
        return await self._call(self.engine.block_pool.reset_prefix_cache)

    # -- observation ----------------------------------------------------------------------------

    def _usage(self) -> BlockUsage:
        sched = self.engine.scheduler
        return BlockUsage(num_blocks=self.engine.block_pool.num_blocks,
                          num_free_blocks=self.engine.block_pool.num_free_blocks,
                          num_requests=len(sched.requests), num_reserved=len(sched.reserved),
                          num_leases=self.transport.num_leases if self.transport is not None else 0)

    async def block_usage(self) -> BlockUsage:
        return await self._call(self._usage)

    def tokenizer(self) -> Any:
        """The served model's tokenizer (``ByteTokenizer`` or ``HFTokenizer``; both pickle), which
        the OpenAI app encodes and decodes with. Immutable, so no engine-thread hop."""
        return self.engine.tokenizer

    async def poll_state(self) -> ReplicaState:
        """Snapshot + KV events since the last poll (events are consumed: one poller)."""
        def collect() -> ReplicaState:
            return ReplicaState(snapshot=replace(self.engine.replica_snapshot(self.name),
                                                 prefill_seconds_total=self.prefill_seconds_total),
                                events=tuple(self.engine.take_kv_events()),
                                kv=self.engine.kv_cache_manager.stats(), usage=self._usage(),
                                max_model_len=self.engine.max_model_len,
                                num_waiting=len(self.engine.scheduler.waiting),
                                device=str(self.engine.runner.device))
        return await self._call(collect)

    def shutdown(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
