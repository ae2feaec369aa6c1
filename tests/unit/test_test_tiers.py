"""scripts/test_tiers.py: the per-tier times ``make test`` prints are read right from pytest's report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("test_tiers_script", REPO / "scripts" / "test_tiers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.unit.test_a" name="test_fast" file="tests/unit/test_a.py" time="0.5"/>
<testcase classname="tests.cluster.test_b" name="test_fleet" file="tests/cluster/test_b.py" time="120.0"/>
<testcase classname="tests.cluster.test_b" name="test_broken" file="tests/cluster/test_b.py" time="30.0">
  <failure message="boom">boom</failure></testcase>
<testcase classname="tests.gpu.test_c" name="test_cuda" file="tests/gpu/test_c.py" time="0.0">
  <skipped message="no CUDA"/></testcase>
</testsuite></testsuites>
"""


def test_junit_report_gives_counts_per_tier_seconds_and_the_slowest(tmp_path):
    tiers = _module()
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    result = tiers.SessionResult(name="unit+cluster+gpu", paths=("tests/unit",), exit_code=1, wall_s=200.0)
    tiers.read_junit(path, result, top=2)
    assert (result.passed, result.failed, result.skipped) == (2, 1, 1)
    assert result.dir_to_seconds == {"unit": 0.5, "cluster": 150.0, "gpu": 0.0}
    assert [t.seconds for t in result.slowest] == [120.0, 30.0]
    table = tiers.render([result], install_s=60.0)
    assert "cluster" in table and "2.5" in table and "exit 1" in table  # 150 s = 2.5 min


def test_a_session_that_wrote_no_report_counts_nothing(tmp_path):
    tiers = _module()
    result = tiers.SessionResult(name="vllm", paths=("tests/vllm",), exit_code=2, wall_s=3.0)
    tiers.read_junit(tmp_path / "missing.xml", result, top=5)
    assert (result.passed, result.failed, result.dir_to_seconds) == (0, 0, {})


def test_a_session_beside_another_starts_with_it_and_the_next_waits_for_both(monkeypatch):
    tiers = _module()
    events = []

    class FakeBackground:
        def __init__(self, name, paths, *, extra):
            self.name = name
            events.append(("start", name))

        def finish(self, *, top):
            events.append(("finish", self.name))
            return tiers.SessionResult(name=self.name, paths=(), exit_code=0, wall_s=1.0)

    def fake_run(name, paths, *, extra, top):
        events.append(("run", name))
        return tiers.SessionResult(name=name, paths=paths, exit_code=0, wall_s=2.0)

    monkeypatch.setattr(tiers, "BackgroundSession", FakeBackground)
    monkeypatch.setattr(tiers, "run_session", fake_run)
    # As shipped: one session after another (side by side was slower on 2 cores).
    results = tiers.run_sessions(list(tiers.SESSIONS), extra=[], top=3)
    assert [r.name for r in results] == [name for name, _ in tiers.SESSIONS] == [
        "unit", "cluster+gpu", "vllm", "integration", "ray up"]
    assert events == [("run", name) for name, _ in tiers.SESSIONS]
    events.clear()
    monkeypatch.setattr(tiers, "BESIDE", {"unit": "cluster+gpu", "vllm": "cluster+gpu"})
    results = tiers.run_sessions(list(tiers.SESSIONS), extra=[], top=3)
    assert [r.name for r in results] == [name for name, _ in tiers.SESSIONS]  # reported in the table's order
    assert events == [("start", "unit"), ("start", "vllm"), ("run", "cluster+gpu"), ("finish", "unit"),
                      ("finish", "vllm"), ("run", "integration"), ("run", "ray up")]
    events.clear()
    tiers.run_sessions([s for s in tiers.SESSIONS if s[0] in ("unit", "vllm")], extra=[], top=3)
    assert events == [("run", "unit"), ("run", "vllm")]  # their partner not selected: in the foreground
    table = tiers.render(results, install_s=None, elapsed_s=90.0)
    assert "unit beside cluster+gpu" in table and "vllm beside cluster+gpu" in table and "1.5" in table


def test_a_background_session_runs_pytest_and_reports_its_counts(tmp_path, monkeypatch):
    tiers = _module()
    (tmp_path / "test_tiny.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n")
    monkeypatch.setattr(tiers, "REPO", tmp_path)
    background = tiers.BackgroundSession("unit", ("test_tiny.py",), extra=[])
    result = background.finish(top=2)
    assert (result.passed, result.failed, result.exit_code) == (1, 1, 1)


_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n"


def test_the_cpu_meter_counts_the_tagged_process_tree_and_not_the_rest():
    import subprocess

    _module()  # puts scripts/ on sys.path
    from cpu_meter import CpuMeter

    meter = CpuMeter(interval_s=0.2).start()
    # tagged: a child that starts a grandchild (as ray start's daemons are started); untagged: a
    # bystander burning as long as both together
    tagged = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                               f"subprocess.run([sys.executable, '-c', {_BURN.format(s=1.0)!r}])\n"
                               + _BURN.format(s=0.5)], env=meter.environ())
    other = subprocess.Popen([sys.executable, "-c", _BURN.format(s=1.5)])
    tagged.wait()
    other.wait()
    cpu = meter.stop()
    # the grandchild's 1.0 s and the child's 0.5 s, less at most one sampling interval each
    assert 1.0 <= cpu <= 2.0, cpu


def _meter_module():
    spec = importlib.util.spec_from_file_location("cpu_meter_script", REPO / "scripts" / "cpu_meter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_process_kinds_name_what_a_process_runs():
    kind = _meter_module().process_kind
    assert kind(["ray::RayTrainWorker.train_fn_with_final_checkpoint_flush"]) == "ray::RayTrainWorker"
    assert kind(["ray::ServeReplica:vllm-pd:decode", ""]) == "ray::ServeReplica"
    assert kind(["ray::IDLE", "", ""]) == "ray worker (idle)"
    assert kind(["/x/ray/core/src/ray/raylet/raylet", "--node_id=abc"]) == "ray daemon: raylet"
    # A worker before it names itself is passed the raylet's socket: not a daemon, not settled yet.
    assert kind(["/v/bin/python", "/x/ray/_private/workers/default_worker.py",
                 "--raylet-name=/tmp/ray/session/sockets/raylet"]) == "ray worker (idle)"
    assert kind(["VLLM::EngineCore"]) == "vLLM engine"
    assert kind(["/v/bin/python", "-B", "-c", "from multiprocessing.forkserver import main; main(3)"]) \
        == "multiprocessing child"
    assert kind(["/v/bin/python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == "pytest-xdist worker"
    assert kind(["/v/bin/python", "-u", "/x/ray/dashboard/agent.py", "--x"]) == "ray daemon: dashboard agent"
    assert kind(["/v/bin/python", "-m", "rayfleet.jobs.train", "--spec-b64", "e30="]) == "python -m rayfleet.jobs.train"
    assert kind(["/v/bin/python", "-m", "pytest", "tests/cluster"]) == "pytest"
    assert kind([]) is None  # exited, not yet reaped: the kind seen before is kept


def test_the_meter_counts_a_tagged_child_under_its_kind_and_ignores_an_untagged_one():
    import subprocess

    meter_module = _meter_module()
    meter = meter_module.CpuMeter(interval_s=0.1).start()
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(0.3)\n"
    subprocess.run([sys.executable, "-c", busy], env=meter.environ(), check=True)
    subprocess.run([sys.executable, "-c", busy], check=True)  # not tagged: not counted
    meter.stop()
    kinds = meter.by_kind()
    assert kinds["python -c"] >= 0.4, kinds
    assert meter.cpu_seconds < 1.2, kinds  # only the tagged child's 0.6 s (and its start)
