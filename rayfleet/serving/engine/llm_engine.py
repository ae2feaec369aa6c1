"""``LLMEngine``: the facade that wires model runner, KV manager and scheduler into steps.

Design decisions:
- The engine is a synchronous loop body: ``add_request`` / ``abort`` queue work and
  ``step()`` runs exactly one schedule -> forward -> sample -> update cycle. Threads, asyncio
  and Ray Serve replicas (the next layer) drive it; nothing in here blocks or spawns.
- It runs the model from ``rayfleet.models`` through its paged forward: the same weights and
  numerics as training, no serving copy of the model.
- Block ids and block hashes are the engine's public currency (``block_hashes_of``,
  ``take_kv_events``): a router indexes them, a KV connector ships blocks by id.
- Prefill/decode split at the engine level (the Serve layer moves the bytes): a
  ``prefill_only`` request runs as a one-token request; when it finishes, its prompt KV is
  copied out of the pool (``pop_prefill_result``) right after the step, before any later step
  could reuse its freed blocks, together with the first token and whether that token already
  ends the request under the caller's real parameters. On the decode side
  ``reserve_prefilled`` allocates the blocks first and ``commit_prefilled`` writes the KV into
  them; from then on the request decodes like any other. A seeded request carries its
  generator state along, so its sampled tokens do not depend on the split.
- ``EngineConfig`` is a frozen dataclass validated at construction; a pydantic spec at the
  Serve edge maps onto it. ``max_model_len`` defaults to what both the model and the KV pool
  can hold, so one request can always run alone (the scheduler relies on it).
- KV tiers are optional and outside the scheduler: a connector (``kv_connector.KVTierHooks``,
  implemented by ``kv.tier_connector``) hooks the block pool's
  evictions (write-back to host memory / disk) and, before each ``schedule()``, loads queued
  requests' blocks from the lower tiers into the pool as ordinary cached blocks
  (``kv_connector``), so the scheduler's prefix lookup finds them.
- Failure isolation: a request that raises while being scheduled, in the forward pass or in
  sampling fails alone: its blocks are freed and it ends with an ``abort`` output carrying an
  error (the traceback is logged here with its request id); the batch's other requests get
  their tokens. A failed batched forward is re-run chunk by chunk to find the culprit (the
  step's KV writes are simply redone: cursors advance only after a step).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from rayfleet.errors import SpecError
from rayfleet.models import ByteTokenizer, MoETransformer, build_model, preset
from rayfleet.serving.engine.block_hash import BlockHash, hash_full_blocks, root_block_hash
from rayfleet.serving.engine.block_pool import BlockId, BlockPool, KVCacheEvent
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.kv_cache_manager import KVCacheManager, KVCacheStats
from rayfleet.serving.engine.kv_connector import KVTierHooks
from rayfleet.serving.engine.model_runner import ModelRunner
from rayfleet.serving.engine.request import FinishReason, Request, RequestId, RequestOutput
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.engine.model_runner import StepLogits
from rayfleet.serving.engine.sampling import SampledToken, SamplingParams, sample_rows
from rayfleet.serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from rayfleet.serving.engine.stop_checker import check_stop

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "GenerationResult", "LLMEngine", "PrefillResult"]


@dataclass(frozen=True)
class EngineStats:
    """Point-in-time counters; ``num_active_blocks`` sums running requests' block tables (a
    shared block counts once per request reading it), ``num_queued_tokens`` is prompt work
    not yet computed (waiting requests and unfinished prefill chunks)."""

    kv: KVCacheStats
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_active_blocks: int
    num_queued_tokens: int


@dataclass(frozen=True)
class PrefillResult:
    """A finished ``prefill_only`` request: its prompt KV and first token.

    ``k``/``v``: ``[num_layers, ceil(num_prompt_tokens / block_size), block_size, kv_heads,
    head_dim]`` copies of the request's blocks (positions past the prompt are garbage).
    ``finish_reason`` is set when the first token already ends the request (EOS, a stop,
    ``max_tokens == 1``); then no decode is needed.
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    k: torch.Tensor
    v: torch.Tensor
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    generator_state: torch.Tensor | None = None


@dataclass(frozen=True)
class GenerationResult:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0


class LLMEngine:
    """One model, its KV cache and a continuous-batching scheduler."""

    def __init__(self, model: MoETransformer, config: EngineConfig = EngineConfig(), *,
                 tokenizer: Any = None, kv_tiers: KVTierHooks | None = None,
                 eos_token_ids: Collection[int] | None = None) -> None:
        self.config = config
        # ``ByteTokenizer`` or ``HFTokenizer``: ``eos_id``, ``decode`` (stop strings), ``vocab_size``.
        self.tokenizer = tokenizer or ByteTokenizer()
        # An HF model may end on several ids (generation_config.json lists them); else the tokenizer's EOS.
        self.eos_token_id: int | frozenset[int] | None = (
            frozenset(int(i) for i in eos_token_ids) if eos_token_ids else self.tokenizer.eos_id)
        capacity = config.num_blocks * config.block_size
        max_model_len = config.max_model_len or min(model.config.max_seq_len, capacity)
        if max_model_len > min(model.config.max_seq_len, capacity):
            raise SpecError("max_model_len", max_model_len,
                            f"exceeds the model's max_seq_len={model.config.max_seq_len} or the KV pool "
                            f"({config.num_blocks} blocks x {config.block_size} = {capacity} tokens)",
                            "lower max_model_len or raise num_blocks")
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model, num_blocks=config.num_blocks, block_size=config.block_size)
        self.block_pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching,
                                    enable_kv_events=config.enable_kv_events)
        self.kv_cache_manager = KVCacheManager(self.block_pool, block_size=config.block_size,
                                               enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=max_model_len,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            max_num_waiting=config.max_num_waiting),
            self.kv_cache_manager, eos_token_id=self.eos_token_id, detokenize=self.tokenizer.decode)
        self.kv_tiers = kv_tiers
        if kv_tiers is not None:
            if not config.enable_prefix_caching:
                raise SpecError("enable_prefix_caching", False, "KV tiers reuse blocks through the prefix cache",
                                "enable prefix caching, or drop kv_cache from the spec")
            kv_tiers.attach(block_pool=self.block_pool, kv_cache=self.runner.kv_cache,
                            block_size=config.block_size)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._num_added = 0
        self._prefill_params: dict[RequestId, SamplingParams] = {}
        self._prefill_results: dict[RequestId, PrefillResult] = {}
        self.last_scheduled_ids: tuple[RequestId, ...] = ()  # requests in the latest step
        # Prompt tokens of the latest step, all its tokens, prompt tokens so far (the router's
        # prefill-rate input; the async shell times steps: this class reads no clock).
        self.last_step_prefill_tokens = self.last_step_tokens = 0
        self.num_prefill_tokens_total = 0

    @classmethod
    def from_preset(cls, name: str = "tiny", config: EngineConfig = EngineConfig(), *, seed: int = 0,
                    dtype: torch.dtype | None = None, device: str = "cpu",
                    **model_overrides: object) -> "LLMEngine":
        """Build ``rayfleet.models.preset(name, **model_overrides)`` with weights from ``seed``."""
        model = build_model(preset(name, **model_overrides), seed=seed, dtype=dtype, device=device)
        return cls(model, config)

    @property
    def model(self) -> MoETransformer:
        return self.runner.model

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, prefill_only: bool = False) -> None:
        """Queue a request; its tokens arrive through ``step()``. Raises ``SpecError`` for a
        duplicate id, an empty or too long prompt, or token ids outside the vocabulary.

        ``prefill_only``: stop after the first token and keep the prompt KV for
        ``pop_prefill_result`` (see module doc)."""
        params = sampling_params or SamplingParams()
        request = self._make_request(request_id, prompt_token_ids,
                                     replace(params, max_tokens=1) if prefill_only else params, cache_salt)
        self.scheduler.add_request(request)
        if prefill_only:
            self._prefill_params[request.request_id] = params
        self._num_added += 1

    def _make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      cache_salt: str | None) -> Request:
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise SpecError("prompt_token_ids", bad[:5], f"ids outside the vocabulary [0, {vocab})",
                            "tokenize with the model's tokenizer")
        generator = (torch.Generator().manual_seed(params.seed) if params.seed is not None
                     else self._generator)
        request = Request(request_id=RequestId(request_id),
                          prompt_token_ids=[int(t) for t in prompt_token_ids],
                          sampling_params=params, block_size=self.config.block_size,
                          root_hash=root_block_hash(model_id=self.config.model_id, cache_salt=cache_salt),
                          arrival_index=self._num_added, generator=generator)
        return request

    def reserve_prefilled(self, request_id: str, prompt_token_ids: Sequence[int], first_token_id: int,
                          sampling_params: SamplingParams, *,
                          cache_salt: str | None = None) -> tuple[BlockId, ...] | None:
        """Pre-allocate blocks for a request prefilled elsewhere (prompt + its first token).

        Returns the block table, or ``None`` when the pool or the sequence slots are full now
        (retry after a step). The request is held until ``commit_prefilled``; ``abort`` frees
        it. Raises ``SpecError`` like ``add_request``.
        """
        request = self._make_request(request_id, prompt_token_ids, sampling_params, cache_salt)
        request.append_output_token(int(first_token_id))
        if not 0 <= int(first_token_id) < self.model.config.vocab_size:
            raise SpecError("first_token_id", first_token_id, "outside the vocabulary", "pass a sampled id")
        block_ids = self.scheduler.reserve_prefilled(request, request.num_prompt_tokens)
        if block_ids is not None:
            self._num_added += 1
        return block_ids

    def commit_prefilled(self, request_id: str, k: torch.Tensor, v: torch.Tensor, *,
                         generator_state: torch.Tensor | None = None) -> None:
        """Write the transferred prompt KV (``PrefillResult.k``/``v`` layout) into the reserved
        blocks and let the request decode; a seeded request resumes its generator from
        ``generator_state``. Raises ``KeyError`` if it is no longer reserved (aborted) and
        ``SpecError`` if the KV does not match the reservation."""
        rid = RequestId(request_id)
        request = self.scheduler.reserved[rid]
        if generator_state is not None and request.sampling_params.seed is not None:
            request.generator.set_state(generator_state)
        num_blocks = -(-request.num_prompt_tokens // self.config.block_size)
        cache = self.runner.kv_cache
        if tuple(k.shape) != (cache.k.shape[0], num_blocks, *cache.k.shape[2:]) or k.shape != v.shape:
            raise SpecError("kv", tuple(k.shape), f"does not match {num_blocks} blocks of this engine's "
                            f"KV layout {tuple(cache.k.shape)}", "transfer between engines of one model "
                            "and block size")
        ids = torch.tensor(self.kv_cache_manager.get_block_ids(rid)[:num_blocks], dtype=torch.long, device=cache.k.device)
        cache.k[:, ids] = k.to(cache.k.device, cache.k.dtype)
        cache.v[:, ids] = v.to(cache.v.device, cache.v.dtype)
        self.scheduler.commit_prefilled(rid)

    def pop_prefill_result(self, request_id: str) -> PrefillResult | None:
        """The KV and first token of a finished ``prefill_only`` request (once)."""
        return self._prefill_results.pop(RequestId(request_id), None)

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed now, a final ``abort`` output comes at the
        next ``step()``. Unknown or finished ids are ignored."""
        self.scheduler.abort_requests([RequestId(request_id)])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report new tokens and finished requests."""
        if self.kv_tiers is not None and self.scheduler.waiting:
            sched = self.scheduler
            # Blocks the running requests may take this step: loads must not cause preemptions.
            reserved = sum(self.kv_cache_manager.num_blocks_needed(r, r.num_tokens - r.num_computed_tokens)
                           for r in sched.running)
            self.kv_tiers.before_schedule(sched.waiting, admit_window=self.config.max_num_seqs - len(sched.running),
                                          num_reserved_blocks=reserved)
        try:
            output = self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001 - fail the request being scheduled alone
            culprit = self.scheduler.current_request_id
            self.scheduler.current_request_id = None
            if culprit is None:
                raise
            self.scheduler.fail_request(culprit, exc)
            self._log_failures()
            return self.scheduler.take_aborted_outputs()
        self.last_scheduled_ids = tuple(c.request_id for c in output.chunks)
        self.last_step_prefill_tokens = sum(len(c.token_ids) for c in output.chunks if c.start_position
                                            < self.scheduler.requests[c.request_id].num_prompt_tokens)
        self.last_step_tokens = output.num_batched_tokens
        self.num_prefill_tokens_total += self.last_step_prefill_tokens
        step_logits = self._execute(output)
        requests = [self.scheduler.requests[rid] for rid in step_logits.request_ids]
        rows = sample_rows(step_logits.logits.cpu(), [r.sampling_params for r in requests],  # CPU generators
                           [r.generator or self._generator for r in requests],
                           vocab_limit=self.config.vocab_limit,
                           output_token_ids=[r.output_token_ids for r in requests])
        sampled: dict[RequestId, SampledToken] = {}
        for request, row in zip(requests, rows):
            if isinstance(row, Exception):
                self.scheduler.fail_request(request.request_id, row)
            else:
                sampled[request.request_id] = row
        requests = [r for r in requests if r.request_id in sampled]
        # Block tables of prefill-only requests sampling now: finishing frees them (contents
        # stay intact until a later step allocates them), so export right after the update.
        exporting = {r.request_id: (r, self.kv_cache_manager.get_block_ids(r.request_id))
                     for r in requests if r.request_id in self._prefill_params}
        outputs = self.scheduler.update_from_output(output, sampled)
        self._log_failures()
        for out in outputs:
            if out.request_id in exporting and out.finished and out.finish_reason is not FinishReason.ABORT:
                self._export_prefill(*exporting[out.request_id])
            if out.finished:
                self._prefill_params.pop(out.request_id, None)
        return outputs

    def _execute(self, output: SchedulerOutput) -> StepLogits:
        """The step's forward; if it raises, each chunk alone, failing the chunks that raise."""
        try:
            return self.runner.execute(output)
        except Exception:  # noqa: BLE001 - isolate below
            log.warning("a batched forward of %d chunks failed; re-running them one by one", len(output.chunks))
        ids: list[RequestId] = []
        rows: list[torch.Tensor] = []
        for chunk in output.chunks:
            try:
                one = self.runner.execute(replace(output, chunks=(chunk,), num_batched_tokens=len(chunk.token_ids)))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.scheduler.fail_request(chunk.request_id, exc)
                continue
            ids.extend(one.request_ids)
            rows.extend(one.logits)
        vocab = self.model.config.vocab_size
        return StepLogits(tuple(ids), torch.stack(rows) if rows else torch.empty(0, vocab))

    def _log_failures(self) -> None:
        failures, self.scheduler.failures = self.scheduler.failures, []
        for request_id, exc in failures:
            log.error("request %s failed in the engine and was ended alone", request_id, exc_info=exc)

    def _export_prefill(self, request: Request, block_ids: list[BlockId]) -> None:
        params = self._prefill_params[request.request_id]
        num_blocks = -(-request.num_prompt_tokens // self.config.block_size)
        ids = torch.tensor(block_ids[:num_blocks], dtype=torch.long, device=self.runner.device)
        stop = check_stop(output_token_ids=request.output_token_ids, num_tokens=request.num_tokens,
                          params=params, eos_token_id=self.eos_token_id,
                          max_model_len=self.max_model_len, detokenize=self.tokenizer.decode)
        seeded = params.seed is not None and request.generator is not None
        self._prefill_results[request.request_id] = PrefillResult(
            request_id=request.request_id, prompt_token_ids=tuple(request.prompt_token_ids),
            first_token_id=request.output_token_ids[0],
            k=self.runner.kv_cache.k[:, ids].clone(), v=self.runner.kv_cache.v[:, ids].clone(),
            finish_reason=stop.finish_reason if stop else None, stop_reason=stop.stop_reason if stop else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            generator_state=request.generator.get_state() if seeded else None)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, request_ids: Sequence[str] | None = None) -> list[GenerationResult]:
        """Run the given prompts to completion (stepping the engine); results in prompt order.

        Other requests already in the engine keep running alongside and their outputs are
        dropped. Raises ``SpecError`` like ``add_request``.
        """
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        ids = list(request_ids) if request_ids is not None else [
            f"generate-{self._num_added + i}" for i in range(len(prompts))]
        for rid, prompt, params in zip(ids, prompts, sampling_params, strict=True):
            self.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            assert self.has_unfinished_requests(), "requests vanished without a final output"
            for out in self.step():
                if out.request_id in tokens:
                    tokens[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        done[out.request_id] = out
        return [GenerationResult(request_id=RequestId(rid), prompt_token_ids=tuple(prompt),
                                 output_token_ids=tuple(tokens[rid]),
                                 finish_reason=done[rid].finish_reason, stop_reason=done[rid].stop_reason,
                                 num_cached_tokens=done[rid].num_cached_tokens)
                for rid, prompt in zip(ids, prompts)]

    def block_hashes_of(self, prompt_token_ids: Sequence[int], *,
                        cache_salt: str | None = None) -> list[BlockHash]:
        """The full-block hashes this engine would give the prompt (for routers). Pure."""
        return hash_full_blocks(list(prompt_token_ids), block_size=self.config.block_size,
                                root=root_block_hash(model_id=self.config.model_id, cache_salt=cache_salt))

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Block hashes stored/evicted since the last call (needs ``enable_kv_events``)."""
        return self.block_pool.take_events()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        tables = self.kv_cache_manager.req_to_blocks
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        # A running request with exactly one uncomputed token is decoding: not queued prompt work.
        queued += sum(n for r in sched.running if (n := r.num_tokens - r.num_computed_tokens) > 1)
        return EngineStats(kv=self.kv_cache_manager.stats(), num_waiting=len(sched.waiting),
                           num_running=len(sched.running), num_preemptions=sched.num_preemptions,
                           num_active_blocks=sum(len(tables.get(r.request_id, ())) for r in sched.running),
                           num_queued_tokens=queued)

    def replica_snapshot(self, replica_id: str, *, healthy: bool = True) -> ReplicaSnapshot:
        """This engine as the router sees it (see ``router_policy``). Pure."""
        stats = self.stats()
        return ReplicaSnapshot(
            replica_id=ReplicaId(replica_id), num_total_blocks=stats.kv.num_blocks,
            num_free_blocks=stats.kv.num_free_blocks, num_active_blocks=stats.num_active_blocks,
            num_queued_blocks=-(-stats.num_queued_tokens // self.config.block_size),
            num_running_requests=stats.num_running, max_num_seqs=self.config.max_num_seqs,
            healthy=healthy, num_prefill_tokens_total=self.num_prefill_tokens_total)
