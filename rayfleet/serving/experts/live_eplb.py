"""Live expert re-placement: when to re-place, and from what demand (a pure policy).

Design decisions:
- The engine counts routed copies per expert every step and feeds them here
  (``observe_step``); every ``window_steps`` steps a window closes and the policy returns a
  typed decision, ``KeepPlacement`` or ``ApplyPlacement`` (the front carries it out by moving
  expert weights between ranks before the next step). No Ray, clock or I/O: the same object
  runs in the engine and over recorded traces in ``benchmarks/wide_ep.py``.
- Demand is a high percentile of the recent windows (``eplb.expert_demand``), not the mean and
  not the last window alone: an expert hot in one window of four keeps its replicas, so a
  drifting load finds them already there.
- A shift is detected, not waited for: when the closed window, under the current placement,
  is worse than ``shift_trigger`` times what a placement fitted on that window would give,
  the old windows describe traffic that is gone; the history is cut to the latest window and
  the policy re-places at once. Otherwise it re-places every ``rebalance_every_windows``
  windows when the percentile demand gives a different placement. (Judging the candidate on
  the recorded windows first was tried: it is biased towards the past and kept stale
  placements under drift.)
- Loads are judged as the engine routes: ``routing="balanced"`` is
  ``replica_split.balanced_split`` (device-level water-filling), ``"even"`` splits an expert's
  tokens evenly over its replicas (``eplb.device_load``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from rayfleet.errors import SpecError
from rayfleet.serving.experts.eplb import (ExpertPlacement, balance_ratio, contiguous_placement, device_load,
                                          expert_demand, rebalance_experts)
from rayfleet.serving.experts.replica_split import balanced_device_load

__all__ = ["LiveEPLBConfig", "KeepPlacement", "ApplyPlacement", "LiveEPLBPolicy", "placement_balance"]


@dataclass(frozen=True)
class LiveEPLBConfig:
    """Slots, fleet shape and cadence of live re-placement for one wide-EP replica."""

    num_devices: int
    num_physical_experts: int
    num_groups: int = 1
    num_nodes: int = 1
    policy: Literal["auto", "hierarchical", "global"] = "auto"
    window_steps: int = 8
    history_windows: int = 4
    percentile: float = 90.0
    rebalance_every_windows: int = 2
    shift_trigger: float = 1.25
    routing: Literal["balanced", "even"] = "balanced"

    def __post_init__(self) -> None:
        for name in ("num_devices", "num_physical_experts", "window_steps", "history_windows",
                     "rebalance_every_windows"):
            if getattr(self, name) < 1:
                raise SpecError(f"expert_balancing.{name}", getattr(self, name), "must be positive",
                                f"pass {name} >= 1")
        if self.shift_trigger < 1.0:
            raise SpecError("expert_balancing.shift_trigger", self.shift_trigger, "must be >= 1 (a ratio to the "
                            "best placement)", "pass e.g. 1.25")


class KeepPlacement(NamedTuple):
    reason: str
    current_balance: float


class ApplyPlacement(NamedTuple):
    placement: ExpertPlacement
    reason: str  # "shift" or "periodic"
    current_balance: float
    predicted_balance: float


def placement_balance(load: torch.Tensor, placement: ExpertPlacement, *, num_devices: int,
                      routing: str = "balanced") -> float:
    """Max/mean device load of ``load`` ``[L, E]`` under ``placement``, averaged over layers."""
    per_device = (balanced_device_load(load, placement, num_devices=num_devices) if routing == "balanced"
                  else device_load(load, placement, num_devices=num_devices))
    return float(balance_ratio(per_device).mean())


class LiveEPLBPolicy:
    """Window bookkeeping and the re-place decision (mutated by ``observe_*``)."""

    def __init__(self, config: LiveEPLBConfig, *, num_layers: int, num_experts: int,
                 initial: ExpertPlacement | None = None) -> None:
        self.config = config
        self.placement = initial if initial is not None else self._initial(num_layers, num_experts)
        self.history: deque[torch.Tensor] = deque(maxlen=config.history_windows)
        self.window = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.steps_in_window = 0
        self.windows_since_apply = 0
        self.decisions: list[KeepPlacement | ApplyPlacement] = []

    def _initial(self, num_layers: int, num_experts: int) -> ExpertPlacement:
        if self.config.num_physical_experts == num_experts:
            return contiguous_placement(num_layers, num_experts)
        return self.place(torch.ones(num_layers, num_experts))  # every expert equally hot until seen

    def place(self, demand: torch.Tensor) -> ExpertPlacement:
        c = self.config
        return rebalance_experts(demand, num_physical_experts=c.num_physical_experts, num_groups=c.num_groups,
                                 num_nodes=c.num_nodes, num_devices=c.num_devices, policy=c.policy)

    def balance(self, load: torch.Tensor, placement: ExpertPlacement) -> float:
        return placement_balance(load, placement, num_devices=self.config.num_devices, routing=self.config.routing)

    def observe_step(self, logical: torch.Tensor) -> KeepPlacement | ApplyPlacement | None:
        """Add one step's ``[L, E]`` counts (summed over ranks); a decision when a window closes."""
        self.window += logical.to(torch.int64)
        self.steps_in_window += 1
        if self.steps_in_window < self.config.window_steps:
            return None
        window, self.window = self.window, torch.zeros_like(self.window)
        self.steps_in_window = 0
        return self.observe_window(window)

    def observe_window(self, window: torch.Tensor) -> KeepPlacement | ApplyPlacement:
        """Close one window ``[L, E]`` and decide (see module doc); applies its own decision to
        ``self.placement`` (the caller moves the weights)."""
        c = self.config
        self.history.append(window.to(torch.int64))
        self.windows_since_apply += 1
        if int(window.sum()) == 0:
            return self._decide(KeepPlacement("no load", 1.0))
        current = self.balance(window, self.placement)
        best = self.balance(window, self.place(window))
        if current > c.shift_trigger * best:
            while len(self.history) > 1:
                self.history.popleft()
            return self._apply(self.place(window), "shift", current)
        if self.windows_since_apply < c.rebalance_every_windows:
            return self._decide(KeepPlacement("not due", current))
        candidate = self.place(expert_demand(torch.stack(list(self.history)), percentile=c.percentile))
        if torch.equal(candidate.physical_to_logical, self.placement.physical_to_logical):
            return self._decide(KeepPlacement("same placement", current))
        return self._apply(candidate, "periodic", current)

    def _apply(self, placement: ExpertPlacement, reason: str, current: float) -> ApplyPlacement:
        self.placement = placement
        self.windows_since_apply = 0
        predicted = self.balance(self.history[-1], placement)
        return self._decide(ApplyPlacement(placement, reason, current, predicted))

    def _decide(self, decision):
        self.decisions.append(decision)
        return decision
