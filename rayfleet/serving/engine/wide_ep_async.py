"""``GangEngine``: ``AsyncEngine``'s surface over a wide-EP replica, with gang fault handling.

Design decisions:
- A Serve replica of a wide-EP pool talks to its ranks through this class exactly as an
  ordinary replica talks to its ``AsyncEngine``: ``generate`` / ``prefill`` / ``decode`` stream
  the same frozen ``GenerationChunk``s, ``poll_state`` answers the router, ``block_usage`` the
  leak checks, ``check_health`` Serve. Nothing above ``deploy`` knows a replica spans ranks.
- One engine thread (a one-worker executor) owns the ``WideEPReplica`` front: submissions,
  aborts and steps queue FIFO on it, so the front stays single-threaded while the event loop
  streams tokens. One loop task steps while anything is in flight or pending (a step also
  carries aborts, handoffs and placement moves), then sleeps on an event.
- Faults: a rank that dies or raises makes ``gang.step`` raise ``GangError``. The gang is closed
  (its surviving ranks killed, so none waits in a collective) and a new one is formed by
  ``make_gang`` with the live EPLB's current placement; every request in flight is resumed on
  it from its prompt plus the tokens already streamed, asking for the rest (the decode-resume
  rule of ``InferenceService``: greedy continuations are the same tokens; a seeded request
  restarts its generator). The caller's stream never sees the fault. A request that was being
  prefilled for a prefill pool is prefilled again. ``max_reforms`` failed re-forms in a row make
  ``check_health`` fail, so Serve replaces the whole replica (and its placement group).
- Figures: prefill seconds are the step's time times the prompt tokens' share of the tokens
  the step computed (summed over ranks), as ``AsyncEngine`` counts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from rayfleet.serving.engine.async_engine import handoff_reply
from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle, KVTransferError, KVTransport
from rayfleet.serving.engine.replica_output import GenerationChunk, PrefillReply
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaState
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.wide_ep_local import GangError
from rayfleet.serving.engine.wide_ep_rank import StepReport, TokenUpdate
from rayfleet.serving.engine.wide_ep_replica import WideEPReplica
from rayfleet.serving.engine.wide_ep_state import GangFigures, gang_figures, merge_state, merge_usage
from rayfleet.serving.errors import ReplicaUnavailableError, RequestFailedError

log = logging.getLogger(__name__)
__all__ = ["GangEngine", "GangFigures"]


@dataclass
class _Flight:
    """One request in flight on the gang (mutable: tokens are appended as they stream)."""

    kind: str  # generate | prefill | decode
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    queue: asyncio.Queue
    first_token_id: int | None = None  # decode: the token the prefill replica sampled
    handle: KVHandle | None = None
    generated: list[int] = field(default_factory=list)
    attempt: int = 0  # bumped on every resume: the id a rank knows is f"{rid}@{attempt}"
    opened: float = 0.0  # clock() when it reached this replica
    queue_time_s: float | None = None  # opened -> start of the step that first computed it


class GangEngine:
    """A wide-EP replica's runtime. ``make_front(placement)`` forms a gang and returns its front
    (``WideEPReplica``; ``None``: the initial placement). Create inside a running event loop."""

    def __init__(self, make_front: Callable[[Any], WideEPReplica], *, name: str, tokenizer: Any,
                 transport: KVTransport | None = None, max_step_s: float = 120.0, max_reforms: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.make_front, self.name, self._tokenizer = make_front, name, tokenizer
        self.transport, self.max_step_s, self.max_reforms, self.clock = transport, max_step_s, max_reforms, clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gang-{name}")
        self.front = make_front(None)
        self.front.step()  # every rank's first state (an idle step: no collective waits on anyone)
        self._flights: dict[str, _Flight] = {}
        self._events: list = []
        self.prefill_seconds_total = 0.0
        self.num_reforms = self.num_resumed = 0
        self._failed_reforms = 0
        self._step_started: float | None = None
        self._loop_error: BaseException | None = None
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._absorb(self.front.last_reports)

    # -- plumbing -------------------------------------------------------------------------------

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._ensure_loop()
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _ensure_loop(self) -> None:
        if self._loop_error is not None:
            raise ReplicaUnavailableError(self.name, f"its gang loop died ({type(self._loop_error).__name__})")
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _rank_id(self, rid: str) -> str:
        return f"{rid}@{self._flights[rid].attempt}"

    def _submit(self, rid: str) -> None:
        """Engine thread: send ``rid`` to the front as its kind says (also used to resume)."""
        f = self._flights[rid]
        rank_id = self._rank_id(rid)
        if f.kind == "decode" and not f.generated and f.attempt == 0:
            self.front.submit_prefilled(rank_id, f.prompt, f.first_token_id, f.params, f.handle,
                                        cache_salt=f.cache_salt)
            return
        prompt = f.prompt + ([f.first_token_id] if f.kind == "decode" else []) + f.generated
        done = len(f.generated) + (1 if f.kind == "decode" else 0)
        self.front.submit(rank_id, prompt, replace(f.params, max_tokens=f.params.max_tokens - done),
                          cache_salt=f.cache_salt, prefill_only=f.kind == "prefill")

    def _step(self) -> tuple[list[tuple[_Flight, TokenUpdate]], list[tuple[_Flight, str]], bool]:
        """Engine thread: one gang step (or a re-form after a fault); updates by flight."""
        self._step_started = started = self.clock()
        try:
            updates = self.front.step()
        except GangError as exc:
            self._reform(exc)
            return [], [], True
        finally:
            self._step_started = None
        reports = self.front.last_reports
        prefill = sum(r.state.snapshot.num_prefill_tokens_total for r in reports) - self._prefill_tokens
        self._absorb(reports)
        if prefill > 0:
            decodes = sum(1 for u in updates if u.new_token_ids)
            self.prefill_seconds_total += (self.clock() - started) * prefill / (prefill + decodes)
        by_flight = []
        for u in updates:
            rid, _, attempt = u.request_id.rpartition("@")
            f = self._flights.get(rid)
            if f is not None and str(f.attempt) == attempt:
                if f.queue_time_s is None:
                    f.queue_time_s = max(0.0, started - f.opened)
                if f.kind != "prefill":
                    f.generated.extend(u.new_token_ids)
                by_flight.append((f, u))
        lost = []
        for r in reports:
            for rank_id, why in r.kv_lost:
                f = self._flights.get(rank_id.rpartition("@")[0])
                if f is not None:
                    lost.append((f, why))
        return by_flight, lost, self._busy()

    def _busy(self) -> bool:
        return self.front.has_pending() or any(r.state.num_requests or r.state.num_reserved
                                               for r in self.front.last_reports)

    def _absorb(self, reports: list[StepReport]) -> None:
        self._prefill_tokens = sum(r.state.snapshot.num_prefill_tokens_total for r in reports)
        for r in reports:
            self._events.extend(r.state.events)

    def _reform(self, exc: GangError) -> None:
        """Engine thread: close the broken gang, form a new one, resume every flight on it."""
        log.error("replica %s: %s; re-forming the gang and resuming %d requests", self.name, exc,
                  len(self._flights))
        placement = self.front.eplb.placement if self.front.eplb is not None else None
        eplb = self.front.eplb
        try:
            self.front.close()
        except Exception:  # noqa: BLE001 - the broken gang's ranks are being replaced anyway
            log.warning("replica %s: closing the broken gang failed", self.name, exc_info=True)
        try:
            self.front = self.make_front(placement)
            if eplb is not None:
                self.front.eplb = eplb  # the policy's history survives the fault
            self.front.step()
        except Exception:
            self._failed_reforms += 1
            raise
        self._failed_reforms = 0
        self.num_reforms += 1
        self._events.clear()  # the new ranks' caches are empty: the router hears it from their state
        self._absorb(self.front.last_reports)
        for rid, f in self._flights.items():
            f.attempt += 1  # a decode flight is recomputed, not read again: its handoff may be released
            self._submit(rid)
            self.num_resumed += 1

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                try:
                    by_flight, lost, more = await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                                             self._step)
                except Exception:  # noqa: BLE001 - a failed re-form: try again, health counts it
                    if self._failed_reforms >= self.max_reforms:
                        raise
                    log.error("replica %s: re-forming the gang failed", self.name, exc_info=True)
                    await asyncio.sleep(1.0)
                    continue
                for f, update in by_flight:
                    f.queue.put_nowait(update)
                for f, why in lost:
                    f.queue.put_nowait(KVTransferError(why))
                if self.transport is not None:
                    self.transport.expire(now=self.clock())
                if not more:
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                    except asyncio.TimeoutError:
                        pass
        except Exception as exc:
            if self._closing or "cannot schedule new futures" in str(exc):
                return
            self._loop_error = exc
            for f in self._flights.values():
                f.queue.put_nowait(ReplicaUnavailableError(self.name, f"its gang failed ({exc})"))
            log.error("replica %s: the gang loop died", self.name, exc_info=exc)
            raise

    def check_health(self) -> None:
        if self._loop_error is not None:
            raise RuntimeError(f"wide-EP replica {self.name}: the gang loop died: {self._loop_error!r}")
        started = self._step_started
        if started is not None and self.clock() - started > self.max_step_s:
            raise RuntimeError(f"wide-EP replica {self.name}: a gang step has run for {self.clock() - started:.0f} s "
                               f"(limit {self.max_step_s:g} s)")
        if self._failed_reforms >= self.max_reforms:
            raise RuntimeError(f"wide-EP replica {self.name}: {self._failed_reforms} gang re-forms failed in a row")

    # -- requests -------------------------------------------------------------------------------

    async def _open(self, rid: str, flight: _Flight) -> None:
        if rid in self._flights:
            from rayfleet.errors import SpecError

            raise SpecError("request_id", rid, "is already in flight on this replica", "use a unique id per request")
        flight.opened = self.clock()
        self._flights[rid] = flight
        await self.call(self._submit, rid)
        self._wake.set()

    def _close(self, rid: str, *, finished: bool) -> None:
        f = self._flights.pop(rid, None)
        if f is None or finished:
            return
        try:  # cancelled or failed: free the rank's blocks at the next step
            asyncio.get_running_loop().run_in_executor(self._executor, self.front.abort, f"{rid}@{f.attempt}")
        except RuntimeError:
            return
        self._wake.set()

    async def _updates(self, rid: str, f: _Flight) -> AsyncIterator[TokenUpdate]:
        while True:
            item = await f.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:
                raise RequestFailedError(rid, self.name)
            yield item
            if item.finished:
                return

    def _chunk(self, f: _Flight, u: TokenUpdate, first: bool) -> GenerationChunk:
        return GenerationChunk(token_ids=u.new_token_ids, finished=u.finished,
                               finish_reason=u.finish_reason.value if u.finish_reason else None,
                               stop_reason=u.stop_reason, num_prompt_tokens=len(f.prompt),
                               num_cached_tokens=u.num_cached_tokens, logprobs=u.logprobs,
                               queue_time_s=(f.queue_time_s or 0.0) if first else None, replica=self.name)

    async def _stream(self, rid: str, f: _Flight) -> AsyncIterator[GenerationChunk]:
        finished, first = False, True
        try:
            async for u in self._updates(rid, f):
                if not u.new_token_ids and not u.finished:
                    continue  # a prompt still being prefilled in chunks
                finished = u.finished
                yield self._chunk(f, u, first)
                first = False
        finally:
            self._close(rid, finished=finished)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str | None = None) -> AsyncIterator[GenerationChunk]:
        f = _Flight("generate", list(prompt_token_ids), params, cache_salt, asyncio.Queue())
        await self._open(request_id, f)
        async for chunk in self._stream(request_id, f):
            yield chunk

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                      cache_salt: str | None = None) -> PrefillReply:
        """The prompt's KV and first token from the rank the DP balancer picks, handed off under
        a lease of this replica's transport."""
        if self.transport is None:
            raise RuntimeError(f"replica {self.name} has no KV transport (not a prefill replica)")
        f = _Flight("prefill", list(prompt_token_ids), params, cache_salt, asyncio.Queue())
        await self._open(request_id, f)
        finished = False
        try:
            async for u in self._updates(request_id, f):
                last = u
            finished = True
        finally:
            self._close(request_id, finished=finished)
        return handoff_reply(request_id, last.prefill, self.transport, now=self.clock(),
                             queue_time_s=f.queue_time_s or 0.0, first_logprobs=tuple(last.logprobs))

    async def decode(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                     params: SamplingParams, handle: KVHandle, transport: KVTransport | None = None, *,
                     cache_salt: str | None = None) -> AsyncIterator[GenerationChunk]:
        """The rank the DP balancer picks reserves blocks and reads the KV behind ``handle``
        itself (rank to rank); then tokens stream as from ``generate``. The first chunk
        (``committed``) is sent once the request is on a rank: the prefill side may release."""
        f = _Flight("decode", list(prompt_token_ids), params, cache_salt, asyncio.Queue(),
                    first_token_id=int(first_token_id), handle=handle)
        await self._open(request_id, f)
        finished, first = False, True
        try:
            async for u in self._updates(request_id, f):
                if first:
                    yield GenerationChunk(token_ids=(), committed=True, replica=self.name)
                if not u.new_token_ids and not u.finished:
                    continue
                finished = u.finished
                yield self._chunk(f, u, first)
                first = False
        finally:
            self._close(request_id, finished=finished)

    def release_kv(self, handoff_id: HandoffId) -> bool:
        return self.transport.release(handoff_id) if self.transport is not None else False

    async def abort(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is not None:
            await self.call(self.front.abort, f"{request_id}@{f.attempt}")
            self._wake.set()

    async def reset_prefix_cache(self) -> bool:
        def ask() -> None:
            self.front.reset_prefix_cache = True
        await self.call(ask)
        self._wake.set()
        while self.front.reset_prefix_cache:  # the next step carries it
            await asyncio.sleep(0.01)
        return all(r.prefix_cache_reset for r in self.front.last_reports)

    # -- observation ----------------------------------------------------------------------------

    def _usage(self) -> BlockUsage:
        return merge_usage(self.front.last_reports, num_leases=self.transport.num_leases if self.transport else 0)

    async def block_usage(self) -> BlockUsage:
        return await self.call(self._usage)

    def tokenizer(self) -> Any:
        return self._tokenizer

    async def poll_state(self) -> ReplicaState:
        def collect() -> ReplicaState:
            events, self._events = tuple(self._events), []
            return merge_state(self.front.last_reports, name=self.name, events=events, usage=self._usage(),
                               prefill_seconds_total=self.prefill_seconds_total)
        return await self.call(collect)

    async def figures(self) -> GangFigures:
        return await self.call(lambda: gang_figures(self.front, num_reforms=self.num_reforms,
                                                    num_resumed=self.num_resumed))

    def shutdown(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
        self._executor.submit(self.front.close)
        self._executor.shutdown(wait=True, cancel_futures=False)
