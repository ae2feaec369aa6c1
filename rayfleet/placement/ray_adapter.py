"""Ray adapter: turn a layout into placement groups that put every rank where the layout says.

Design decisions:
- One bundle per rank: ``{<accelerator resource>: 1, "rayfleet_slot_<i>": 1}`` with the bundle
  label selector ``{"rayfleet.io/node": <node>}``. The node label pins the node; the per-slot
  resource (declared once per accelerator index by every rayfleet node) pins the rail, which a
  plain ``GPU: 1`` cannot: Ray hands out whichever GPU id is free.
- Ray gives GPU ids in bundle order (lowest free id), so ``CUDA_VISIBLE_DEVICES`` need not equal
  the layout's index on a partly used node; the ``rayfleet_slot_<i>`` resource a worker holds
  (:func:`assigned_slot_index`) is the index to trust. Bundles are ordered by (node, index) so
  the two agree on an idle node.
- Grouping: one placement group for the whole layout (gang: all or nothing), or one per DP
  replica (``group_by="dp_replica"``) so elastic training can hand back whole replicas, or one
  per node (STRICT_PACK). Multi-node groups use ``PACK``: the selectors already decide nodes.
- Ray leaves an infeasible group PENDING forever; :func:`reserve_layout` waits with a deadline,
  removes what it created, and raises :class:`PlacementTimeoutError` saying which bundles cannot
  be satisfied and why (no such node label, or the slot is taken).
- Pure translation (:func:`placement_group_specs`) is separate from the Ray calls, so unit tests
  check bundles without a cluster; Ray is imported only inside the functions that call it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from rayfleet.errors import RayfleetError
from rayfleet.placement.layout import Layout
from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import get_accelerator

__all__ = ["PlacementGroupSpec", "PlacementTimeoutError", "ReservedLayout", "placement_group_specs",
           "reserve_layout", "serve_replica_options", "train_label_selectors", "assigned_slot_index"]

GroupBy = Literal["world", "dp_replica", "node"]


class PlacementTimeoutError(RayfleetError):
    """Placement groups for a layout were not created before the deadline."""


@dataclass(frozen=True)
class PlacementGroupSpec:
    """Arguments of one ``ray.util.placement_group`` call, plus which rank each bundle hosts."""

    name: str
    bundles: tuple[dict[str, float], ...]
    bundle_label_selector: tuple[dict[str, str], ...]
    strategy: str
    ranks: tuple[int, ...]


def _bundle(layout: Layout, rank: int, cpus_per_bundle: float) -> tuple[dict[str, float], dict[str, str]]:
    slot = layout.slot(rank)
    resource = get_accelerator(layout.rank_to_accelerator[rank]).ray_resource
    bundle = {resource: 1.0, L.slot_resource(slot.index): 1.0}
    if cpus_per_bundle:
        bundle["CPU"] = float(cpus_per_bundle)
    return bundle, {L.NODE: slot.node}


def placement_group_specs(layout: Layout, *, group_by: GroupBy = "world", name_prefix: str = "rayfleet",
                          cpus_per_bundle: float = 0.0) -> tuple[PlacementGroupSpec, ...]:
    """The placement groups that encode ``layout`` (pure; no Ray needed)."""
    plan = layout.plan
    members: dict[Any, list[int]] = defaultdict(list)
    for rank in range(layout.world_size):
        key = {"world": 0, "dp_replica": plan.coords(rank).dp, "node": layout.slot(rank).node}[group_by]
        members[key].append(rank)
    node_order = {n: i for i, n in enumerate(layout.nodes())}
    specs = []
    for key, ranks in members.items():
        ranks = sorted(ranks, key=lambda r: (node_order[layout.slot(r).node], layout.slot(r).index))
        pairs = [_bundle(layout, r, cpus_per_bundle) for r in ranks]
        suffix = "" if group_by == "world" else f"-{group_by}-{key}"
        specs.append(PlacementGroupSpec(
            name=f"{name_prefix}{suffix}", bundles=tuple(b for b, _ in pairs),
            bundle_label_selector=tuple(s for _, s in pairs),
            strategy="STRICT_PACK" if group_by == "node" else "PACK", ranks=tuple(ranks)))
    return tuple(specs)


def train_label_selectors(layout: Layout) -> list[dict[str, str]]:
    """One node selector per rank, for Ray Train's ``ScalingConfig(label_selector=[...])``.

    Train workers get nodes this way but not rails; use :func:`reserve_layout` when the rail
    matters and start workers in the reserved bundles.
    """
    return [{L.NODE: layout.slot(r).node} for r in range(layout.world_size)]


def serve_replica_options(layout: Layout, ranks: list[int] | None = None, *, cpus_per_bundle: float = 0.0
                          ) -> dict[str, Any]:
    """``@serve.deployment`` options that reserve ``ranks`` (default all) as one replica's bundles."""
    ranks = list(range(layout.world_size)) if ranks is None else list(ranks)
    pairs = [_bundle(layout, r, cpus_per_bundle) for r in ranks]
    return {"placement_group_bundles": [b for b, _ in pairs],
            "placement_group_bundle_label_selector": [s for _, s in pairs],
            "placement_group_strategy": "PACK"}


@dataclass
class ReservedLayout:
    """Live placement groups for a layout. ``release()`` removes them (kill actors in them first)."""

    layout: Layout
    specs: tuple[PlacementGroupSpec, ...]
    placement_groups: tuple[Any, ...]
    _where: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for g, spec in enumerate(self.specs):
            for i, rank in enumerate(spec.ranks):
                self._where[rank] = (g, i)

    def bundle_of(self, rank: int) -> tuple[Any, int]:
        """(placement group, bundle index) hosting ``rank``."""
        g, i = self._where[rank]
        return self.placement_groups[g], i

    def scheduling_strategy(self, rank: int):
        """A ``PlacementGroupSchedulingStrategy`` that starts a task/actor in ``rank``'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, index = self.bundle_of(rank)
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)

    def actor_options(self, rank: int, *, num_cpus: float = 0.0) -> dict[str, Any]:
        """``.options(**...)`` for the actor/task of ``rank``: its bundle, one accelerator and its
        slot resource (a worker holds a bundle's resource only if it asks for it)."""
        spec_bundle = self.specs[self._where[rank][0]].bundles[self._where[rank][1]]
        resources = {k: v for k, v in spec_bundle.items() if k not in ("CPU", "GPU")}
        options: dict[str, Any] = {"scheduling_strategy": self.scheduling_strategy(rank), "num_cpus": num_cpus,
                                   "resources": resources}
        if "GPU" in spec_bundle:
            options["num_gpus"] = spec_bundle["GPU"]
        return options

    def release(self) -> None:
        from ray.util import remove_placement_group

        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = ()


def _diagnose(spec: PlacementGroupSpec) -> str:
    """Why bundles of ``spec`` may not fit: missing node labels or resources already taken."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    by_label = {n.get("Labels", {}).get(L.NODE): n for n in alive}
    available = ray.available_resources() if alive else {}
    problems = []
    for bundle, selector in zip(spec.bundles, spec.bundle_label_selector):
        node = by_label.get(selector[L.NODE])
        if node is None:
            problems.append(f"no alive node labelled {L.NODE}={selector[L.NODE]}")
            continue
        missing = [k for k in bundle if node.get("Resources", {}).get(k, 0) < bundle[k]]
        if missing:
            problems.append(f"node {selector[L.NODE]} does not declare {missing}")
    if not problems:
        problems.append("resources exist but are held by other work "
                        f"(cluster-wide free: { {k: v for k, v in available.items() if k.startswith('rayfleet_slot')} })")
    return "; ".join(sorted(set(problems))[:5])


def reserve_layout(layout: Layout, *, timeout_s: float = 60.0, group_by: GroupBy = "world",
                   name_prefix: str = "rayfleet", cpus_per_bundle: float = 0.0,
                   lifetime: str | None = None) -> ReservedLayout:
    """Create the layout's placement groups on the connected Ray cluster and wait for them.

    Raises:
        PlacementTimeoutError: not all groups were ready within ``timeout_s``; the groups this
            call created are removed first.
    """
    import ray
    from ray.util import placement_group, remove_placement_group

    specs = placement_group_specs(layout, group_by=group_by, name_prefix=name_prefix, cpus_per_bundle=cpus_per_bundle)
    groups = [placement_group(list(s.bundles), strategy=s.strategy, name=s.name, lifetime=lifetime,
                              bundle_label_selector=list(s.bundle_label_selector)) for s in specs]
    ready = [g.ready() for g in groups]
    done, _ = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
    if len(done) < len(ready):
        pending = [s for s, r in zip(specs, ready) if r not in done]
        reasons = _diagnose(pending[0])
        for g in groups:
            remove_placement_group(g)
        raise PlacementTimeoutError(
            f"{len(pending)} of {len(specs)} placement group(s) for a {layout.world_size}-rank layout were not "
            f"ready after {timeout_s:.0f} s (first: {pending[0].name!r}): {reasons}. Fix: free those "
            "accelerators, uncordon/restore the nodes, or re-plan on the current fleet")
    return ReservedLayout(layout=layout, specs=specs, placement_groups=tuple(groups))


def assigned_slot_index() -> int | None:
    """Inside a Ray worker: the accelerator index (rail) of the ``rayfleet_slot_<i>`` it holds."""
    import ray

    for name, amount in ray.get_runtime_context().get_assigned_resources().items():
        index = L.slot_index(name)
        if index is not None and amount > 0:
            return index
    return None
