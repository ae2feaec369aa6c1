"""Flash checkpoints from device memory: a snapshot of a model and optimizer living on the GPU,
written by the train loop's ``FlashCheckpointer`` into node shared memory, restored by a fresh
checkpointer (a restarted process) into CPU tensors bit for bit; and the seconds per GiB that
the train step blocks for, cold (first snapshot: tmpfs pages are touched) and warm (reused slots).

The snapshot root is a private folder in ``/dev/shm`` when it has room for two slots of the
state (the platform's default root is there), else a temporary folder on disk, named in the
result: a write past tmpfs's size would kill the process with SIGBUS.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import torch
import torch.nn.functional as F

from rayfleet.jobs.checkpoint.flash import FlashCheckpointer
from rayfleet.jobs.checkpoint.restore import CheckpointState
from rayfleet.jobs.train_state import capture_rng
from rayfleet.models import build_model, preset
from rayfleet.platform.snapshot import SnapshotStore


def _bytes(tree) -> int:
    import torch.utils._pytree as pytree

    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _root(needed: int) -> tuple[str, str]:
    try:
        if shutil.disk_usage("/dev/shm").free > 3 * needed:
            return tempfile.mkdtemp(prefix="rayfleet-gpu-check-", dir="/dev/shm"), "/dev/shm (tmpfs)"
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="rayfleet-gpu-check-"), "a temporary folder on disk (/dev/shm too small)"


def run(ctx) -> None:
    name = "tiny" if ctx.quick else "small"
    model = build_model(preset(name), device=ctx.device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 65), device=ctx.device,
                           generator=torch.Generator(device=ctx.device).manual_seed(0))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()  # Adam's moments exist now: the optimizer state is on the device too
    sharded = {"model": model.state_dict(), "optim": opt.state_dict()}
    state = CheckpointState(sharded=sharded, rank_local={"step": 1, "rng": capture_rng(ctx.device)})
    num_bytes = _bytes(sharded)
    root, where = _root(num_bytes)
    try:
        ckpt = FlashCheckpointer(snapshot_every=1, persist_every=1, store=SnapshotStore(root, job="gpu-check", rank=0),
                                 checkpoint_uri=None)
        cold = ckpt.after_step(1, lambda: state)
        ckpt.wait_committed()
        warm_events = []
        for step in (2, 3, 4):
            warm_events.append(ckpt.after_step(step, lambda: state))
            ckpt.wait_committed()
        ckpt.close()
        gib = num_bytes / 2**30
        warm = sorted(e.blocking_s for e in warm_events)[1]
        ctx.record("blocking_s_per_gib", None,
                   f"{name} model + AdamW state, {gib:.3f} GiB from {ctx.device} into {where}: cold "
                   f"{cold.blocking_s / gib:.3f} s/GiB, warm {warm / gib:.3f} s/GiB",
                   gib=gib, cold_s=cold.blocking_s, warm_s=warm, cold_s_per_gib=cold.blocking_s / gib,
                   warm_s_per_gib=warm / gib, root=where)
        # a fresh checkpointer over the same files (a restarted process), restoring into CPU tensors
        template = CheckpointState(sharded=_cpu_zeros(sharded))
        restored = FlashCheckpointer(snapshot_every=1, persist_every=1,
                                     store=SnapshotStore(root, job="gpu-check", rank=0), checkpoint_uri=None)
        result = restored.restore(template)
        restored.close()
        mismatched = _mismatches(sharded, result.sharded)
        ctx.record("snapshot_restores_on_cpu_bit_exact", result.source == "shm" and result.step == 4 and not mismatched,
                   f"restored from {result.source} at step {result.step} ({result.reason}): {len(mismatched)} tensors differ"
                   + (f" (first: {mismatched[:3]})" if mismatched else ""),
                   tensors=_count(sharded), mismatched=len(mismatched), source=result.source)
        _bandwidth(ctx, root, where)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _cpu_zeros(tree):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: torch.zeros_like(t, device="cpu") if isinstance(t, torch.Tensor) else t, tree)


def _count(tree) -> int:
    import torch.utils._pytree as pytree

    return sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(tree))


def _mismatches(original, restored) -> list[str]:
    import torch.utils._pytree as pytree

    a, spec_a = pytree.tree_flatten(original)
    b, spec_b = pytree.tree_flatten(restored)
    if spec_a != spec_b:
        return ["<tree structure>"]
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            same = (y.device.type == "cpu" and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.detach().cpu().reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        else:
            same = x == y
        if not same:
            out.append(str(i))
    return out


def _bandwidth(ctx, root: str, where: str) -> None:
    """Blocking seconds per GiB for a 2 GiB state (1 GiB on CPU): one figure independent of the model."""
    gib = 0.0625 if ctx.quick else 2.0
    if shutil.disk_usage(root).free < 3 * gib * 2**30:
        ctx.skip("blocking_s_per_gib_large", f"{where} has under {3 * gib:.1f} GiB free")
        return
    tensors = {f"t{i}": torch.ones(int(gib * 2**30) // 8 // 4, dtype=torch.float32, device=ctx.device) for i in range(8)}
    store = SnapshotStore(root, job="gpu-check-large", rank=0)
    times = []
    for step in range(3):
        t0 = time.perf_counter()
        pending = store.write(step, tensors)
        times.append(time.perf_counter() - t0)
        store.commit(pending)
    store.destroy()
    ctx.record("blocking_s_per_gib_large", None,
               f"{gib:g} GiB in 8 tensors from {ctx.device} into {where}: cold {times[0] / gib:.3f} s/GiB, "
               f"warm {min(times[1:]) / gib:.3f} s/GiB", gib=gib, cold_s_per_gib=times[0] / gib,
               warm_s_per_gib=min(times[1:]) / gib, root=where)
