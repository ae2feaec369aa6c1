"""``rayfleet train JOB.yaml --dry-run``: prints the plan and never imports Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import sys
from rayfleet.cli.entry import main
code = main(sys.argv[1:])
print("RAY_IMPORTED" if "ray" in sys.modules else "NO_RAY", code)
"""


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, "train", *args, "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_prints_the_plan_without_importing_ray() -> None:
    out = _dry_run("examples/jobs/tiny-bf16-dp.yaml")
    assert out.returncode == 0, out.stderr
    assert "plan:     TP1 PP1 DP2 EP2 ETP1 mbs2 ZeRO-3 [explicit]" in out.stdout
    assert "memory:" in out.stdout and "step:" in out.stdout and "layout:   2 ranks on 1 x H100 node" in out.stdout
    assert out.stdout.strip().endswith("NO_RAY 0")


def test_dry_run_refuses_a_plan_the_trainer_cannot_run_with_the_tables_reason() -> None:
    # DualPipeV with ZeRO-3 is the combination the trainer still refuses (expert-TP, CP, interleaved
    # and DualPipeV pipelines run)
    out = _dry_run("examples/jobs/tiny-bf16-dp.yaml", "--set", "plan.pp=2", "--set", "plan.dualpipe=true",
                   "--set", "plan.dp=2", "--set", "plan.ep=2")
    assert "NO_RAY 2" in out.stdout
    assert "plan.zero_stage=3" in out.stderr and "DualPipeV with ZeRO-3" in out.stderr, out.stderr
    assert "Fix: set zero_stage: 2" in out.stderr, out.stderr
