"""The front of a wide-EP replica: DP balancing over its ranks, lockstep steps, live EPLB.

Design decisions:
- The front is what the rest of serving talks to (one replica with per-rank load): it picks a
  rank for each new request (``dp_balance.DPBalancer``), sends every rank one ``StepCommand``
  per step through a gang transport (``wide_ep_local.LocalGang`` here; any object with
  ``step(commands) -> reports`` and ``close()``), and merges the ranks' token updates.
- Live EPLB: the ranks' per-step expert counts are summed into one ``[L, E]`` and fed to a
  ``live_eplb.LiveEPLBPolicy``; an ``ApplyPlacement`` decision rides on the next step's
  commands, and every rank moves expert weights before that step. Requests are never paused,
  dropped or recomputed for a move.
- Figures are gathered here from the reports: per-rank queue depth (waiting requests, queued
  tokens) and busy time, per-layer exchange time and off-rank bytes, per-step device expert
  load (copies per rank, from the slots' counts), and per-request queue wait (submission to
  the start of the step that produced its first token, in seconds and in steps: the step
  count does not depend on how loaded the host is) by rank. The clock is injected.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rayfleet.serving.engine.dp_balance import DPBalancer, RankLoad
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.engine.kv_connector import KVHandle
from rayfleet.serving.engine.wide_ep_rank import NewRequest, PrefilledRequest, StepCommand, StepReport, TokenUpdate
from rayfleet.serving.experts.eplb import ExpertPlacement
from rayfleet.serving.experts.live_eplb import ApplyPlacement, LiveEPLBPolicy

__all__ = ["GangTransport", "RankFigures", "WideEPReplica"]


class GangTransport(Protocol):
    def step(self, commands: list[StepCommand]) -> list[StepReport]: ...

    def close(self) -> None: ...


@dataclass
class RankFigures:
    """Accumulated per rank (mutable): busy and step seconds, queue samples, waits, requests."""

    busy_s: float = 0.0
    step_s: float = 0.0
    num_requests: int = 0
    queue_depth: list[int] = field(default_factory=list)  # waiting requests after each step
    queued_tokens: list[int] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)
    waits_steps: list[int] = field(default_factory=list)  # steps that ran before the one giving the first token
    empty_forwards: int = 0


class WideEPReplica:
    """One replica over ``gang``'s ranks (mutates its queues and figures on every call)."""

    def __init__(self, gang: GangTransport, *, num_ranks: int, block_size: int, dp: DPBalancer | None = None,
                 eplb: LiveEPLBPolicy | None = None, clock: Callable[[], float] = time.perf_counter,
                 max_history: int | None = None) -> None:
        self.gang, self.num_ranks, self.clock = gang, num_ranks, clock
        self.max_history = max_history  # a long-running replica keeps this many steps of figures
        self.dp = dp or DPBalancer(num_ranks, block_size=block_size)
        self.eplb = eplb
        self.pending: list[list[NewRequest]] = [[] for _ in range(num_ranks)]
        self.pending_prefilled: list[list[PrefilledRequest]] = [[] for _ in range(num_ranks)]
        self.pending_aborts: list[list[str]] = [[] for _ in range(num_ranks)]
        self.reset_prefix_cache = False  # asked for at the next step
        self.last_reports: list[StepReport] = []  # every rank's report of the latest step
        self.next_placement: ExpertPlacement | None = None
        self.rank_of: dict[str, int] = {}
        self.submitted_at: dict[str, tuple[float, int]] = {}  # (clock, steps run before it)
        self.first_token_seen: set[str] = set()
        self.ranks = [RankFigures() for _ in range(num_ranks)]
        self.exchange_s: dict[int, float] = defaultdict(float)
        self.exchange_bytes: dict[int, int] = defaultdict(int)
        self.device_load: list[torch.Tensor] = []  # per step [L, ranks] copies computed per rank
        self.expert_load: list[torch.Tensor] = []  # per step [L, E] routed copies, all ranks
        self.moves: list[tuple[int, str, int, float]] = []  # (step, reason, slots received, seconds)
        self.num_steps = 0
        self._num_generated = 0

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
               cache_salt: str | None = None, prefill_only: bool = False) -> int:
        """Queue a request for the rank the DP balancer picks; it is admitted at the next step."""
        rank = self._place(request_id, prompt_token_ids)
        self.pending[rank].append(NewRequest(request_id, tuple(int(t) for t in prompt_token_ids), params,
                                             cache_salt, prefill_only))
        return rank

    def submit_prefilled(self, request_id: str, prompt_token_ids: Sequence[int], first_token_id: int,
                         params: SamplingParams, handle: KVHandle, *, cache_salt: str | None = None) -> int:
        """Queue a request prefilled elsewhere: the picked rank reads its KV behind ``handle``."""
        rank = self._place(request_id, prompt_token_ids)
        self.pending_prefilled[rank].append(PrefilledRequest(request_id, tuple(int(t) for t in prompt_token_ids),
                                                             int(first_token_id), params, handle, cache_salt))
        return rank

    def _place(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        rank = self.dp.choose(prompt_token_ids)
        self.rank_of[request_id] = rank
        self.submitted_at[request_id] = (self.clock(), self.num_steps)
        self.ranks[rank].num_requests += 1
        return rank

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (a request not sent to its rank yet never is)."""
        rank = self.rank_of.get(request_id)
        if rank is None:
            return
        before = len(self.pending[rank]) + len(self.pending_prefilled[rank])
        self.pending[rank] = [r for r in self.pending[rank] if r.request_id != request_id]
        self.pending_prefilled[rank] = [r for r in self.pending_prefilled[rank] if r.request_id != request_id]
        if len(self.pending[rank]) + len(self.pending_prefilled[rank]) == before:
            self.pending_aborts[rank].append(request_id)

    def has_pending(self) -> bool:
        """Anything to send at the next step (requests, handoffs, aborts, a move, a reset)."""
        return bool(any(self.pending) or any(self.pending_prefilled) or any(self.pending_aborts)
                    or self.next_placement is not None or self.reset_prefix_cache)

    def step(self) -> list[TokenUpdate]:
        """One lockstep step of every rank; their token updates, merged. Prefilled requests a rank
        had no room for are sent again next step; ``last_reports`` keeps every rank's report."""
        placement, self.next_placement = self.next_placement, None
        reset, self.reset_prefix_cache = self.reset_prefix_cache, False
        commands = [StepCommand(tuple(reqs), tuple(aborts), placement, tuple(prefilled), reset)
                    for reqs, aborts, prefilled in zip(self.pending, self.pending_aborts, self.pending_prefilled)]
        self.pending = [[] for _ in range(self.num_ranks)]
        self.pending_aborts = [[] for _ in range(self.num_ranks)]
        self.pending_prefilled = [[] for _ in range(self.num_ranks)]
        started, index = self.clock(), self.num_steps
        reports = self.gang.step(commands)
        self.last_reports = reports
        self.num_steps += 1
        updates: list[TokenUpdate] = []
        for report, command in zip(reports, commands):
            self._account(report, started, index)
            updates.extend(report.updates)
            if report.deferred:
                again = set(report.deferred)
                self.pending_prefilled[report.rank].extend(r for r in command.prefilled if r.request_id in again)
        if placement is not None:
            self.moves[-1] = self.moves[-1][:2] + (sum(r.slots_received for r in reports),
                                                   max(r.move_s for r in reports))
        slots = reports[0].physical.shape[1] // self.num_ranks
        sent = torch.stack([r.physical for r in reports]).sum(0)  # [L, P] copies per slot, all ranks
        self.device_load.append(sent.view(sent.shape[0], self.num_ranks, slots).sum(-1))
        self.expert_load.append(torch.stack([r.logical for r in reports]).sum(0))
        if self.max_history is not None:
            self._trim(self.max_history)
        if self.eplb is not None:
            decision = self.eplb.observe_step(self.expert_load[-1])
            if isinstance(decision, ApplyPlacement):
                self.next_placement = decision.placement
                self.moves.append((self.num_steps, decision.reason, 0, 0.0))
        return updates

    def _trim(self, keep: int) -> None:
        del self.device_load[:-keep], self.expert_load[:-keep], self.moves[:-keep]
        for f in self.ranks:
            for samples in (f.queue_depth, f.queued_tokens, f.waits_s, f.waits_steps):
                del samples[:-keep]

    def _account(self, report: StepReport, started: float, index: int) -> None:
        figures = self.ranks[report.rank]
        figures.busy_s += report.busy_s
        figures.step_s += report.step_s
        figures.queue_depth.append(report.num_waiting)
        figures.queued_tokens.append(report.num_queued_tokens)
        figures.empty_forwards += report.num_empty_forwards
        self.dp.observe(report.rank, RankLoad(report.num_queued_tokens, report.num_running, report.num_waiting))
        for layer, ex in enumerate(report.exchange):
            self.exchange_s[layer] += ex.transfer_s
            self.exchange_bytes[layer] += ex.off_rank_bytes
        for update in report.updates:
            if (update.request_id not in self.first_token_seen and update.new_token_ids
                    and update.request_id in self.submitted_at):
                self.first_token_seen.add(update.request_id)
                at, steps_before = self.submitted_at[update.request_id]
                figures.waits_s.append(max(0.0, started - at))
                figures.waits_steps.append(index - steps_before)
            if update.finished:  # a finished request leaves no state behind
                self.rank_of.pop(update.request_id, None)
                self.submitted_at.pop(update.request_id, None)
                self.first_token_seen.discard(update.request_id)

    def run_until_done(self, request_ids: Sequence[str], *, max_steps: int = 100_000,
                       arrivals: Callable[[int], None] | None = None) -> dict[str, list[int]]:
        """Step until every id in ``request_ids`` finished; ``arrivals(step)`` may submit more
        before each step. Returns the tokens of every request seen finishing."""
        tokens: dict[str, list[int]] = defaultdict(list)
        done: set[str] = set()
        wanted = set(request_ids)
        for step in range(max_steps):
            if arrivals is not None:
                arrivals(step)
            for update in self.step():
                tokens[update.request_id].extend(update.new_token_ids)
                if update.finished:
                    done.add(update.request_id)
            if wanted <= done:
                return dict(tokens)
        raise TimeoutError(f"{len(wanted - done)} requests unfinished after {max_steps} steps")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """All prompts submitted at once, run to completion; tokens in prompt order."""
        ids = [f"req-{self._num_generated + i}" for i in range(len(prompts))]
        self._num_generated += len(prompts)
        for rid, prompt in zip(ids, prompts):
            self.submit(rid, prompt, params)
        tokens = self.run_until_done(ids)
        return [tokens[rid] for rid in ids]

    def close(self) -> None:
        self.gang.close()
