"""How unevenly an MoE layer's routed token copies land on the EP ranks: the load factor that
the busiest rank's expert GEMMs, permutes and all-to-all receive run at.

Design decisions:
- The busiest *rank* sets the layer's time, not the busiest expert: a rank runs its local
  experts as one grouped GEMM (work = the sum of their loads), and every EP rank waits for the
  slowest in the combine all-to-all. With one expert per rank the two are the same.
- The factor is ``E[max over ep ranks of the rank's load] / mean``, a rank's load taken as
  normal: ``1 + z(ep) x sqrt(sampling + skew)`` with ``z(ep)`` the expected maximum of ``ep``
  standard normals. ``sampling`` is the multinomial noise of ``mu`` routed copies per rank,
  ``(1 - 1/ep) / mu`` (under 1% at thousands of tokens per rank: forced balance, Megatron's
  random router logits, is balanced for every plan we price). ``skew`` is what a learned router
  adds: per-expert loads with relative spread ``cv`` (:attr:`CostParams.dropless_expert_load_cv`,
  measured, not fitted) summed over ``L = num_experts / ep`` local experts out of a fixed total,
  ``cv^2 (1 - 1/ep) / L`` -- so many small local experts average the skew out and EP64 with four
  local experts does not.
- Token dropping caps each expert at ``capacity_factor x`` its balanced share; Megatron pads
  every expert's input to that capacity (``moe_pad_expert_input_to_capacity``, Megatron-Bridge's
  token-drop default), so the rank's work is exactly ``capacity_factor x`` the balanced load,
  whatever the router did. Without padding it would be ``min(dropless factor, capacity_factor)``:
  rejected because no published run here drops without padding.
- Rejected: a per-run "MoE efficiency" constant. The factor follows from the routing mode the
  run states, the plan (ep, local experts) and the tokens per rank; the one measured input
  (``cv``) comes from runs that differ only in their routing (docs/planner-calibration.md).

Units: dimensionless factors (>= 1 for dropless and forced balance).
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

__all__ = ["ROUTING_MODES", "expected_max_of_normals", "expert_load_factor"]

# How a run's router placed tokens: forced_balance (random logits: even in expectation),
# token_drop (capacity-capped, padded to capacity), dropless (every token routed as the router chose).
ROUTING_MODES: tuple[str, ...] = ("forced_balance", "token_drop", "dropless")


@lru_cache(maxsize=256)
def expected_max_of_normals(n: int) -> float:
    """``E[max]`` of ``n`` independent standard normals, ``integral x n phi(x) Phi(x)^(n-1) dx``
    by the midpoint rule on [-8, 8] (4,000 steps); 0 for ``n <= 1``. Worked values (tables of
    normal order statistics): n=2 -> 0.5642, n=8 -> 1.4236, n=64 -> 2.3437."""
    if n <= 1:
        return 0.0
    unit, steps = NormalDist(), 4000
    dx = 16.0 / steps
    xs = (-8.0 + (i + 0.5) * dx for i in range(steps))
    return sum(x * n * unit.pdf(x) * unit.cdf(x) ** (n - 1) * dx for x in xs)


def expert_load_factor(*, routing: str, num_experts: int, ep: int, copies_per_rank: float,
                       capacity_factor: float = 1.0, dropless_load_cv: float = 0.0) -> float:
    """The busiest EP rank's routed copies over the mean rank's, for one MoE layer and micro-batch.

    Args:
        routing: one of :data:`ROUTING_MODES`.
        num_experts: routed experts of the layer; ``ep`` ranks hold ``num_experts / ep`` each.
        copies_per_rank: mean routed token copies a rank's experts receive (tokens x top_k of
            one rank's micro-batch shard: what the rank dispatches equals what it receives).
        capacity_factor: token_drop's cap on an expert's load, as a multiple of its balanced share.
        dropless_load_cv: relative spread of per-expert loads under a learned router (dropless only).
    """
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing {routing!r} is not one of {ROUTING_MODES}")
    if routing == "token_drop":
        return capacity_factor
    if ep <= 1 or copies_per_rank <= 0:
        return 1.0  # every expert on the rank: the total is fixed, nothing to wait for
    sampling = (1 - 1 / ep) / copies_per_rank
    skew = dropless_load_cv ** 2 * (1 - 1 / ep) / (num_experts / ep) if routing == "dropless" else 0.0
    return 1.0 + expected_max_of_normals(ep) * math.sqrt(sampling + skew)
