"""The processes that only drive or route work import no torch (about 2 s of CPU each per start
on 2 cores, and a few hundred MB of memory): a training job's driver and Ray Train's controller
(the trainer's backend config, the loop's function and config, the elastic driver, the fleet
controller's client), the SDK a notebook imports, and the OpenAI ingress replica of a built-in
engine app (its router plans long-prompt splits without the span computation). Each check runs
in a fresh interpreter: this test process imported torch long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIGHT = {
    "training driver and controller": [
        "rayfleet.jobs.train", "rayfleet.jobs.train_launcher", "rayfleet.jobs.worker_entry",
        "rayfleet.jobs.process_group_backend", "rayfleet.jobs.elastic.formation", "rayfleet.platform.controller",
        "ray.train.v2.api.data_parallel_trainer"],
    "sdk": ["rayfleet.sdk"],
    "serve ingress": ["rayfleet.serving.openai_api.serve_app", "rayfleet.serving.routing.router"],
}


@pytest.mark.parametrize("process", sorted(LIGHT))
def test_the_process_imports_no_torch(process):
    code = (f"import importlib, json, sys\nfor m in {LIGHT[process]!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == [], f"{process} imports torch: {out.stdout[:300]}"
