"""rayfleet.models imports neither Ray nor other rayfleet subpackages (rayfleet.errors only)."""

from __future__ import annotations

import ast
from pathlib import Path

import rayfleet.models

ALLOWED_RAYFLEET = ("rayfleet.models", "rayfleet.errors")


def test_models_imports_stay_inside_the_boundary():
    root = Path(rayfleet.models.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top == "ray" or (top == "rayfleet" and not name.startswith(ALLOWED_RAYFLEET)):
                    offenders.append(f"{path.relative_to(root)}: {name}")
    assert not offenders
