"""One rank of a wide-EP replica: its own scheduler and paged KV cache, a slice of the experts.

Design decisions:
- A rank is an ordinary ``LLMEngine`` (scheduler, KV cache manager, paged KV: attention is
  data-parallel, each rank serves its own requests) whose model keeps only this rank's
  physical expert slots and whose MoE layers dispatch through ``ep_dispatch.WideEPDispatcher``;
  its runner is the ``LockstepModelRunner``, so every step lines up with the other ranks.
- The rank is driven by one ``StepCommand`` per step and answers one ``StepReport``: the front
  (``wide_ep_replica``) sends every rank a command each step, so the ranks step in lockstep by
  construction and the front sees every rank's load after every step. The same two messages
  cross a multiprocessing queue (``wide_ep_local``) or would cross a Ray actor call.
- Prefill/decode on a gang: a ``NewRequest`` may be ``prefill_only`` (its ``TokenUpdate``
  carries the ``PrefillResult``: the KV leaves from the rank that computed it), and a
  ``PrefilledRequest`` carries a ``KVHandle`` that the rank itself reads through its
  ``kv_reader`` (the transport's reader side) into blocks it reserved first: KV goes from the
  prefill rank to the decode rank, never through the front. A rank with no room yet reports the
  request ``deferred`` (the front sends it again next step); a lost handoff is ``kv_lost``.
- Every report carries the rank's routing state (snapshot, KV counters, block usage, KV events
  since the last report), so the front can answer the router and the leak checks without an
  extra call.
- Expert weights: every rank materializes the model from the same recipe, keeps the slots of
  the initial placement and drops the rest; after that, weights for a new placement come only
  from other ranks (``move_expert_weights``), before the step that uses them. Requests keep
  their KV and their place in the batch across a move: nothing is dropped or recomputed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from rayfleet.models import build_model, preset
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.ep_dispatch import LayerExchangeStats, WideEPDispatcher, move_expert_weights
from rayfleet.serving.engine.kv_cache_manager import KVCacheStats
from rayfleet.serving.engine.kv_connector import KVHandle, KVTransferError, KVTransport
from rayfleet.serving.engine.llm_engine import LLMEngine, PrefillResult
from rayfleet.serving.engine.lockstep_runner import LockstepModelRunner
from rayfleet.serving.engine.replica_state import ReplicaSnapshot
from rayfleet.serving.engine.request import FinishReason, TokenLogprobs
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.experts.eplb import ExpertPlacement

__all__ = ["ModelRecipe", "NewRequest", "PrefilledRequest", "RankState", "StepCommand", "TokenUpdate", "StepReport",
           "WideEPRank"]


@dataclass(frozen=True)
class ModelRecipe:
    """How every rank builds the same model: ``preset(name, **overrides)`` from ``seed``."""

    name: str = "tiny"
    overrides: tuple[tuple[str, object], ...] = ()
    seed: int = 0
    dtype: str = "float32"

    def build(self, device: str = "cpu"):
        return build_model(preset(self.name, **dict(self.overrides)), seed=self.seed,
                           dtype=getattr(torch, self.dtype), device=device)


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None
    prefill_only: bool = False  # a prefill pool's request: its update carries the PrefillResult


@dataclass(frozen=True)
class PrefilledRequest:
    """A request prefilled elsewhere: reserve blocks, read the KV behind ``handle``, decode."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    params: SamplingParams
    handle: KVHandle
    cache_salt: str | None = None


@dataclass(frozen=True)
class StepCommand:
    """What one rank does in one step: apply ``placement`` first (every rank gets the same one),
    then admit ``requests`` and ``prefilled``, cancel ``aborts`` and step once."""

    requests: tuple[NewRequest, ...] = ()
    aborts: tuple[str, ...] = ()
    placement: ExpertPlacement | None = None
    prefilled: tuple[PrefilledRequest, ...] = ()
    reset_prefix_cache: bool = False


@dataclass(frozen=True)
class TokenUpdate:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    error: str | None = None
    prefill: PrefillResult | None = None  # a finished prefill_only request's KV and first token


@dataclass(frozen=True)
class RankState:
    """One rank's routing and leak-check state after a step (the front sums the ranks')."""

    snapshot: ReplicaSnapshot
    kv: KVCacheStats
    num_requests: int
    num_reserved: int
    events: tuple = ()  # KVCacheEvent since the last report
    max_model_len: int = 0


@dataclass(frozen=True)
class StepReport:
    """One rank after one step. Expert counts are this step's: ``logical`` ``[L, E]`` copies routed
    by this rank, ``physical`` ``[L, P]`` copies it sent to each slot; ``exchange`` per MoE layer."""

    rank: int
    updates: tuple[TokenUpdate, ...]
    num_waiting: int
    num_running: int
    num_queued_tokens: int
    had_tokens: bool
    step_s: float
    busy_s: float
    logical: torch.Tensor
    physical: torch.Tensor
    exchange: tuple[LayerExchangeStats, ...]
    slots_received: int = 0
    move_s: float = 0.0
    num_empty_forwards: int = 0
    slot_checksums: torch.Tensor | None = None  # [L, S] sum of each held slot's w1, for move checks
    state: RankState | None = None
    deferred: tuple[str, ...] = ()  # prefilled requests with no room yet: send them again
    kv_lost: tuple[tuple[str, str], ...] = ()  # (request id, why) of handoffs that could not be read
    prefix_cache_reset: bool | None = None


class WideEPRank:
    """This process's rank of the gang (``dist`` already initialised over ``group``)."""

    def __init__(self, *, rank: int, num_ranks: int, group: dist.ProcessGroup, recipe: ModelRecipe,
                 engine_config: EngineConfig, placement: ExpertPlacement,
                 routing: Literal["balanced", "even"] = "balanced", misroute: bool = False,
                 device: str = "cpu", kv_reader: KVTransport | None = None) -> None:
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
        self.kv_reader = kv_reader
        model = recipe.build(device)
        self.layers = model.moe_layers()
        self.placement = placement
        slots = placement.physical_to_logical.shape[1] // num_ranks
        mine = slice(rank * slots, (rank + 1) * slots)
        self.dispatchers: list[WideEPDispatcher] = []
        for i, layer in enumerate(self.layers):
            experts = layer.experts
            held = placement.physical_to_logical[i, mine].to(experts.w1.device)
            for name in ("w1", "w2", "w3"):  # keep this rank's slots only; the full copy is dropped
                full = getattr(experts, name)
                setattr(experts, name, torch.nn.Parameter(full.detach()[held].clone(), requires_grad=False))
            experts.num_experts = slots
            dispatcher = WideEPDispatcher(group=group, rank=rank, num_ranks=num_ranks,
                                          physical_to_logical=placement.physical_to_logical[i],
                                          logical_to_physical=placement.logical_to_physical[i],
                                          logical_replica_count=placement.logical_replica_count[i],
                                          routing=routing, misroute=misroute)
            layer.dispatcher = dispatcher
            self.dispatchers.append(dispatcher)
        self.engine = LLMEngine(model, engine_config)
        self.runner = LockstepModelRunner(model, num_blocks=engine_config.num_blocks,
                                          block_size=engine_config.block_size, group=group)
        self.engine.runner = self.runner  # the engine's own runner (and its KV) is replaced before any step

    def apply_placement(self, placement: ExpertPlacement) -> int:
        """Move expert weights to ``placement`` (all ranks together); returns slots received."""
        received = 0
        for i, (layer, dispatcher) in enumerate(zip(self.layers, self.dispatchers)):
            received += move_expert_weights(layer.experts, old_p2l=self.placement.physical_to_logical[i],
                                            new_p2l=placement.physical_to_logical[i], rank=self.rank,
                                            num_ranks=self.num_ranks, group=self.group)
            dispatcher.set_placement(placement.physical_to_logical[i], placement.logical_to_physical[i],
                                     placement.logical_replica_count[i])
        self.placement = placement
        return received

    def step(self, command: StepCommand) -> StepReport:
        started = time.perf_counter()
        received, move_s = 0, 0.0
        if command.placement is not None:
            received = self.apply_placement(command.placement)
            move_s = time.perf_counter() - started
        for req in command.requests:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, cache_salt=req.cache_salt,
                                    prefill_only=req.prefill_only)
        deferred, lost = self._admit_prefilled(command.prefilled)
        for request_id in command.aborts:
            self.engine.abort(request_id)
        reset = self.engine.block_pool.reset_prefix_cache() if command.reset_prefix_cache else None
        busy_before, empty_before = self.runner.busy_s, self.runner.num_empty_forwards
        outputs = self.engine.step()
        windows = [d.take_window() for d in self.dispatchers]
        stats = self.engine.stats()
        return StepReport(
            rank=self.rank,
            updates=tuple(TokenUpdate(o.request_id, tuple(o.new_token_ids), o.finished, o.finish_reason,
                                      o.stop_reason, o.num_prompt_tokens, o.num_cached_tokens, tuple(o.logprobs),
                                      o.error, self.engine.pop_prefill_result(o.request_id) if o.finished else None)
                          for o in outputs),
            num_waiting=stats.num_waiting, num_running=stats.num_running, num_queued_tokens=stats.num_queued_tokens,
            had_tokens=bool(self.engine.last_scheduled_ids), step_s=time.perf_counter() - started,
            busy_s=self.runner.busy_s - busy_before,
            logical=torch.stack([w[0] for w in windows]), physical=torch.stack([w[1] for w in windows]),
            exchange=tuple(d.stats.take() for d in self.dispatchers), slots_received=received, move_s=move_s,
            num_empty_forwards=self.runner.num_empty_forwards - empty_before,
            slot_checksums=torch.stack([layer.experts.w1.detach().double().sum(dim=(1, 2)).cpu()
                                        for layer in self.layers]),
            state=self.state(), deferred=deferred, kv_lost=lost, prefix_cache_reset=reset)

    def state(self) -> RankState:
        engine = self.engine
        return RankState(snapshot=engine.replica_snapshot(f"rank-{self.rank}"), kv=engine.kv_cache_manager.stats(),
                         num_requests=len(engine.scheduler.requests), num_reserved=len(engine.scheduler.reserved),
                         events=tuple(engine.take_kv_events()), max_model_len=engine.max_model_len)

    def _admit_prefilled(self, prefilled) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        """Reserve blocks, read each handoff's KV (rank to rank) and commit; see the module doc."""
        deferred, lost = [], []
        for req in prefilled:
            blocks = self.engine.reserve_prefilled(req.request_id, req.prompt_token_ids, req.first_token_id,
                                                   req.params, cache_salt=req.cache_salt)
            if blocks is None:
                deferred.append(req.request_id)
                continue
            try:
                if self.kv_reader is None:
                    raise KVTransferError(f"rank {self.rank} has no KV reader (a gang without kv_reader "
                                          "serves no prefilled requests)")
                payload = asyncio.run(self.kv_reader.fetch(req.handle))
            except KVTransferError as exc:
                self.engine.abort(req.request_id)
                lost.append((req.request_id, str(exc)))
                continue
            k, v = payload.tensors()
            self.engine.commit_prefilled(req.request_id, k, v, generator_state=payload.generator_tensor())
        return tuple(deferred), tuple(lost)
