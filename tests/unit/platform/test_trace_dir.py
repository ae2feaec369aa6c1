"""The traces ship inside the repository; RAYFLEET_TRACE_DIR points the simulator elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayfleet.errors import SpecError
from rayfleet.platform.sim.workload import default_trace_dir

REPO = Path(__file__).resolve().parents[3]


def test_default_is_the_repositorys_own_traces(monkeypatch):
    monkeypatch.delenv("RAYFLEET_TRACE_DIR", raising=False)
    path = default_trace_dir()
    assert path == REPO / "traces"
    for name in ("philly_jobs.csv", "azure2023_conv.csv", "mooncake_synthetic.jsonl", "README.md"):
        assert (path / name).stat().st_size > 1000, name


def test_the_setting_points_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFLEET_TRACE_DIR", str(tmp_path))
    assert default_trace_dir() == tmp_path


def test_a_missing_folder_names_the_setting_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFLEET_TRACE_DIR", str(tmp_path / "nope"))
    with pytest.raises(SpecError, match=r"RAYFLEET_TRACE_DIR.*nope.*philly_jobs.csv"):
        default_trace_dir()
