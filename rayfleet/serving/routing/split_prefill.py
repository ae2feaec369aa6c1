"""Running a split prefill (``long_context``) on engine replicas: the replica-side worker and the
ingress-side coordinator.

Design decisions:
- One replica call per (span, layer): ``SpanWork`` carries the handles of the earlier spans'
  KV of that layer; the ``SpanReply`` carries the handle of this span's KV of that layer. The
  coordinator (in the ingress) starts one driver per span; driver ``i`` calls layer ``l`` as soon
  as spans ``< i`` have published layer ``l``. That is the layer wavefront of ``long_context``
  with the ingress as the only party that knows all spans, so replicas never address each other
  and the same code runs over Serve handles and in-process clients.
- KV moves through the replica's ``KVTransport`` (the one prefill->decode handoff uses): each
  published layer is a ``KVPayload`` of one layer (``k``/``v`` ``[1, span_blocks, bs, ...]``,
  no tokens, ``first_token_id = -1``) under the owner's lease; the receiving replica ``fetch``es
  it. The last span's final answer is an ordinary ``PrefillReply`` whose handle holds the whole
  prompt's KV, so decode (on a decode replica, or on the last span's replica when colocated)
  is unchanged.
- Span compute runs on the engine thread through ``AsyncEngine.call`` one layer at a time, so
  the replica's ordinary steps (decodes of other requests) interleave between layers.
- Cleanup: ``release_span`` on every span replica when the job ends (success, error or
  cancellation) drops the scratch KV and the per-layer leases; leases expire anyway if the
  ingress dies. The final handoff stays leased until the decode side commits (as for any
  prefill).
- The first token is sampled on the last span's replica with the request's parameters (a seeded
  request's generator state travels with the KV, as in ``LLMEngine``); its stop check is the
  engine's ``check_stop``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.replica_output import PrefillReply
from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle, KVPayload
from rayfleet.serving.routing.long_prefill import SpanAssignment
from rayfleet.serving.routing.span_prefill import SpanPrefill
from rayfleet.serving.errors import ReplicaUnavailableError
from rayfleet.serving.engine.sampling import SamplingParams, sample_tokens
from rayfleet.serving.engine.stop_checker import check_stop

__all__ = ["SpanSetup", "SpanWork", "SpanReply", "SpanPrefillWorker", "split_prefill"]


@dataclass(frozen=True)
class SpanSetup:
    """Sent with layer 0: the prompt (whole for the last span, up to ``end`` otherwise)."""

    prompt_token_ids: tuple[int, ...]
    start: int
    end: int
    is_last: bool
    params: SamplingParams


@dataclass(frozen=True)
class SpanWork:
    """Compute layer ``layer`` of job ``job_id``'s span; ``upstream``: (span start, handle of
    that earlier span's KV of this layer), for every earlier span."""

    job_id: str
    layer: int
    upstream: tuple[tuple[int, KVHandle], ...] = ()
    setup: SpanSetup | None = None


@dataclass(frozen=True)
class SpanReply:
    """``handle``: this span's KV of ``layer`` (not for the last span). ``prefill``: the final
    answer, on the last span's last layer. ``compute_s``: engine-thread seconds of this call."""

    job_id: str
    layer: int
    num_layers: int
    handle: KVHandle | None
    prefill: PrefillReply | None
    compute_s: float


class SpanPrefillWorker:
    """Replica side: the span jobs of one ``AsyncEngine`` (its model, thread and transport)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.jobs: dict[str, tuple[SpanPrefill, SpanSetup]] = {}
        self.handoffs: dict[str, list[HandoffId]] = {}
        self.num_layers_run = 0  # span-layers computed here (observability, tests)

    async def run(self, work: SpanWork) -> SpanReply:
        """Import upstream KV, compute one layer, publish it (or finish). Raises
        ``KVTransferError`` if upstream KV is gone, ``SpecError`` for a bad span."""
        transport = self.engine.transport
        assert transport is not None, f"replica {self.engine.name} has no KV transport"
        inner = self.engine.engine
        if work.setup is not None:
            setup = work.setup
            span = await self.engine.call(SpanPrefill, inner.model, setup.prompt_token_ids, start=setup.start,
                                          end=setup.end, block_size=inner.config.block_size)
            self.jobs[work.job_id] = (span, setup)
            self.handoffs.setdefault(work.job_id, [])
        span, setup = self.jobs[work.job_id]
        payloads = await asyncio.gather(*(transport.fetch(h) for _, h in work.upstream))
        upstream = [(start, *p.tensors()) for (start, _), p in zip(work.upstream, payloads)]

        def compute() -> tuple[float, Any]:
            began = time.perf_counter()
            assert span.next_layer == work.layer, f"span job {work.job_id}: layer {work.layer} out of order"
            for start, k, v in upstream:
                span.import_kv(work.layer, start, k[0], v[0])
            span.run_layer()
            if not setup.is_last:
                out: Any = span.export_kv(work.layer)
            elif span.next_layer == span.num_layers:
                out = self._finish(span, setup)
            else:
                out = None
            return time.perf_counter() - began, out

        compute_s, out = await self.engine.call(compute)
        self.num_layers_run += 1
        handle = prefill = None
        now = self.engine.clock()
        if not setup.is_last:
            k, v = out
            handle = transport.put(KVPayload.from_tensors(prompt_token_ids=(), first_token_id=-1,
                                                          k=k.unsqueeze(0), v=v.unsqueeze(0)), now=now)
            self.handoffs[work.job_id].append(handle.handoff_id)
        elif out is not None:
            prefill = self._reply(work.job_id, setup, *out, now=now)
            self.jobs.pop(work.job_id, None)
        return SpanReply(work.job_id, work.layer, span.num_layers, handle, prefill, compute_s)

    def _finish(self, span: SpanPrefill, setup: SpanSetup):
        """Engine thread: sample the first token, check stops, copy the whole prompt's KV."""
        inner = self.engine.engine
        params = setup.params
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        token = sample_tokens(span.last_logits().unsqueeze(0), [params], [generator],
                              vocab_limit=inner.config.vocab_limit)[0]
        stop = check_stop(output_token_ids=[token], num_tokens=len(setup.prompt_token_ids) + 1, params=params,
                          eos_token_id=inner.eos_token_id, max_model_len=inner.max_model_len,
                          detokenize=inner.tokenizer.decode)
        state = generator.get_state() if params.seed is not None else None
        return token, stop, span.cache.k.clone(), span.cache.v.clone(), state

    def _reply(self, job_id: str, setup: SpanSetup, token: int, stop, k: torch.Tensor, v: torch.Tensor,
               state: torch.Tensor | None, *, now: float) -> PrefillReply:
        handle = None
        if stop is None:
            handle = self.engine.transport.put(KVPayload.from_tensors(
                prompt_token_ids=setup.prompt_token_ids, first_token_id=token, k=k, v=v,
                generator_state=state), now=now)
        return PrefillReply(request_id=job_id, first_token_id=int(token),
                            finish_reason=stop.finish_reason.value if stop else None,
                            stop_reason=stop.stop_reason if stop else None, handle=handle,
                            num_prompt_tokens=len(setup.prompt_token_ids), num_cached_tokens=0, queue_time_s=0.0)

    def release(self, job_id: str) -> int:
        """Drop the job's scratch KV and its per-layer leases; returns leases released."""
        self.jobs.pop(job_id, None)
        transport = self.engine.transport
        return sum(bool(transport.release(h)) for h in self.handoffs.pop(job_id, []))


async def split_prefill(clients: Mapping[str, Any], spans: Sequence[SpanAssignment], *, job_id: str,
                        prompt: Sequence[int], params: SamplingParams,
                        timeout_s: float = 120.0) -> tuple[PrefillReply, dict[str, float]]:
    """Coordinate one split prefill over ``clients[span.replica_id].prefill_span`` (see module
    doc). Returns the last span's ``PrefillReply`` (its handle is owned by the last span's
    replica) and engine-thread seconds per replica. The first replica error propagates as is
    (e.g. ``ReplicaUnavailableError``); every span replica is told to release the job."""
    loop = asyncio.get_running_loop()
    published: dict[tuple[int, int], asyncio.Future] = {}

    def future(i: int, layer: int) -> asyncio.Future:
        return published.setdefault((i, layer), loop.create_future())

    last = len(spans) - 1
    busy = {s.replica_id: 0.0 for s in spans}

    async def drive(i: int) -> PrefillReply:
        span = spans[i]
        setup = SpanSetup(tuple(int(t) for t in prompt[:len(prompt) if i == last else span.end]),
                          span.start, span.end, i == last, params)
        layer, num_layers, reply = 0, None, None
        while num_layers is None or layer < num_layers:
            upstream = tuple([(spans[j].start, await future(j, layer)) for j in range(i)])
            reply = await clients[span.replica_id].prefill_span(
                SpanWork(job_id, layer, upstream, setup if layer == 0 else None))
            busy[span.replica_id] += reply.compute_s
            num_layers = reply.num_layers
            if i != last:
                future(i, layer).set_result(reply.handle)
            layer += 1
        assert reply is not None and (i != last or reply.prefill is not None)
        return reply.prefill

    tasks = [loop.create_task(drive(i)) for i in range(len(spans))]
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        if pending:
            slow = spans[tasks.index(next(iter(pending)))].replica_id
            raise ReplicaUnavailableError(slow, f"split prefill {job_id} did not finish in {timeout_s:g} s")
        return tasks[last].result(), busy
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(clients[s.replica_id].release_span(job_id) for s in spans), return_exceptions=True)
