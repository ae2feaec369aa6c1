"""Restoring a flash checkpoint from node-local shared memory, and what a restore returns.

Design decisions (see :mod:`rayfleet.jobs.checkpoint.flash` for the whole scheme):
- Restore is collective: ranks all-gather the steps they hold in shared memory and try the
  common ones newest first; a step is taken only when every rank verified its snapshot (CRC) and
  found the layout of its template (a MIN all-reduce of a success flag). Otherwise the caller
  falls back to storage, so the group never resumes from a mix of steps.
- A snapshot is copied *into* the template's tensors in place (same tree, same local shapes:
  what a same-size restart has); a differing layout trusts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from rayfleet.platform.snapshot import SnapshotStore

__all__ = ["CheckpointState", "RestoreResult", "restore_from_shm"]


@dataclass(frozen=True)
class CheckpointState:
    """What a rank checkpoints. ``sharded``: nested dict of DTensors/tensors/objects (model and
    optimizer state dicts, reshardable); ``rank_local``: this rank's small state (data position,
    RNG states, step), restored as is (see ``RestoreResult.rank_local``)."""

    sharded: Mapping[str, Any]
    rank_local: Mapping[str, Any] = field(default_factory=dict)



@dataclass(frozen=True)
class RestoreResult:
    """Where a restore came from (``"shm"``, ``"storage"`` or ``"none"``) and at which step.

    ``sharded`` is the template tree with its tensors filled in place and non-tensor leaves
    replaced by the saved values: use it (e.g. ``set_state_dict``). ``rank_local`` is this rank's
    saved dict (None after a resize, then see ``rank_local_by_rank``). ``reason`` says why
    shared memory was not used when it was not.
    """

    source: Literal["shm", "storage", "none"]
    step: int | None
    sharded: Any
    rank_local: dict | None
    rank_local_by_rank: Mapping[int, dict]
    reason: str



def _copy_snapshot_into(snap, template_sharded: Any) -> Any | None:
    """Copy a snapshot's tensors into the template's (local) tensors in place; return the tree with
    restored non-tensor leaves, or None when the layout differs (nothing is trusted then)."""
    leaves, spec = pytree.tree_flatten(dict(template_sharded))
    if str(spec) != snap.objects.get("treespec"):
        return None
    objects = snap.objects["objects"]
    targets = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            src = snap.tensors.get(str(i))
            dst = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            if src is None or src.shape != dst.shape or src.dtype != dst.dtype:
                return None
            targets.append((dst, src))
        elif i not in objects:
            return None
    with torch.no_grad():
        for dst, src in targets:
            dst.copy_(src)
    restored = [objects[i] if not isinstance(leaf, torch.Tensor) else leaf for i, leaf in enumerate(leaves)]
    return pytree.tree_unflatten(restored, spec)


def _all_ok(ok: bool, group, world_size: int) -> bool:
    if world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def restore_from_shm(store: SnapshotStore | None, template: CheckpointState, at_most_step: int | None, *,
                     group: dist.ProcessGroup | None, world_size: int) -> tuple[RestoreResult | None, str]:
    """Try the newest snapshot step held by every rank (collective over ``group``).
    Returns (result or None, why shared memory was not used)."""
    local_steps = [info.step for info in store.committed()
                   if at_most_step is None or info.step <= at_most_step] if store is not None else []
    if world_size > 1:
        gathered: list[list[int]] = [None] * world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, local_steps, group=group)
    else:
        gathered = [local_steps]
    common = sorted(set.intersection(*(set(steps) for steps in gathered)), reverse=True)
    if not common:
        missing = [r for r, steps in enumerate(gathered) if not steps]
        return None, (f"shm: ranks {missing} hold no snapshot" if missing else "shm: no step held by every rank")
    for step in common:
        snap = store.restore(step=step, verify=True)
        tree = _copy_snapshot_into(snap, template.sharded) if snap is not None else None
        if _all_ok(tree is not None, group, world_size):
            rank_local = dict(snap.objects["rank_local"])
            return RestoreResult("shm", step, tree, rank_local, {}, "shm: newest step valid on every rank"), ""
    return None, f"shm: steps {common} failed verification or layout on some rank"
