"""Expert load balancing applied to a serving engine: count, re-place, route among replicas.

``eplb`` is the pure algorithm; this module runs it inside an engine replica.

Design decisions:
- Serving-side MoE dispatch through the layer's ``dispatcher`` hook (``run_experts``), so the
  model (and training numerics) stay untouched: ``ReplicatedExpertDispatcher`` holds the
  layer's *physical* experts (``P = E + redundant`` weight copies, ``P / D`` slots per device),
  maps each routed copy from its logical expert to one of that expert's replicas with
  ``eplb.route_to_replicas`` (least loaded within the forward, lower replica rank on ties), runs
  the grouped GEMMs per physical expert, and combines in the logical dispatcher's order. A
  replica holds a bit-for-bit copy of its logical expert's weights, so a token's output does not
  depend on which replica served it (the unit test checks the generated tokens are identical).
- Counting: each dispatcher adds the routed copies of every forward to a per-layer window
  (logical ``[E]`` and physical ``[P]``). ``ExpertLoadBalancer.after_step`` (the engine loop's
  hook, on the engine thread) closes a window every ``window_steps`` engine steps; every
  ``rebalance_every_windows`` windows it sizes replicas from the ``percentile`` of the last
  ``history_windows`` windows (``eplb.expert_demand``), places them (``eplb.rebalance_experts``)
  and applies the placement. Padding positions of a padded batch are routed and counted too:
  they cost expert compute here as well.
- Applying a placement only swaps which weight copies sit in which slot, between two steps (on
  the engine thread, never during a forward). Requests keep their KV and their place in the
  batch; nothing is dropped or recomputed. On an accelerator fleet this is where the weight copy
  to the new slots (and an all-to-all dispatcher across devices) goes; in one process every
  "device" is a group of slots of one tensor, so the device loads are exact counts but the
  expert-parallel exchange itself is not exercised here; the multi-rank replica
  (``engine/wide_ep_*``) runs it, through training's EP dispatcher, with real weight moves.
- FP8-converted experts override ``GroupedExperts.linear``; the replicated dispatcher runs the
  plain grouped GEMM, so it refuses such layers rather than silently changing numerics.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from rayfleet.errors import SpecError
from rayfleet.models import MoETransformer
from rayfleet.models.moe import GroupedExperts, LocalDispatcher, grouped_linear
from rayfleet.serving.experts.eplb import ExpertPlacement, expert_demand, rebalance_experts, route_to_replicas

__all__ = ["ExpertBalancingConfig", "ExpertBalanceStats", "ReplicatedExpertDispatcher", "ExpertLoadBalancer",
           "check_placement"]


@dataclass(frozen=True)
class ExpertBalancingConfig:
    """Physical slots and the balancing cadence of one engine replica.

    ``num_redundant_experts`` extra slots per MoE layer (``P = E + redundant``, a multiple of
    ``num_devices``); windows are ``window_steps`` engine steps; ``rebalance_every_windows = 0``
    never re-places on its own (``ExpertLoadBalancer.rebalance`` still can).
    """

    num_devices: int
    num_redundant_experts: int = 0
    num_nodes: int = 1
    num_groups: int = 1
    policy: Literal["auto", "hierarchical", "global"] = "auto"
    window_steps: int = 16
    history_windows: int = 8
    percentile: float = 90.0
    rebalance_every_windows: int = 4

    def __post_init__(self) -> None:
        for name in ("num_devices", "window_steps", "history_windows"):
            if getattr(self, name) < 1:
                raise SpecError(f"expert_balancing.{name}", getattr(self, name), "must be positive",
                                f"pass {name} >= 1")
        if self.num_redundant_experts < 0 or self.rebalance_every_windows < 0:
            raise SpecError("expert_balancing.num_redundant_experts/rebalance_every_windows",
                            (self.num_redundant_experts, self.rebalance_every_windows),
                            "must be non-negative", "pass 0 to disable")


@dataclass(frozen=True)
class ExpertBalanceStats:
    """``device_balance``: max/mean tokens per device over the last closed window, per MoE layer,
    under the current placement; ``naive_balance``: the same load on the contiguous placement
    without replicas (``None`` when ``E`` does not split over the devices)."""

    num_steps: int
    num_windows: int
    num_updates: int
    device_balance: tuple[float, ...]
    naive_balance: tuple[float, ...] | None


def check_placement(placement: ExpertPlacement, *, num_layers: int, num_experts: int, num_devices: int) -> None:
    """Raise ``SpecError`` unless ``placement`` is consistent: ``[L, P]`` with ``P % D == 0``, every
    logical expert has >= 1 replica, and ``logical_to_physical`` inverts ``physical_to_logical``."""
    p2l, l2p, count = placement
    if p2l.dim() != 2 or p2l.shape[0] != num_layers or p2l.shape[1] % num_devices or p2l.shape[1] < num_experts:
        raise SpecError("placement", tuple(p2l.shape), f"must be [{num_layers}, P] with P >= {num_experts} "
                        f"and a multiple of num_devices={num_devices}", "compute it with eplb.rebalance_experts")
    if tuple(count.shape) != (num_layers, num_experts) or bool((count < 1).any()):
        raise SpecError("placement.logical_replica_count", count.tolist(), "every logical expert needs >= 1 "
                        "replica", "compute it with eplb.rebalance_experts")
    for layer in range(num_layers):
        held = torch.bincount(p2l[layer], minlength=num_experts)
        valid = l2p[layer] >= 0
        slots = l2p[layer][valid]
        experts = torch.arange(num_experts).unsqueeze(1).expand_as(l2p[layer])[valid]
        if (not torch.equal(held, count[layer]) or not torch.equal(valid.sum(1), count[layer])
                or not torch.equal(p2l[layer][slots], experts) or slots.unique().numel() != slots.numel()):
            raise SpecError("placement", f"layer {layer}", "logical_to_physical does not invert "
                            "physical_to_logical", "compute it with eplb.rebalance_experts")


class ReplicatedExpertDispatcher:
    """One MoE layer's dispatch over physical expert replicas (see module doc). Mutated by every
    forward (load counters) and by ``set_placement`` (weight copies)."""

    def __init__(self, experts: GroupedExperts, *, physical_to_logical: torch.Tensor,
                 logical_to_physical: torch.Tensor, logical_replica_count: torch.Tensor) -> None:
        self.experts = experts
        self.num_experts = experts.num_experts
        self.window_logical = torch.zeros(self.num_experts, dtype=torch.int64)
        self.set_placement(physical_to_logical, logical_to_physical, logical_replica_count)

    @torch.no_grad()
    def set_placement(self, physical_to_logical: torch.Tensor, logical_to_physical: torch.Tensor,
                      logical_replica_count: torch.Tensor) -> None:
        """Fill the physical slots with copies of their logical experts' weights (one layer)."""
        device = self.experts.w1.device
        self.physical_to_logical = physical_to_logical.to(torch.int64).cpu()
        self.logical_to_physical = logical_to_physical.to(torch.int64).cpu()
        self.logical_replica_count = logical_replica_count.to(torch.int64).cpu()
        index = self.physical_to_logical.to(device)
        self.w1, self.w2, self.w3 = (w.detach()[index].clone() for w in (self.experts.w1, self.experts.w2,
                                                                          self.experts.w3))
        self.window_physical = torch.zeros(self.physical_to_logical.numel(), dtype=torch.int64)

    @torch.no_grad()
    def run_experts(self, experts: GroupedExperts, x: torch.Tensor, topk_idx: torch.Tensor,
                    topk_weight: torch.Tensor, *, num_experts: int, capacity: int | None
                    ) -> tuple[torch.Tensor, int]:
        assert capacity is None and experts is self.experts, "installed by ExpertLoadBalancer only"
        top_k = topk_idx.shape[1]
        logical = topk_idx.reshape(-1)
        route = route_to_replicas(topk_idx.cpu(), self.logical_to_physical, self.logical_replica_count)
        physical = route.physical_idx.reshape(-1).to(x.device)
        self.window_logical += torch.bincount(logical.cpu(), minlength=num_experts)
        self.window_physical += route.physical_load
        # Expert GEMMs per physical slot, on that slot's weight copy.
        order = torch.argsort(physical, stable=True)
        sizes = torch.bincount(physical, minlength=self.w1.shape[0]).tolist()
        rows = x[order // top_k]
        hidden = F.silu(grouped_linear(rows, self.w1, sizes)) * grouped_linear(rows, self.w3, sizes)
        out_rows = grouped_linear(hidden, self.w2, sizes)
        # Combine in LocalDispatcher's (logical expert-sorted) order so that each token's k
        # contributions are summed in the same order as without replicas.
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        by_logical = torch.argsort(logical, stable=True)
        acc = torch.promote_types(out_rows.dtype, torch.float32)
        weighted = out_rows[position[by_logical]].to(acc) * topk_weight.reshape(-1)[by_logical].unsqueeze(-1).to(acc)
        out = torch.zeros(x.shape[0], out_rows.shape[-1], dtype=acc, device=x.device)
        return out.index_add_(0, by_logical // top_k, weighted).to(out_rows.dtype), int(logical.numel())

    def take_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ``[E]`` and physical ``[P]`` routed copies since the last call (reset)."""
        window = (self.window_logical, self.window_physical)
        self.window_logical = torch.zeros_like(self.window_logical)
        self.window_physical = torch.zeros_like(self.window_physical)
        return window


class ExpertLoadBalancer:
    """Installs replicated dispatch on every MoE layer of ``model`` and re-places experts from
    recent load (see module doc). Call ``after_step`` on the engine thread after each step."""

    def __init__(self, model: MoETransformer, config: ExpertBalancingConfig) -> None:
        self.model, self.config = model, config
        self.layers = model.moe_layers()
        if not self.layers:
            raise SpecError("expert_balancing", "enabled", "the model has no MoE layers", "disable expert_balancing")
        first = self.layers[0]
        self.num_experts = first.num_experts
        self.num_physical = self.num_experts + config.num_redundant_experts
        for layer in self.layers:
            if layer.capacity_factor is not None:
                raise SpecError("capacity_factor", layer.capacity_factor, "replicated expert dispatch is "
                                "dropless", "serve with capacity_factor=None")
            if type(layer.experts).linear is not GroupedExperts.linear:
                raise SpecError("expert_balancing", type(layer.experts).__name__, "experts with a converted "
                                "GEMM (FP8) would bypass the converter", "serve unconverted weights")
        # Before any load is seen: every expert equally hot (extra slots go in expert order).
        uniform = torch.ones(len(self.layers), self.num_experts)
        self.placement = self._place(uniform)
        self.dispatchers = []
        for i, layer in enumerate(self.layers):
            dispatcher = ReplicatedExpertDispatcher(layer.experts, physical_to_logical=self.placement[0][i],
                                                    logical_to_physical=self.placement[1][i],
                                                    logical_replica_count=self.placement[2][i])
            layer.dispatcher = dispatcher
            self.dispatchers.append(dispatcher)
        self.history: deque[torch.Tensor] = deque(maxlen=config.history_windows)
        self.last_physical: torch.Tensor | None = None
        self.num_steps = self.num_windows = self.num_updates = 0

    def _place(self, demand: torch.Tensor) -> ExpertPlacement:
        c = self.config
        return rebalance_experts(demand, num_physical_experts=self.num_physical, num_groups=c.num_groups,
                                 num_nodes=c.num_nodes, num_devices=c.num_devices, policy=c.policy)

    def after_step(self) -> None:
        """Count one engine step; close a window and re-place when due (engine thread)."""
        self.num_steps += 1
        if self.num_steps % self.config.window_steps:
            return
        self.close_window()
        every = self.config.rebalance_every_windows
        if every and self.num_windows % every == 0:
            self.rebalance()

    def close_window(self) -> torch.Tensor:
        """Move every layer's counts into the history; returns the window ``[L, E]``."""
        windows = [d.take_window() for d in self.dispatchers]
        logical = torch.stack([w[0] for w in windows])
        self.last_physical = torch.stack([w[1] for w in windows])
        self.history.append(logical)
        self.num_windows += 1
        return logical

    def rebalance(self) -> ExpertPlacement:
        """Place from the ``percentile`` of the recorded windows and apply (between steps)."""
        if not self.history:
            return self.placement
        demand = expert_demand(torch.stack(list(self.history)), percentile=self.config.percentile)
        placement = self._place(demand)
        self.apply(placement)
        return placement

    def apply(self, placement: ExpertPlacement) -> None:
        """Swap in ``placement`` (validated by ``check_placement``; raises ``SpecError``)."""
        check_placement(placement, num_layers=len(self.layers), num_experts=self.num_experts,
                        num_devices=self.config.num_devices)
        if placement[0].shape[1] != self.num_physical:
            raise SpecError("placement", tuple(placement[0].shape), f"has a different slot count than the "
                            f"{self.num_physical} configured", "keep num_redundant_experts fixed")
        for i, dispatcher in enumerate(self.dispatchers):
            dispatcher.set_placement(placement[0][i], placement[1][i], placement[2][i])
        self.placement = placement
        self.num_updates += 1

    def uninstall(self) -> None:
        """Back to the model's own local dispatch."""
        for layer in self.layers:
            layer.dispatcher = LocalDispatcher()

    def stats(self) -> ExpertBalanceStats:
        d = self.config.num_devices
        device_balance: tuple[float, ...] = ()
        naive: tuple[float, ...] | None = None
        if self.last_physical is not None and self.history:
            per_device = self.last_physical.view(len(self.layers), d, -1).sum(-1).double()
            device_balance = tuple((per_device.max(1).values / per_device.mean(1).clamp(min=1e-9)).tolist())
            if self.num_experts % d == 0:
                naive_load = self.history[-1].view(len(self.layers), d, -1).sum(-1).double()
                naive = tuple((naive_load.max(1).values / naive_load.mean(1).clamp(min=1e-9)).tolist())
        return ExpertBalanceStats(self.num_steps, self.num_windows, self.num_updates, device_balance, naive)
