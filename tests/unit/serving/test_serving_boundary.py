"""The engine core and routing policy import neither Ray nor training code (pure, fast to test)."""

from __future__ import annotations

import ast
from pathlib import Path

import rayfleet.serving

CORE = ("engine/block_hash", "engine/block_pool", "engine/kv_cache_manager", "engine/request",
        "engine/sampling", "engine/stop_checker", "engine/scheduler", "engine/model_runner",
        "engine/llm_engine", "routing/prefix_index", "routing/policy")


def test_engine_core_imports_no_ray_and_no_jobs():
    root = Path(rayfleet.serving.__file__).parent
    offenders = []
    for name in CORE:
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{name}: {n}" for n in names
                          if n.split(".")[0] == "ray" or n.startswith("rayfleet.jobs")]
    assert not offenders
