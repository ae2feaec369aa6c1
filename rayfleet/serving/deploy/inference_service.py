"""``InferenceService``: one request's path through router, prefill and decode replicas.

Design decisions:
- Written against ``ReplicaClient`` and a router object (``Router`` in-process, or a
  ``RouterClient`` over Serve), so the same code runs in the Serve ingress and in unit tests.
- Colocated: route -> ``generate`` stream. Disaggregated: route -> ``prefill`` (first token and
  a KV handle; a dead prefill replica is reported and the next ranked replica tried, up to
  ``max_prefill_retries``) -> ``decode`` on the chosen decode replica, which pre-allocates
  blocks, fetches the KV and streams; when it says ``committed`` the prefill replica's lease
  is released (else it expires).
- Long prompts: when the route plan carries ``spans``, the prefill is split over those replicas
  (``split_prefill``) and continues like a disaggregated request from the last span's reply
  (colocated: decode on the last span's replica, which already holds the KV's lease).
- Resumption: if a replica dies mid-stream (``ReplicaUnavailableError``) or the KV is lost
  (``KVTransferError``), the request restarts on other replicas from prompt + tokens already
  sent, asking for the remaining tokens. Under greedy decoding the continuation is the same
  tokens (prefix caching makes the re-prefill cheap); seeded sampling restarts its generator,
  and a stop string straddling the resume point is not seen. After ``max_resumes`` the stream
  ends with ``ServiceUnavailableError`` (an SSE error event), never a hang: every wait has the
  request deadline.
- The service owns the latency metrics it can measure (TTFT, inter-token, end-to-end, queue
  time reported by replicas); engine counters (prefix cache, KV usage) come from the router's
  polled replica states when ``/metrics`` is scraped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rayfleet.errors import RayfleetError
from rayfleet.serving.engine.replica_output import GenerationChunk
from rayfleet.serving.engine.replica_state import ReplicaState
from rayfleet.serving.engine.kv_connector import KVTransferError
from rayfleet.serving.deploy.replica_client import ReplicaClient
from rayfleet.serving.errors import ReplicaUnavailableError, ServiceUnavailableError
from rayfleet.serving.routing.router import RoutePlan
from rayfleet.serving.engine.sampling import SamplingParams

__all__ = ["RouterLike", "InferenceService", "RequestMetrics"]

log = logging.getLogger(__name__)


class RequestMetrics(Protocol):
    """Where the service records what it measures per request (``serving_metrics.ServingMetrics``)."""

    queue_time: Any  # a histogram: ``.observe(seconds)``
    resumes: Any  # counters: ``.inc()``
    prefill_retries: Any

    def observe_ttft(self, seconds: float) -> None: ...

    def observe_itl(self, seconds: float, num_tokens: int) -> None: ...

    def observe_end(self, seconds: float, num_prompt: int, num_generated: int, finish_reason: str | None) -> None: ...

    def render(self, states: Mapping[str, ReplicaState]) -> bytes: ...


class RouterLike(Protocol):
    async def route(self, prompt_token_ids: list[int], max_tokens: int, cache_salt: str | None = None,
                    exclude: tuple[str, ...] = ()) -> RoutePlan: ...

    async def report_failure(self, replica: str) -> None: ...

    async def replica_states(self) -> dict[str, ReplicaState]: ...


_ids = itertools.count()


class InferenceService:
    def __init__(self, *, router: RouterLike, clients: Mapping[str, ReplicaClient], mode: str,
                 max_resumes: int = 2, max_prefill_retries: int = 2, request_timeout_s: float = 120.0,
                 metrics: RequestMetrics | None = None) -> None:
        self.router = router
        self.clients = dict(clients)
        self.mode = mode
        self.max_resumes = max_resumes
        self.max_prefill_retries = max_prefill_retries
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self._max_model_len: int | None = None
        self._tokenizer: Any = None
        # Load as the shared autoscaler's Serve shell reads it (``load``): requests in flight,
        # those still waiting for their first token, and recent (finish time, TTFT) pairs.
        self.num_in_flight = 0
        self.num_waiting_first_token = 0
        self.recent_ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    async def max_model_len(self) -> int:
        """The engines' context length (from the first replica state the router has)."""
        deadline = time.monotonic() + 30
        while self._max_model_len is None:
            states = await self.router.replica_states()
            if states:
                self._max_model_len = min(s.max_model_len for s in states.values())
            elif time.monotonic() > deadline:
                raise ServiceUnavailableError("no engine replica has reported yet; retry shortly")
            else:
                await asyncio.sleep(0.1)
        return self._max_model_len

    async def tokenizer(self) -> Any:
        """The served model's tokenizer, asked of the replicas once (every replica of a service
        serves the same model); ``ServiceUnavailableError`` when none answers."""
        if self._tokenizer is None:
            for name, client in self.clients.items():
                try:
                    self._tokenizer = await client.tokenizer()
                    break
                except (ReplicaUnavailableError, RayfleetError) as exc:
                    log.warning("replica %s did not give its tokenizer: %s", name, exc)
            else:
                raise ServiceUnavailableError("no engine replica has given its tokenizer; retry shortly")
        return self._tokenizer

    async def stream(self, prompt: list[int], params: SamplingParams, *, cache_salt: str | None = None,
                     request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        """The chunks of one request until it finishes, as the replicas produced them, across
        resumptions: ``num_prompt_tokens`` is always ``prompt``'s length, ``finish_reason`` is
        set only on the last chunk, and no ``committed`` marker is passed on. Raises
        ``ServiceUnavailableError`` when replicas keep failing; closing the iterator aborts the
        request on its replica."""
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        start = time.monotonic()
        last = None
        generated: list[int] = []
        resumes = 0
        exclude: list[str] = []
        finished = False
        finish_reason: str | None = None  # the engine's (stop/length); metrics label the rest "abort"
        self.num_in_flight += 1
        self.num_waiting_first_token += 1
        try:
            while not finished:
                attempt_prompt = prompt + generated
                attempt_params = replace(params, max_tokens=params.max_tokens - len(generated))
                attempt_id = f"{rid}-{next(_ids)}"
                try:
                    # aclosing: a closed stream (client gone) closes the attempt now, not at GC.
                    async with aclosing(self._attempt(attempt_id, attempt_prompt, attempt_params, cache_salt,
                                                      tuple(exclude), len(prompt))) as attempt:
                        async for delta in attempt:
                            now = time.monotonic()
                            if delta.token_ids and last is None:
                                self.num_waiting_first_token -= 1
                                self.recent_ttft.append((now, now - start))
                            if delta.token_ids and self.metrics is not None:
                                if last is None:
                                    self.metrics.observe_ttft(now - start)
                                else:
                                    self.metrics.observe_itl((now - last) / len(delta.token_ids), len(delta.token_ids))
                            if delta.token_ids:
                                last = now
                            generated.extend(delta.token_ids)
                            finished = delta.finish_reason is not None
                            finish_reason = delta.finish_reason
                            yield delta
                            if finished:
                                break
                    if not finished:
                        raise ReplicaUnavailableError("?", "stream ended without a finish")
                except (ReplicaUnavailableError, KVTransferError) as exc:
                    replica = getattr(exc, "replica", None)
                    if replica and replica != "?":
                        exclude.append(replica)
                        await self.router.report_failure(replica)
                    resumes += 1
                    log.warning("request %s: %s; resume %d/%d", rid, exc, resumes, self.max_resumes)
                    if resumes > self.max_resumes:
                        raise ServiceUnavailableError(
                            f"request {rid} failed after {resumes - 1} resumption(s): {exc}") from None
                    if self.metrics is not None:
                        self.metrics.resumes.inc()
        finally:
            self.num_in_flight -= 1
            if last is None:
                self.num_waiting_first_token -= 1
            if self.metrics is not None:
                self.metrics.observe_end(time.monotonic() - start, len(prompt), len(generated),
                                         finish_reason if finished else None)

    async def _attempt(self, rid: str, prompt: list[int], params: SamplingParams, salt: str | None,
                       exclude: tuple[str, ...], original_prompt_len: int) -> AsyncIterator[GenerationChunk]:
        plan = await self.router.route(prompt, params.max_tokens, salt, exclude)
        if not plan.first:
            raise ServiceUnavailableError(f"no healthy {'colocated' if self.mode == 'colocated' else 'prefill'} "
                                          "replica (all failed or starting); retry shortly")
        if self.mode == "colocated" and not plan.spans:
            stream = self.clients[plan.first[0]].generate(rid, prompt, params, salt)
            async with aclosing(self._timed(stream, plan.first[0])) as chunks:
                async for chunk in chunks:
                    yield self._restated(chunk, original_prompt_len)
            return
        if plan.spans:  # long prompt: prefill split over replicas; colocated decode on the last one
            reply, prefill_name = await self._split_prefill(rid, prompt, params, plan)
            decode_names = plan.decode or ((prefill_name,) if self.mode == "colocated" else ())
        else:
            reply, prefill_name = await self._prefill(rid, prompt, params, salt, plan)
            decode_names = plan.decode
        if self.metrics is not None:
            self.metrics.queue_time.observe(reply.queue_time_s)
        committed = False
        try:  # from here on the prefill replica holds a KV lease: every exit releases it
            yield GenerationChunk(token_ids=(reply.first_token_id,), finished=reply.finish_reason is not None,
                                  finish_reason=reply.finish_reason, stop_reason=reply.stop_reason,
                                  num_prompt_tokens=original_prompt_len, num_cached_tokens=reply.num_cached_tokens,
                                  logprobs=tuple(reply.first_logprobs), replica=prefill_name)
            if reply.finish_reason is not None:
                return
            if not decode_names:
                raise ServiceUnavailableError("no healthy decode replica; retry shortly")
            stream = self.clients[decode_names[0]].decode(rid, prompt, reply.first_token_id, replace(params),
                                                         reply.handle, salt)
            async with aclosing(self._timed(stream, decode_names[0])) as chunks:
                async for chunk in chunks:
                    if chunk.committed:
                        committed = True
                        await self._release(prefill_name, reply)
                        continue
                    yield self._restated(chunk, original_prompt_len)
        finally:
            if not committed:
                await self._release(prefill_name, reply)

    async def _prefill(self, rid: str, prompt: list[int], params: SamplingParams, salt: str | None,
                       plan: RoutePlan):
        errors = []
        for name in plan.first[:self.max_prefill_retries + 1]:
            try:
                reply = await asyncio.wait_for(self.clients[name].prefill(rid, prompt, params, salt),
                                               timeout=self.request_timeout_s)
                return reply, name
            except (ReplicaUnavailableError, asyncio.TimeoutError) as exc:
                # A replica silent past the request deadline (for example one Serve is still
                # restarting after a crash, which queues our call) counts as gone: abort what it
                # may hold and try the next ranked replica.
                if isinstance(exc, asyncio.TimeoutError):
                    exc = ReplicaUnavailableError(name, f"no prefill reply in {self.request_timeout_s:g} s")
                    await self._abort_quietly(name, rid)
                errors.append(str(exc))
                await self.router.report_failure(name)
                if self.metrics is not None:
                    self.metrics.prefill_retries.inc()
        raise ServiceUnavailableError(f"prefill failed on {len(errors)} replica(s): {'; '.join(errors)}")

    async def _abort_quietly(self, name: str, rid: str) -> None:
        try:
            await asyncio.wait_for(self.clients[name].abort(rid), timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort: a dead replica holds nothing
            pass

    async def _split_prefill(self, rid: str, prompt: list[int], params: SamplingParams, plan: RoutePlan):
        """``split_prefill`` over ``plan.spans``; the reply's KV is owned by the last span's replica."""
        from rayfleet.serving.routing.split_prefill import split_prefill

        reply, _ = await split_prefill(self.clients, plan.spans, job_id=rid, prompt=prompt, params=params,
                                       timeout_s=self.request_timeout_s)
        return reply, plan.spans[-1].replica_id

    async def _release(self, prefill_name: str, reply) -> None:
        if reply.handle is None:
            return
        try:
            await self.clients[prefill_name].release_kv(reply.handle.handoff_id)
        except Exception:  # noqa: BLE001 - the lease expires anyway
            pass

    async def _timed(self, stream: AsyncIterator[GenerationChunk], replica: str) -> AsyncIterator[GenerationChunk]:
        """Each chunk must arrive within the request timeout: a silent replica is a dead one.
        A timeout or a stream that ends unfinished is charged to ``replica`` (excluded and
        reported; it was charged to "?" and the same replica was retried)."""
        it = stream.__aiter__()
        finished = named = False
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(it.__anext__(), timeout=self.request_timeout_s)
                except StopAsyncIteration:
                    if not finished:
                        raise ReplicaUnavailableError(replica, "stream ended without a finish") from None
                    return
                except asyncio.TimeoutError:
                    raise ReplicaUnavailableError(replica, f"no token for {self.request_timeout_s:g} s") from None
                finished = chunk.finished
                if chunk.replica and not named:  # a pool's client names the replica it reached
                    replica, named = chunk.replica, True
                yield chunk
        finally:
            await it.aclose()

    def _restated(self, chunk: GenerationChunk, prompt_len: int) -> GenerationChunk:
        """A replica's chunk as the request's: the original prompt's length (an attempt after a
        resumption prompts with the tokens already sent) and a finish only when finished."""
        if self.metrics is not None and chunk.queue_time_s is not None:
            self.metrics.queue_time.observe(chunk.queue_time_s)
        return replace(chunk, num_prompt_tokens=prompt_len,
                       finish_reason=chunk.finish_reason if chunk.finished else None)

    def load(self, window_s: float) -> dict[str, Any]:
        """Requests in flight / waiting for a first token now, and TTFTs of the last ``window_s``."""
        since = time.monotonic() - window_s
        return {"in_flight": self.num_in_flight, "waiting_first_token": self.num_waiting_first_token,
                "ttft_s": [t for at, t in self.recent_ttft if at >= since]}

    async def replica_states(self) -> dict[str, ReplicaState]:
        """Every replica's last state as the router holds it (``/health``, ``/metrics``)."""
        return await self.router.replica_states()

    async def metrics_text(self) -> bytes:
        """``/metrics``: the request metrics and the replicas' engine counters, as Prometheus text."""
        if self.metrics is None:
            return b""
        return self.metrics.render(await self.router.replica_states())

    def add_client(self, name: str, client: ReplicaClient) -> None:
        """A replica added while serving (the shared autoscaler's): the router may now name it."""
        self.clients[name] = client

    async def block_usage(self) -> dict[str, Any]:
        """Every replica's ``BlockUsage`` (asked directly, not from the router's cache)."""
        out = {}
        for name, client in self.clients.items():
            by_replica = getattr(client, "block_usage_by_replica", None)
            if by_replica is not None:  # a pool deployment: one entry per replica
                out.update(await by_replica())
                continue
            try:
                out[name] = await client.block_usage()
            except ReplicaUnavailableError:
                out[name] = None
        return out
