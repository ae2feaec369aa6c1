"""Continuous batching: which tokens of which requests the next forward step computes.

Design decisions:
- Every step is "compute tokens ``[num_computed_tokens, num_tokens)`` of some requests"
  (see ``request``); the scheduler only chooses how many per request, within
  ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running requests.
- Order each step: (1) one decode token for every running request that is decoding, (2) the
  next chunk of running requests still prefilling, (3) new or preempted requests from the
  waiting queue (FCFS, with their prefix-cache hit). Decodes first keeps inter-token latency
  flat while long prompts trickle in as chunks (Sarathi-style chunked prefill).
- Preemption is by recompute: when a running request cannot get a block, the lowest-priority
  running request (latest admitted) *not yet scheduled this step* is freed and sent back to
  the head of the queue, possibly the request itself. Its full blocks stay in the prefix
  cache, so the recompute is often mostly a cache hit. Admission never preempts, and no
  request is admitted in a step that preempted (it would only thrash).
- ``num_computed_tokens`` advances in ``update_from_output``, after the step ran, so it always
  means "KV written"; only then are newly full blocks cached (``KVCacheManager``).
- The scheduler talks to the KV layers only through ``KVCacheManager`` and hands the engine a
  frozen ``SchedulerOutput``; it never sees tensors, blocks or hashes.
- Disaggregated decode: ``reserve_prefilled`` admits a request whose prompt KV is computed
  elsewhere. It allocates every block the prompt (and its first sampled token) needs *before*
  the KV arrives, and holds the request in ``reserved`` (outside the batch) until
  ``commit_prefilled``; an abort frees the reservation. After commit it is an ordinary running
  request one token from decoding, so preemption (recompute) works unchanged.
- A request that cannot fit in the pool even alone is rejected at ``add_request`` (the engine
  sizes ``max_model_len`` to the pool), so preemption always makes progress.
- Failure isolation: a chunk whose update raises fails its request alone (``fail_request``:
  blocks freed, an ``abort`` output carrying an error); ``current_request_id`` names the
  request being scheduled, so that when ``schedule`` raises the engine fails that one. ``max_num_waiting`` bounds the queue: ``add_request`` refuses more
  with ``EngineOverloadedError`` (the ingress answers 429) instead of an unbounded wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_pool import BlockId
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager
from rayfleet.serving.engine.request import FinishReason, Request, RequestId, RequestOutput, RequestStatus
from rayfleet.serving.engine.sampling import SampledToken, TokenLogprobs
from rayfleet.serving.engine.stop_checker import check_stop
from rayfleet.serving.errors import ReplicaOverloadedError

__all__ = ["SchedulerConfig", "ScheduledChunk", "SchedulerOutput", "Scheduler", "EngineOverloadedError"]


class EngineOverloadedError(ReplicaOverloadedError):
    """The replica's waiting queue is full (``max_num_waiting``); retry later or elsewhere."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(f"the engine queue is full ({num_waiting} waiting requests, limit {limit}); "
                         "retry after a short wait (raise engine.max_queued_requests to queue more)")
        self.num_waiting, self.limit = num_waiting, limit

    def __reduce__(self):  # crosses Ray processes
        return (EngineOverloadedError, (self.num_waiting, self.limit))


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits. Raises ``SpecError`` for values that could never schedule a request."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    enable_chunked_prefill: bool = True
    max_num_waiting: int | None = None  # None: unbounded queue (library use)

    def __post_init__(self) -> None:
        if self.max_num_waiting is not None and self.max_num_waiting < 1:
            raise SpecError("max_num_waiting", self.max_num_waiting, "must be positive",
                            "pass max_num_waiting >= 1, or None for no bound")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise SpecError(name, getattr(self, name), "must be positive", f"pass {name} >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise SpecError("max_num_batched_tokens", self.max_num_batched_tokens,
                            f"without chunked prefill a whole prompt (up to max_model_len="
                            f"{self.max_model_len}) must fit in one step",
                            "enable chunked prefill, or raise max_num_batched_tokens to max_model_len")


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``[start_position, start_position + len(token_ids))`` of one request.

    ``block_ids`` is the request's whole block table; ``sample`` says the chunk ends at the
    request's last known token, so its last logits give the next token.
    """

    request_id: RequestId
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[BlockId, ...]
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work for the engine; decodes come first in ``chunks``."""

    chunks: tuple[ScheduledChunk, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[RequestId, ...] = ()
    finished_request_ids: tuple[RequestId, ...] = ()  # finished or aborted since the last step

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Owns the waiting queue and the running list; mutates requests and the KV manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, *,
                 eos_token_id: int | frozenset[int] | None = None,
                 detokenize: Callable[[Sequence[int]], str] | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.eos_token_id = eos_token_id
        self.detokenize = detokenize
        self.requests: dict[RequestId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[RequestId, Request] = {}  # prefilled elsewhere, KV not yet written
        self._finished_ids: list[RequestId] = []
        self._aborted_outputs: list[RequestOutput] = []
        self.num_preemptions = 0
        self.current_request_id: RequestId | None = None  # see module doc (failure isolation)
        self.failures: list[tuple[RequestId, BaseException]] = []  # taken and logged by the engine

    # -- requests in and out --------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ``SpecError`` for a duplicate id or a prompt that leaves no
        room to generate within ``max_model_len``, and ``EngineOverloadedError`` when the
        waiting queue is full."""
        self._validate(request)
        limit = self.config.max_num_waiting
        if limit is not None and len(self.waiting) >= limit:
            raise EngineOverloadedError(len(self.waiting), limit)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_prefilled(self, request: Request, num_computed_tokens: int) -> tuple[BlockId, ...] | None:
        """Allocate blocks for all of ``request``'s tokens, the first ``num_computed_tokens`` of
        which will be written by ``commit_prefilled`` (see module doc). Returns the block table,
        or ``None`` (nothing changed) when the pool or the sequence slots cannot take it now.
        Raises ``SpecError`` like ``add_request``."""
        self._validate(request)
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return None
        request.num_computed_tokens = num_computed_tokens
        if self.kv.allocate_slots(request, request.num_tokens - num_computed_tokens) is None:
            request.num_computed_tokens = 0
            return None
        request.status = RequestStatus.RUNNING
        request.num_cached_tokens = 0
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return tuple(self.kv.get_block_ids(request.request_id))

    def commit_prefilled(self, request_id: RequestId) -> None:
        """The reserved request's KV is written: make its full blocks findable and let it decode.
        Raises ``KeyError`` if it is not reserved (aborted meanwhile)."""
        request = self.reserved.pop(request_id)
        self.kv.cache_computed_blocks(request)
        self.running.append(request)

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise SpecError("request_id", request.request_id, "is already in flight",
                            "use a unique id per request")
        if not request.prompt_token_ids:
            raise SpecError("prompt_token_ids", [], "the prompt is empty", "pass at least one token")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise SpecError("prompt_token_ids", f"<{request.num_prompt_tokens} tokens>",
                            f"needs room for one more token within max_model_len={self.config.max_model_len}",
                            "shorten the prompt or raise max_model_len (and the KV pool)")

    def abort_requests(self, request_ids: Iterable[RequestId], *, error: str | None = None) -> None:
        """Finish requests with ``FinishReason.ABORT`` and free their blocks; unknown or
        finished ids are ignored. Each gets one final output (carrying ``error`` when the
        engine failed it) at the next ``update_from_output``."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if self.reserved.pop(request_id, None) is not None:
                pass
            elif request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            self._finish(request, FinishReason.ABORT)
            self._aborted_outputs.append(replace(self._output(request, ()), error=error))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._aborted_outputs)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks (see module doc). Mutates the queues, the requests' status
        and the KV tables; does not advance ``num_computed_tokens``."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[RequestId] = set()
        preempted: list[RequestId] = []

        for decoding in (True, False):
            for request in list(self.running):
                if budget == 0:
                    break
                if request.request_id in scheduled or request.status is not RequestStatus.RUNNING:
                    continue
                self.current_request_id = request.request_id
                num_new = request.num_tokens - request.num_computed_tokens
                if (num_new == 1) != decoding:
                    continue
                num_new = min(num_new, budget)
                while self.kv.allocate_slots(request, num_new) is None:
                    victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    continue
                chunks.append(self._chunk(request, num_new))
                scheduled.add(request.request_id)
                budget -= num_new

        # After a preemption the pool is short: admitting now would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            self.current_request_id = request.request_id
            prefix = self.kv.get_computed_prefix(request)
            num_new = request.num_tokens - prefix.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, prefix) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = prefix.num_computed_tokens
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))
            scheduled.add(request.request_id)
            budget -= num_new

        self.current_request_id = None
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(chunks=tuple(chunks),
                               num_batched_tokens=self.config.max_num_batched_tokens - budget,
                               preempted_request_ids=tuple(preempted), finished_request_ids=finished)

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: Mapping[RequestId, int | SampledToken]) -> list[RequestOutput]:
        """Apply an executed step: advance cursors, cache full blocks, append sampled tokens,
        finish stopped requests (freeing their blocks). Returns outputs for requests that got
        a token or finished (aborted and failed ones included). Raises ``KeyError`` if a
        sampling chunk has no sampled token (``current_request_id`` names it)."""
        outputs: list[RequestOutput] = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                outputs.extend(self._apply_chunk(request, chunk, sampled_token_ids))
            except Exception as exc:  # noqa: BLE001 - this request fails alone (module doc)
                self.fail_request(chunk.request_id, exc)
        return self.take_aborted_outputs() + outputs

    def fail_request(self, request_id: RequestId, exc: BaseException) -> None:
        """Finish ``request_id`` with an error output (its blocks freed); remembered in
        ``failures`` for the engine to log with the traceback. Unknown ids are ignored."""
        self.failures.append((request_id, exc))
        self.abort_requests([request_id], error="the engine failed this request")

    def take_aborted_outputs(self) -> list[RequestOutput]:
        """Final outputs of requests aborted or failed since the last update (the engine
        reports them itself when a step could not run to ``update_from_output``)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        return outputs

    def _apply_chunk(self, request: Request, chunk: ScheduledChunk,
                     sampled_token_ids: Mapping[RequestId, int | SampledToken]) -> list[RequestOutput]:
        """One chunk of ``update_from_output``: advance, cache, append and check the token."""
        request.num_computed_tokens += len(chunk.token_ids)
        self.kv.cache_computed_blocks(request)
        if not chunk.sample:
            return []
        sampled = sampled_token_ids[chunk.request_id]
        logprobs: tuple[TokenLogprobs, ...] = ()
        if isinstance(sampled, SampledToken):
            logprobs = (sampled.logprobs,) if sampled.logprobs is not None else ()
            sampled = sampled.token_id
        token_id = int(sampled)
        request.append_output_token(token_id)
        stop = check_stop(output_token_ids=request.output_token_ids, num_tokens=request.num_tokens,
                          params=request.sampling_params, eos_token_id=self.eos_token_id,
                          max_model_len=self.config.max_model_len, detokenize=self.detokenize)
        if stop is not None:
            self.running.remove(request)
            self._finish(request, stop.finish_reason, stop.stop_reason)
        return [replace(self._output(request, (token_id,)), logprobs=logprobs)]

    # -- internals ------------------------------------------------------------------------------

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request_id=request.request_id,
                              token_ids=tuple(request.all_token_ids[start:start + num_new]),
                              start_position=start,
                              block_ids=tuple(self.kv.get_block_ids(request.request_id)),
                              sample=start + num_new == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    @staticmethod
    def _output(request: Request, new_token_ids: tuple[int, ...]) -> RequestOutput:
        return RequestOutput(request_id=request.request_id, new_token_ids=new_token_ids,
                             finished=request.is_finished, finish_reason=request.finish_reason,
                             stop_reason=request.stop_reason,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens,
                             num_cached_tokens=max(request.num_cached_tokens, 0))
