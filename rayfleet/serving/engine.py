"""``LLMEngine``: the facade that wires model runner, KV manager and scheduler into steps.

Design decisions:
- The engine is a synchronous loop body: ``add_request`` / ``abort`` queue work and
  ``step()`` runs exactly one schedule -> forward -> sample -> update cycle. Threads, asyncio
  and Ray Serve replicas (the next layer) drive it; nothing in here blocks or spawns.
- It runs the model from ``rayfleet.models`` through its paged forward: the same weights and
  numerics as training, no serving copy of the model.
- Block ids and block hashes are the engine's public currency (``block_hashes_of``,
  ``take_kv_events``): a router indexes them, a KV connector ships blocks by id.
- ``EngineConfig`` is a frozen dataclass validated at construction; a pydantic spec at the
  Serve edge maps onto it. ``max_model_len`` defaults to what both the model and the KV pool
  can hold, so one request can always run alone (the scheduler relies on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayfleet.errors import SpecError
from rayfleet.models import ByteTokenizer, MoETransformer, build_model, preset
from rayfleet.serving.block_hash import BlockHash, hash_full_blocks, root_block_hash
from rayfleet.serving.block_pool import BlockPool, KVCacheEvent
from rayfleet.serving.kv_cache_manager import KVCacheManager, KVCacheStats
from rayfleet.serving.model_runner import ModelRunner
from rayfleet.serving.prefix_index import ReplicaId
from rayfleet.serving.request import FinishReason, Request, RequestId, RequestOutput
from rayfleet.serving.router_policy import ReplicaSnapshot
from rayfleet.serving.sampling import SamplingParams, sample_tokens
from rayfleet.serving.scheduler import Scheduler, SchedulerConfig

__all__ = ["EngineConfig", "EngineStats", "GenerationResult", "LLMEngine"]


@dataclass(frozen=True)
class EngineConfig:
    """KV pool and batching limits of one engine replica."""

    block_size: int = 16
    num_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # None: min(model max_seq_len, num_blocks * block_size)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_kv_events: bool = False
    model_id: str = ""  # part of every block hash: engines of different models never share
    seed: int = 0  # generator for requests without their own seed

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise SpecError(name, getattr(self, name), "must be positive", f"pass {name} >= 1")


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
                 tokenizer: ByteTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or ByteTokenizer()
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
                            enable_chunked_prefill=config.enable_chunked_prefill),
            self.kv_cache_manager, eos_token_id=self.tokenizer.eos_id, detokenize=self.tokenizer.decode)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._num_added = 0

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
                    cache_salt: str | None = None) -> None:
        """Queue a request; its tokens arrive through ``step()``. Raises ``SpecError`` for a
        duplicate id, an empty or too long prompt, or token ids outside the vocabulary."""
        params = sampling_params or SamplingParams()
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
        self.scheduler.add_request(request)
        self._num_added += 1

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed now, a final ``abort`` output comes at the
        next ``step()``. Unknown or finished ids are ignored."""
        self.scheduler.abort_requests([RequestId(request_id)])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report new tokens and finished requests."""
        output = self.scheduler.schedule()
        step_logits = self.runner.execute(output)
        requests = [self.scheduler.requests[rid] for rid in step_logits.request_ids]
        tokens = sample_tokens(step_logits.logits, [r.sampling_params for r in requests],
                               [r.generator or self._generator for r in requests])
        return self.scheduler.update_from_output(output, dict(zip(step_logits.request_ids, tokens)))

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
            healthy=healthy)
