"""Files stay small (CONVENTIONS.md: aim under ~400 lines, split by responsibility before 800).

Every module of ``rayfleet/`` and every benchmark script is at most 400 lines, or says in its
module docstring why it is longer (a line starting ``Over 400 lines:``), and none reaches 800.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT, HARD_LIMIT = 400, 800
REASON = "Over 400 lines:"


def oversized(paths: list[Path], *, root: Path) -> list[str]:
    """``path (N lines): why`` for each file over the limit without a stated reason, or over the hard limit."""
    out = []
    for path in paths:
        text = path.read_text()
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines <= LIMIT:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        rel = path.relative_to(root)
        if lines >= HARD_LIMIT:
            out.append(f"{rel} ({lines} lines): split it by responsibility (at most {HARD_LIMIT - 1})")
        elif not any(line.strip().startswith(REASON) for line in docstring.splitlines()):
            out.append(f"{rel} ({lines} lines): split it, or state why in its docstring ('{REASON} ...')")
    return out


def test_rayfleet_modules_and_benchmarks_stay_small_or_say_why():
    paths = sorted((REPO / "rayfleet").rglob("*.py")) + sorted((REPO / "benchmarks").glob("*.py"))
    assert len(paths) > 100
    assert oversized(paths, root=REPO) == []


@pytest.mark.parametrize("body, found", [
    ("x = 1\n" * 401, True),
    ('"""Doc.\n\nOver 400 lines: one experiment end to end.\n"""\n' + "x = 1\n" * 400, False),
    ('"""Doc.\n\nOver 400 lines: still too long.\n"""\n' + "x = 1\n" * 800, True),
    ("x = 1\n" * 400, False),
])
def test_the_check_finds_a_long_module_without_a_reason(tmp_path, body, found):
    path = tmp_path / "m.py"
    path.write_text(body)
    assert bool(oversized([path], root=tmp_path)) is found
