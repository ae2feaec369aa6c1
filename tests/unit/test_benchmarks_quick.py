"""No benchmark can rot: every script in benchmarks/ has ``--quick`` and ``--json``, and each
one's quick run passes — here for the scripts that need no Ray cluster, in
tests/integration/test_benchmarks_quick.py for those that start one of their own.

A quick run is the real benchmark at a smaller size (fewer steps, requests or sizes): it must
exit 0 and write its JSON. Its figures are not judged here (a shared 2-core machine makes them
noisy); the full runs' figures are in the results ledger (benchmarks/results/ledger/) and the docs
rendered from it. A quick run records its ledger entry under the test's temp dir, marked quick.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _catalogue():
    spec = importlib.util.spec_from_file_location("benchmarks_common", REPO / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CATALOGUE = _catalogue()
SCRIPTS = CATALOGUE.benchmark_scripts()


def run_quick(script: Path, out_dir: Path, *, timeout_s: float) -> dict:
    """Run ``script --quick`` (and ``--json`` into ``out_dir`` when it has one); its JSON, or {}.

    The run's ledger entry goes under ``out_dir`` ($RAYFLEET_LEDGER_DIR), never into the checkout,
    and must be there, marked quick."""
    out = out_dir / f"{script.stem}.json"
    argv = [sys.executable, str(script), "--quick"]
    if "--json" in CATALOGUE.declared_options(script):
        argv += ["--json", str(out)]
    env = {**os.environ, CATALOGUE.LEDGER_DIR_ENV: str(out_dir / "ledger-root")}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, (f"{script.name} --quick exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    entries = CATALOGUE.read_ledger(out_dir / "ledger-root" / "quick" / f"{script.stem}.jsonl")
    assert [e["mode"] for e in entries] == ["quick"], f"{script.name} --quick recorded no quick ledger entry"
    assert not (out_dir / "ledger-root" / "ledger").exists(), f"{script.name} --quick wrote to the full ledger"
    return json.loads(out.read_text()) if out.exists() else {}


def test_the_catalogue_sees_every_benchmark():
    names = {p.stem for p in SCRIPTS}
    assert {"fp8_parity", "checkpoint", "eplb", "kv_tiers", "serving", "colocation"} <= names
    assert "common" not in names and not any(n.startswith("_") for n in names)  # helper modules
    ray_ones = {p.stem for p in SCRIPTS if CATALOGUE.starts_own_ray_cluster(p)}
    assert {"serving", "long_context"} <= ray_ones and "fp8_parity" not in ray_ones


def test_every_benchmark_has_a_quick_mode():
    lacking = [p.name for p in SCRIPTS if "--quick" not in CATALOGUE.declared_options(p)]
    assert not lacking, f"benchmarks without --quick: {lacking}"


def test_every_benchmark_writes_json_where_told():
    lacking = [p.name for p in SCRIPTS if "--json" not in CATALOGUE.declared_options(p)]
    assert not lacking, f"benchmarks without --json: {lacking}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", [p for p in SCRIPTS if not CATALOGUE.starts_own_ray_cluster(p)],
                         ids=lambda p: p.stem)
def test_quick_run(script, tmp_path):
    result = run_quick(script, tmp_path, timeout_s=850)
    if "--json" in CATALOGUE.declared_options(script):
        assert result, f"{script.name} --quick wrote no JSON"
