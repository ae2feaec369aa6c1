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
- Expert weights: every rank materializes the model from the same recipe, keeps the slots of
  the initial placement and drops the rest; after that, weights for a new placement come only
  from other ranks (``move_expert_weights``), before the step that uses them. Requests keep
  their KV and their place in the batch across a move: nothing is dropped or recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from rayfleet.models import build_model, preset
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.ep_dispatch import LayerExchangeStats, WideEPDispatcher, move_expert_weights
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.lockstep_runner import LockstepModelRunner
from rayfleet.serving.engine.request import FinishReason
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.experts.eplb import ExpertPlacement

__all__ = ["ModelRecipe", "NewRequest", "StepCommand", "TokenUpdate", "StepReport", "WideEPRank"]


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


@dataclass(frozen=True)
class StepCommand:
    """What one rank does in one step: apply ``placement`` first (every rank gets the same one),
    then admit ``requests``, cancel ``aborts`` and step once."""

    requests: tuple[NewRequest, ...] = ()
    aborts: tuple[str, ...] = ()
    placement: ExpertPlacement | None = None


@dataclass(frozen=True)
class TokenUpdate:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None


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


class WideEPRank:
    """This process's rank of the gang (``dist`` already initialised over ``group``)."""

    def __init__(self, *, rank: int, num_ranks: int, group: dist.ProcessGroup, recipe: ModelRecipe,
                 engine_config: EngineConfig, placement: ExpertPlacement,
                 routing: Literal["balanced", "even"] = "balanced", misroute: bool = False,
                 device: str = "cpu") -> None:
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
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
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
        for request_id in command.aborts:
            self.engine.abort(request_id)
        busy_before, empty_before = self.runner.busy_s, self.runner.num_empty_forwards
        outputs = self.engine.step()
        windows = [d.take_window() for d in self.dispatchers]
        stats = self.engine.stats()
        return StepReport(
            rank=self.rank,
            updates=tuple(TokenUpdate(o.request_id, tuple(o.new_token_ids), o.finished, o.finish_reason)
                          for o in outputs),
            num_waiting=stats.num_waiting, num_running=stats.num_running, num_queued_tokens=stats.num_queued_tokens,
            had_tokens=bool(self.engine.last_scheduled_ids), step_s=time.perf_counter() - started,
            busy_s=self.runner.busy_s - busy_before,
            logical=torch.stack([w[0] for w in windows]), physical=torch.stack([w[1] for w in windows]),
            exchange=tuple(d.stats.take() for d in self.dispatchers), slots_received=received, move_s=move_s,
            num_empty_forwards=self.runner.num_empty_forwards - empty_before,
            slot_checksums=torch.stack([layer.experts.w1.detach().double().sum(dim=(1, 2)).cpu()
                                        for layer in self.layers]))
