"""What the shared autoscaler lends to a pool and takes back: one replica, or one whole gang (pure).

A vLLM pool with ``data_parallel_size: N`` > 1 serves with gangs of N DP ranks; each rank is one
Serve replica, the gang one placement group, and a gang missing a rank serves nothing (its ranks
wait for each other; Serve restarts the gang whole). So the Serve shell reports such a pool to
the policy in gangs: a *replica* of the ``ServeObservation`` is one gang, its
``accelerators_per_replica`` the gang's accelerators. The policy then frees a whole gang's
accelerators on one node per lend and removes whole gangs when it reclaims, without knowing
about DP at all; this module converts between gangs and what Serve counts (its replicas, the
bounds ``pool_scaling`` keeps). With N = 1 a unit is a plain replica and nothing changes.

Worked example (``data_parallel_size: 4``, 1 accelerator per rank): a lend of 10 free
accelerators makes room for ``10 // 4 = 2`` gangs; 2 gangs are 8 Serve replicas; 7 running
ranks are 1 whole gang (the other is still starting); reclaiming 1 of 2 gangs lowers Serve's
bounds from 8 to 4 replicas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["LendUnit"]


@dataclass(frozen=True)
class LendUnit:
    """One unit of a pool: ``ranks`` Serve replicas holding ``accelerators`` accelerators together.

    >>> unit = LendUnit(ranks=4, accelerators=4)
    >>> unit.units_in(10), unit.serve_replicas(2), unit.whole_units(7)
    (2, 8, 1)
    """

    ranks: int = 1  # Serve replicas (DP ranks) per unit
    accelerators: int = 1  # accelerators per unit, all ranks together (at least 1: what the policy lends)

    def __post_init__(self) -> None:
        assert self.ranks >= 1 and self.accelerators >= 1, self

    @classmethod
    def of_pool(cls, *, data_parallel_size: int, accelerators_per_replica: int) -> "LendUnit":
        """The unit of a pool: its replica (a gang when ``data_parallel_size`` > 1); a pool that
        reserves no accelerator still counts one per unit (the catalogue resource it runs beside)."""
        return cls(ranks=data_parallel_size, accelerators=max(1, accelerators_per_replica))

    def units_in(self, num_accelerators: int) -> int:
        """Whole units ``num_accelerators`` free accelerators hold (a partial gang cannot serve)."""
        return max(0, num_accelerators) // self.accelerators

    def serve_replicas(self, units: int) -> int:
        """Serve replicas (the bounds ``pool_scaling`` keeps) of ``units`` units."""
        return units * self.ranks

    def whole_units(self, serve_replicas: int) -> int:
        """Units that ``serve_replicas`` running Serve replicas make up (ranks of a gang still
        starting, or of one being torn down, serve nothing yet)."""
        return max(0, serve_replicas) // self.ranks

    def unit_nodes(self, rank_nodes_by_group: Mapping[str, Sequence[str]]) -> list[str]:
        """One node per complete unit, sorted: the node most of its ranks run on (ties: the
        first by name). ``rank_nodes_by_group``: placement group -> nodes of its running ranks
        (for ``ranks == 1``, any per-replica key)."""
        out = []
        for nodes in rank_nodes_by_group.values():
            if len(nodes) < self.ranks:
                continue
            counts = Counter(nodes)
            out.append(min(counts, key=lambda n: (-counts[n], n)))
        return sorted(out)
