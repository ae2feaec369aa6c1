"""Save an FSDP2-sharded model + AdamW state at 4 ranks, load it at 2 and at 3 ranks (gloo, no Ray).

The ranks are real processes started with this file as a script (pytest's importlib import mode
makes test modules unimportable in spawned children). Layer sizes are prime so that every world
size shards them unevenly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


def _flatten(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out.update(_flatten(value, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = tree
    return out


def _full(tree):
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in _flatten(tree).items():
        if isinstance(value, DTensor):
            out[key] = value.full_tensor().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()
    return out


def _worker(mode: str, ckpt_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rayfleet.jobs.local_processes import leave_after_barrier
    from rayfleet.storage.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0 if mode == "save" else 1234)
    model = torch.nn.Sequential(torch.nn.Linear(11, 13), torch.nn.ReLU(), torch.nn.Linear(13, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "save":
        g = torch.Generator().manual_seed(7)
        x = torch.randn(8, 11, generator=g)
        model(x).square().mean().backward()
        optim.step()
        model_sd, optim_sd = get_state_dict(model, optim)
        save_checkpoint(ckpt_dir, step=3, sharded={"model": model_sd, "optim": optim_sd},
                        rank_local={"data_position": 100 + rank})
        full = _full({"model": model_sd, "optim": optim_sd})
        if rank == 0:
            torch.save(full, os.path.join(ckpt_dir, "reference.pt"))
    else:
        model_sd, optim_sd = get_state_dict(model, optim)  # initializes AdamW state to load into
        template = {"model": model_sd, "optim": optim_sd}
        reference = torch.load(os.path.join(ckpt_dir, "reference.pt"))
        before = _full(template)
        # The fresh model differs from the saved one: equality below cannot come from luck.
        assert not torch.equal(before["model.0.weight"], reference["model.0.weight"])
        loaded = load_checkpoint(ckpt_dir, sharded=template)
        set_state_dict(model, optim, model_state_dict=template["model"], optim_state_dict=template["optim"])
        model_sd, optim_sd = get_state_dict(model, optim)
        after = _full({"model": model_sd, "optim": optim_sd})
        assert sorted(after) == sorted(reference), (sorted(after), sorted(reference))
        for key, value in reference.items():
            assert torch.equal(after[key], value), f"rank {rank}: {key} differs after resharding"
        assert loaded.info.step == 3 and loaded.info.world_size == 4
        assert loaded.rank_local is None  # saved at 4 ranks: no per-rank state maps to this rank
        # Only rank 0's file and this rank's own (if it existed at 4 ranks) are read.
        assert {r: d["data_position"] for r, d in loaded.rank_local_by_rank.items()} == (
            {0: 100} if rank == 0 else {0: 100, rank: 100 + rank})
        assert latest_checkpoint(ckpt_dir).step == 3
    leave_after_barrier()


def _launch(mode: str, world: int, ckpt_dir: Path) -> None:
    from rayfleet.jobs.local_processes import run_script_ranks

    run_script_ranks(str(HERE), [mode, str(ckpt_dir)], world)


@pytest.mark.timeout(600)
def test_save_at_4_ranks_load_at_2_and_3_gives_identical_full_tensors(tmp_path):
    _launch("save", 4, tmp_path)
    assert (tmp_path / "step_00000003" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "step_00000003").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]
    _launch("load", 2, tmp_path)
    _launch("load", 3, tmp_path)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
