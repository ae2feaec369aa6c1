"""``scripts/gpu_check.py --device cpu`` (issue 32): every check that needs no CUDA runs here,
without Ray or vLLM (the GPU machines have neither), so no check rots until a GPU run finds it.

The script runs in a subprocess whose import system refuses ``ray`` and ``vllm``. Each group
must record results, none may crash or fail, and the CUDA-only checks must say why they skipped.
A group that raises must be recorded as a failed ``crashed`` check and turn the exit status to 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
NO_RAY = """
import runpy, sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ray', 'vllm'):
            raise ImportError('the GPU machines have no ' + name)
sys.meta_path.insert(0, _Refuse())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_cpu_mode_runs_every_group_without_ray_and_nothing_fails(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_RAY, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = [(r["group"], r["name"], r["detail"]) for r in doc["results"] if r["status"] == "fail"]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    groups = {r["group"] for r in doc["results"]}
    assert groups == {"fp8", "models", "training", "serving", "checkpoints", "costmodel"}
    judged = {g: sum(r["status"] == "pass" for r in doc["results"] if r["group"] == g) for g in groups}
    assert all(judged[g] for g in ("fp8", "models", "training", "serving", "checkpoints")), judged
    skipped = [r for r in doc["results"] if r["status"] == "skip"]
    assert skipped and all(r["detail"] for r in skipped)
    assert doc["machine"]["device"] == "cpu" and doc["quick"] is True
    assert "passed" in proc.stdout and "results:" in proc.stdout


def test_a_group_that_raises_is_a_failed_check_and_the_exit_status_says_so(tmp_path, monkeypatch):
    sys.path[:0] = [str(REPO / "scripts")]
    try:
        import gpu_check

        broken = types.ModuleType("gpu_checks.fp8")

        def run(ctx):
            ctx.record("first", True)
            raise RuntimeError("the device fell over")

        broken.run = run
        monkeypatch.setitem(sys.modules, "gpu_checks.fp8", broken)
        assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--only", "fp8"]) == 1
    finally:
        sys.path.remove(str(REPO / "scripts"))
    results = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    assert [(r["name"], r["status"]) for r in results] == [("first", "pass"), ("crashed", "fail")]
    assert "the device fell over" in results[1]["detail"]


def test_bad_arguments_name_the_value_and_the_choices(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--only", "fp9"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--only fp9" in proc.stderr and "costmodel" in proc.stderr
