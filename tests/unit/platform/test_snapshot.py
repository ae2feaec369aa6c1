"""Shared-memory snapshot store, in-process (no Ray): round trip, buffer reuse, torn snapshots."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rayfleet.platform.snapshot import SnapshotStore, SnapshotStoreActor, list_snapshots


@pytest.fixture()
def root(tmp_path):
    # tmpfs like production when available; any directory works for the logic under test.
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = f"/dev/shm/rayfleet-test-{os.getpid()}-{tmp_path.name}"
        yield path
        subprocess.run(["rm", "-rf", path], check=False)
    else:
        yield str(tmp_path)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(33, 17, generator=g),
        "w_t": torch.randn(17, 33, generator=g).t(),  # non-contiguous source
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (5,), generator=g),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_round_trip_and_objects(root):
    store = SnapshotStore(root, job="j", rank=3)
    tensors = _tensors(1)
    rng = torch.get_rng_state()
    store.snapshot(10, tensors, {"data_position": {"epoch": 0, "index": 640}, "rng": rng})
    restored = SnapshotStore(root, job="j", rank=3).restore()  # a fresh process's view
    assert restored.step == 10
    _assert_equal(restored.tensors, tensors)
    assert restored.objects["data_position"] == {"epoch": 0, "index": 640}
    assert torch.equal(restored.objects["rng"], rng)
    assert SnapshotStore(root, job="j", rank=0).restore() is None  # another rank: nothing


def test_newest_of_rotating_slots_is_restored_and_buffers_are_reused(root):
    store = SnapshotStore(root, job="j", rank=0)
    store.snapshot(1, _tensors(1))
    assert store.num_allocations == 2  # the first (cold) snapshot sizes both slots
    pointers = {slot: buf.data_ptr() for slot, buf in store._buffers.items()}
    for step in (2, 3, 4, 5):
        store.snapshot(step, _tensors(step))
    assert store.num_allocations == 2  # later snapshots allocate nothing new ...
    assert {slot: buf.data_ptr() for slot, buf in store._buffers.items()} == pointers  # ... same memory
    assert [i.step for i in store.committed()] == [5, 4]
    restored = store.restore()
    assert restored.step == 5
    _assert_equal(restored.tensors, _tensors(5))
    assert store.restore(step=4).step == 4 and store.restore(step=3) is None


def test_torn_snapshot_is_not_restored(root):
    store = SnapshotStore(root, job="j", rank=0)
    store.snapshot(1, _tensors(1))
    store.snapshot(2, _tensors(2))
    store.write(3, _tensors(3))  # data copied, commit never happens (crash)
    restored = SnapshotStore(root, job="j", rank=0).restore()
    assert restored.step == 2  # the previous complete snapshot survived the torn write
    _assert_equal(restored.tensors, _tensors(2))


def test_process_killed_between_copy_and_commit(root):
    script = textwrap.dedent(f"""
        import os, torch
        from rayfleet.platform.snapshot import SnapshotStore
        store = SnapshotStore({root!r}, job="k", rank=0)
        store.snapshot(7, {{"w": torch.full((1000,), 7.0)}})
        store.snapshot(8, {{"w": torch.full((1000,), 8.0)}})
        store.write(9, {{"w": torch.full((1000,), 9.0)}})
        os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    restored = SnapshotStore(root, job="k", rank=0).restore()
    assert restored.step == 8 and torch.equal(restored.tensors["w"], torch.full((1000,), 8.0))


def test_corrupted_data_fails_checksum(root):
    store = SnapshotStore(root, job="j", rank=0)
    store.snapshot(1, _tensors(1))
    info = store.snapshot(2, _tensors(2))
    with open(store._path(info.slot, "data"), "r+b") as f:  # flip one bit in the committed data
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    fresh = SnapshotStore(root, job="j", rank=0)
    assert fresh.restore().step == 1
    assert fresh.restore(verify=False).step == 2  # the broken variant: without the CRC it is returned


def test_pinned_slot_is_not_overwritten(root):
    store = SnapshotStore(root, job="j", rank=0)
    store.snapshot(1, _tensors(1))
    info2 = store.snapshot(2, _tensors(2))
    with store.pin(info2.slot):
        store.snapshot(3, _tensors(3))
        store.snapshot(4, _tensors(4))  # both land in the one unpinned slot
        assert store.load(info2.slot).step == 2
    assert [i.step for i in store.committed()] == [4, 2]
    pending = store.write(5, _tensors(5))  # into the older slot (step 2)
    assert pending.slot == info2.slot
    with store.pin(1 - info2.slot), pytest.raises(RuntimeError, match="pinned or awaiting commit"):
        store.write(6, _tensors(6))  # the pending slot must not be reused before its commit
    store.commit(pending)
    assert store.restore().step == 5


def test_larger_state_grows_buffers_and_lists_and_releases(root):
    store = SnapshotStore(root, job="grow", rank=1)
    store.snapshot(1, {"w": torch.ones(10)})
    store.snapshot(2, {"w": torch.ones(10), "exp_avg": torch.zeros(100_000)})  # optimizer state appears
    restored = store.restore()
    assert restored.step == 2 and restored.tensors["exp_avg"].shape == (100_000,)
    actor = SnapshotStoreActor(root)  # the actor class, called in-process
    assert actor.list("grow") == {"grow": {1: [2, 1]}}
    assert list_snapshots(root) == actor.list()
    assert actor.usage_bytes("grow") >= 100_000 * 4
    assert actor.release("grow") > 0 and actor.list() == {}


def test_release_refuses_a_job_name_that_leaves_the_root(root):
    actor = SnapshotStoreActor(root)
    SnapshotStore(root, job="kept", rank=0).snapshot(1, {"w": torch.ones(4)})
    for bad in ("..", "../kept", "", "a/b"):
        with pytest.raises(ValueError, match="not a snapshot job name"):
            actor.release(bad)
    assert actor.list() == {"kept": {0: [1]}}


def test_a_local_fleets_teardown_frees_the_snapshots_of_its_own_sessions_only(tmp_path, monkeypatch):
    """tmpfs is memory: jobs that die with a local fleet must not keep theirs (a day of test runs
    once left 9.3 GiB in /dev/shm). ``down`` frees the snapshot roots of the Ray sessions in the
    fleet's own temp dir; another fleet's session on the same host keeps its snapshots."""
    from rayfleet.platform import launcher, snapshot_node

    base = tmp_path / "shm"
    monkeypatch.setattr(snapshot_node, "DEFAULT_SNAPSHOT_ROOT", str(base))
    monkeypatch.setattr(launcher, "remove_session_snapshots",
                        lambda names: snapshot_node.remove_session_snapshots(names, str(base)))
    temp_dir = tmp_path / "ray-temp"
    for name in ("session_2026-11-27_10-00-00_1_1", "session_2026-11-27_11-00-00_2_2"):
        (temp_dir / name).mkdir(parents=True)
        SnapshotStore(snapshot_node.session_snapshot_root(name, str(base)), job=f"job-{name[-3:]}-f0",
                      rank=0).snapshot(1, {"w": torch.ones(1000)})
    (temp_dir / "session_latest").symlink_to(temp_dir / "session_2026-11-27_11-00-00_2_2")
    other = snapshot_node.session_snapshot_root("session_2026-11-27_12-00-00_3_3", str(base))
    SnapshotStore(other, job="other-f0", rank=0).snapshot(1, {"w": torch.ones(10)})
    fleet = launcher.LocalFleet(address="127.0.0.1:41000", dashboard_url="", home=str(tmp_path / "home"),
                                temp_dir=str(temp_dir), topology_nodes=[])
    fleet.down(grace_s=0)
    assert sorted(p.name for p in base.iterdir()) == ["session_2026-11-27_12-00-00_3_3"]
    assert list_snapshots(other) == {"other-f0": {0: [1]}}
    with pytest.raises(ValueError, match="not a Ray session name"):
        snapshot_node.session_snapshot_root("../etc")
