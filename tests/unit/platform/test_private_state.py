"""Issue 15 hardening of platform state: the controller's event log is bounded, and flash
snapshots live in a private per-user shared-memory directory."""

from __future__ import annotations

import os

import pytest

from rayfleet.platform.snapshot import DEFAULT_SNAPSHOT_ROOT, _make_private_dirs
from rayfleet.platform.state_store import Event, StateStore


def test_the_event_log_keeps_only_the_newest_max_events(tmp_path):
    """Regression: the controller's event log grew without bound (every autoscaler decision)."""
    store = StateStore(tmp_path / "state.sqlite", max_events=5)
    for i in range(12):
        store.append_event(Event(ts=float(i), kind="k", subject=f"s{i}", cause="c", detail={"i": i}))
    events = store.events(limit=100)
    assert [e.detail["i"] for e in events] == [7, 8, 9, 10, 11]
    (count,) = store._db.execute("SELECT COUNT(*) FROM events").fetchone()
    assert count == 5
    store.close()


def test_snapshots_default_to_a_private_per_user_directory(tmp_path):
    assert DEFAULT_SNAPSHOT_ROOT.startswith(f"/dev/shm/rayfleet-{os.getuid()}/")
    root = tmp_path / f"rayfleet-{os.getuid()}" / "snapshots" / "job" / "rank_00000"
    _make_private_dirs(root)
    assert root.is_dir() and (tmp_path / f"rayfleet-{os.getuid()}").stat().st_mode & 0o777 == 0o700


def test_a_shared_or_planted_user_directory_is_refused(tmp_path):
    planted = tmp_path / f"rayfleet-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # as another user (or a umask) would leave it: readable by all
    with pytest.raises(PermissionError, match="not a private directory"):
        _make_private_dirs(planted / "snapshots")
    link_target = tmp_path / "elsewhere"
    link_target.mkdir(mode=0o700)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / f"rayfleet-{os.getuid()}").symlink_to(link_target)
    with pytest.raises(PermissionError):
        _make_private_dirs(tmp_path / "links" / f"rayfleet-{os.getuid()}" / "snapshots")
