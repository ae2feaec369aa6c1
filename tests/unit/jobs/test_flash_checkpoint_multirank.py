"""FlashCheckpointer across real ranks (gloo, FSDP2, no Ray): background persists run on their own
process group while training collectives run; a restart at 2 ranks resumes from shared memory,
a restart at 1 rank resumes from storage (resharded). Ranks are processes running this file."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
GLOBAL_BATCH = 8


def _worker(mode: str, work_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rayfleet.jobs.checkpoint.flash import CheckpointState, FlashCheckpointer
    from rayfleet.jobs.local_processes import leave_after_barrier
    from rayfleet.platform.snapshot import SnapshotStore

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(12, 29), torch.nn.Tanh(), torch.nn.Linear(29, 3))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step_fn(model, optim, step: int) -> float:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
        per_rank = GLOBAL_BATCH // world
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world

    def checkpointer(job_rank_dir: str):
        store = SnapshotStore(os.path.join(work_dir, "shm"), job=job_rank_dir, rank=rank)
        return FlashCheckpointer(snapshot_every=2, persist_every=2, store=store,
                                 checkpoint_uri=os.path.join(work_dir, "ckpt"), keep=2)

    def state(model, optim, step):
        msd, osd = get_state_dict(model, optim)
        return CheckpointState(sharded={"model": msd, "optim": osd}, rank_local={"next_step": step + 1})

    out = {}
    if mode == "train":
        model, optim = build(0)
        out["reference"] = [step_fn(model, optim, s) for s in range(1, 9)]
        model, optim = build(0)
        ckpt = checkpointer("job")
        for s in range(1, 7):
            step_fn(model, optim, s)
            ckpt.after_step(s, lambda s=s: state(model, optim, s))
        ckpt.close()  # dies after step 6 without a flush
        out["persisted"] = ckpt.stats.persisted_steps
    else:
        model, optim = build(1234)
        msd, osd = get_state_dict(model, optim)
        result = checkpointer("job" if mode == "resume_shm" else "job-new-node").restore(
            CheckpointState(sharded={"model": msd, "optim": osd}))
        set_state_dict(model, optim, model_state_dict=result.sharded["model"], optim_state_dict=result.sharded["optim"])
        next_step = (result.rank_local or result.rank_local_by_rank[0])["next_step"]
        out.update(source=result.source, step=result.step,
                   losses={s: step_fn(model, optim, s) for s in range(next_step, 9)})
    if rank == 0:
        Path(work_dir, f"{mode}.json").write_text(json.dumps(out))
    leave_after_barrier()


def _launch(mode: str, world: int, work_dir: str) -> dict:
    from rayfleet.jobs.local_processes import run_script_ranks

    run_script_ranks(str(HERE), [mode, work_dir], world)
    return json.loads(Path(work_dir, f"{mode}.json").read_text())


@pytest.mark.timeout(600)
def test_two_rank_snapshot_persist_and_restore_from_shm_and_from_storage_at_one_rank(tmp_path):
    work_dir = f"/dev/shm/rayfleet-test-mr-{os.getpid()}-{tmp_path.name}" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    os.makedirs(work_dir, exist_ok=True)
    try:
        train = _launch("train", 2, work_dir)
        assert train["persisted"] == [4]
        reference = train["reference"]

        shm = _launch("resume_shm", 2, work_dir)
        assert (shm["source"], shm["step"]) == ("shm", 6)
        assert [shm["losses"][str(s)] for s in (7, 8)] == pytest.approx(reference[6:8], rel=1e-6, abs=1e-7)

        storage = _launch("resume_storage", 1, work_dir)  # a node was lost: one rank, no snapshot
        assert (storage["source"], storage["step"]) == ("storage", 4)
        assert [storage["losses"][str(s)] for s in range(5, 9)] == pytest.approx(reference[4:8], rel=1e-5)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
