"""The quick runs of the benchmarks that start a Ray cluster of their own (see
tests/unit/test_benchmarks_quick.py for the rest and for the --quick/--json checks).

Each starts a fleet of its own, so they run in the integration session, after the cluster
tier's fleet is gone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


def _catalogue():
    spec = importlib.util.spec_from_file_location("benchmarks_common", REPO / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CATALOGUE = _catalogue()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", [p for p in CATALOGUE.benchmark_scripts() if CATALOGUE.starts_own_ray_cluster(p)],
                         ids=lambda p: p.stem)
def test_quick_run_with_its_own_cluster(script, tmp_path):
    if "vllm" in script.stem and not os.environ.get("RAYFLEET_TEST_VLLM_BENCH"):
        # Opt-in for time, not for failure: it runs to the end, but three app starts (two of
        # them vLLM, 80-120 s each on 2 loaded cores) make the quick run 4-6 min, over the
        # 4 min this tier allows one benchmark. `make bench-quick` runs it;
        # RAYFLEET_TEST_VLLM_BENCH=1 puts it back here.
        pytest.skip("serving_vllm --quick is opt-in (RAYFLEET_TEST_VLLM_BENCH=1); run by make bench-quick")
    if "vllm" in script.stem:  # the optional engine: the same rule as tests/vllm
        if not (sys.platform == "linux" and platform.machine() == "x86_64"):
            pytest.skip(f"no vLLM wheel for {sys.platform}/{platform.machine()}")
        assert importlib.util.find_spec("vllm"), f"{script.name} needs vLLM here: run `make vllm`"
    out = tmp_path / f"{script.stem}.json"
    options = CATALOGUE.declared_options(script)
    argv = [sys.executable, str(script), "--quick"] + (["--json", str(out)] if "--json" in options else [])
    # The ledger entry goes to the temp dir: a test run never writes into the checkout.
    env = {**os.environ, CATALOGUE.LEDGER_DIR_ENV: str(tmp_path / "ledger-root")}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=850, env=env)
    assert proc.returncode == 0, (f"{script.name} --quick exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    entries = CATALOGUE.read_ledger(tmp_path / "ledger-root" / "quick" / f"{script.stem}.jsonl")
    assert [e["mode"] for e in entries] == ["quick"], f"{script.name} --quick recorded no quick ledger entry"
    if "--json" in options:
        assert json.loads(out.read_text()), f"{script.name} --quick wrote an empty JSON"
