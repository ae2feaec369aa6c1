"""Checkpoint store: commit protocol, latest/verify/retention, errors (single process; see
test_checkpoint_reshard.py for multi-rank save/load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.storage.checkpoint import (
    apply_retention, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
    verify_checkpoint,
)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"step": torch.tensor(float(seed)), "lr": 0.1 * seed}}


def _template() -> dict:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
            "optim": {"step": torch.tensor(0.0), "lr": 0.0}}


@pytest.mark.parametrize("uri_kind", ["local", "memory"])
def test_round_trip_with_rank_local_state(tmp_path, uri_kind):
    uri = str(tmp_path / "ck") if uri_kind == "local" else f"memory://rt-{os.getpid()}"
    state = _state(3)
    rng = torch.get_rng_state()
    info = save_checkpoint(uri, step=12, sharded=state, rank_local={"data_position": [4, 96], "rng": rng})
    assert info.step == 12 and info.world_size == 1 and info.num_bytes > 64 * 32 * 4
    template = _template()
    loaded = load_checkpoint(uri, sharded=template, verify_checksums=True)
    assert torch.equal(template["model"]["w"], state["model"]["w"])
    assert torch.equal(template["optim"]["step"], state["optim"]["step"])
    assert template["optim"]["lr"] == pytest.approx(0.3)
    assert loaded.rank_local["data_position"] == [4, 96]
    assert torch.equal(loaded.rank_local["rng"], rng)


def test_step_without_manifest_is_never_latest(tmp_path):
    uri = str(tmp_path)
    save_checkpoint(uri, step=1, sharded=_state(1))
    save_checkpoint(uri, step=2, sharded=_state(2))
    os.remove(tmp_path / "step_00000002" / "manifest.json")  # as if killed before the commit
    assert latest_checkpoint(uri).step == 1
    assert verify_checkpoint(uri, step=1).ok
    assert not verify_checkpoint(uri, step=2).ok
    template = _template()
    load_checkpoint(uri, sharded=template)
    assert torch.equal(template["model"]["w"], _state(1)["model"]["w"])
    # Retention must not delete a newer uncommitted step (it may be a save in progress).
    assert apply_retention(uri, keep=1) == []
    assert (tmp_path / "step_00000002").exists()


def test_truncated_manifest_or_missing_file_is_not_committed(tmp_path):
    uri = str(tmp_path)
    save_checkpoint(uri, step=1, sharded=_state(1))
    save_checkpoint(uri, step=2, sharded=_state(2))
    save_checkpoint(uri, step=3, sharded=_state(3))
    manifest = tmp_path / "step_00000003" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    os.remove(tmp_path / "step_00000002" / "__0_0.distcp")
    assert [c.step for c in list_checkpoints(uri)] == [1]


def test_persist_killed_before_commit_leaves_previous_checkpoint_latest(tmp_path):
    # A real process dies (os._exit) after writing all data of step 2 and before its manifest.
    script = textwrap.dedent(f"""
        import os, torch
        import rayfleet.storage.checkpoint as ck
        state = {{"w": torch.arange(4096.0)}}
        ck.save_checkpoint({str(tmp_path)!r}, step=1, sharded=state)
        def die(*a, **k):
            os._exit(9)
        ck.write_manifest = die
        ck.save_checkpoint({str(tmp_path)!r}, step=2, sharded={{"w": state["w"] * 2}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert (tmp_path / "step_00000002" / "__0_0.distcp").exists()  # data was written ...
    assert latest_checkpoint(str(tmp_path)).step == 1               # ... but never committed
    assert verify_checkpoint(str(tmp_path), step=1).ok
    template = {"w": torch.zeros(4096)}
    load_checkpoint(str(tmp_path), sharded=template, verify_checksums=True)
    assert torch.equal(template["w"], torch.arange(4096.0))


def test_corrupted_file_fails_verification_and_checked_load(tmp_path):
    uri = str(tmp_path)
    save_checkpoint(uri, step=5, sharded=_state(5))
    assert verify_checkpoint(uri).ok
    data_file = tmp_path / "step_00000005" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit, same size: only the checksum can see it
    data_file.write_bytes(bytes(raw))
    result = verify_checkpoint(uri)
    assert not result.ok and "CRC-32" in result.problems[0]
    assert latest_checkpoint(uri).step == 5  # sizes still match: listing is the cheap check
    with pytest.raises(SpecError, match="corrupt checkpoint"):
        load_checkpoint(uri, sharded=_template(), verify_checksums=True)


def test_manifest_lists_every_file_with_size_and_crc(tmp_path):
    save_checkpoint(str(tmp_path), step=7, sharded=_state(7), metadata={"job": "j1"})
    step_dir = tmp_path / "step_00000007"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    on_disk = {p.name for p in step_dir.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk == {".metadata", "__0_0.distcp", "rank_00000.pt"}
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (step_dir / name).stat().st_size
    assert manifest["metadata"] == {"job": "j1"} and manifest["step"] == 7


def test_retention_keeps_last_k_and_removes_older_torn_steps(tmp_path):
    uri = str(tmp_path)
    for step in (10, 20, 30, 40):
        save_checkpoint(uri, step=step, sharded=_state(step))
    os.remove(tmp_path / "step_00000020" / "manifest.json")  # an old torn step
    save_checkpoint(uri, step=50, sharded=_state(50), keep=2)
    assert [c.step for c in list_checkpoints(uri)] == [40, 50]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000040", "step_00000050"]
    with pytest.raises(SpecError, match="keep"):
        apply_retention(uri, keep=0)


def test_resaving_a_step_replaces_it(tmp_path):
    uri = str(tmp_path)
    save_checkpoint(uri, step=1, sharded=_state(1))
    save_checkpoint(uri, step=1, sharded=_state(2))
    template = _template()
    load_checkpoint(uri, sharded=template, step=1, verify_checksums=True)
    assert torch.equal(template["model"]["w"], _state(2)["model"]["w"])


def test_clear_errors(tmp_path):
    with pytest.raises(SpecError, match="no committed checkpoint"):
        load_checkpoint(str(tmp_path / "nothing"), sharded=_template())
    save_checkpoint(str(tmp_path), step=1, sharded=_state(1))
    with pytest.raises(SpecError, match=r"use one of \[1\]"):
        load_checkpoint(str(tmp_path), sharded=_template(), step=2)
    with pytest.raises(SpecError, match="rank_local"):
        save_checkpoint(str(tmp_path), step=2, sharded=_state(2), rank_local={"np": np.zeros(3)})
    with pytest.raises(SpecError, match="step"):
        save_checkpoint(str(tmp_path), step=-1, sharded=_state(2))
    assert not verify_checkpoint(str(tmp_path / "nothing")).ok
