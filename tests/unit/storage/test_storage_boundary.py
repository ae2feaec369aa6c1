"""rayfleet.storage imports nothing of rayfleet but rayfleet.errors (and itself), every module of it
with no exception: the commands that wire storage to models live in ``rayfleet/cli/``."""

from __future__ import annotations

import ast
from pathlib import Path

import rayfleet.storage
from rayfleet.models import ByteTokenizer
from rayfleet.storage.tokens import ByteCodec

ALLOWED = ("rayfleet.storage", "rayfleet.errors")


def _offenders(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] == "ray" or (n.startswith("rayfleet") and not n.startswith(ALLOWED))]
    return found


def test_storage_imports_stay_inside_the_boundary():
    assert _offenders(Path(rayfleet.storage.__file__).parent) == []


def test_boundary_check_catches_a_models_import(tmp_path):
    (tmp_path / "bad.py").write_text("from rayfleet.models.config import MoEConfig\n")
    assert _offenders(tmp_path) == ["bad.py: rayfleet.models.config"]


def test_byte_codec_is_the_byte_tokenizer_format():
    codec, tok = ByteCodec(), ByteTokenizer()
    assert codec.to_dict() == tok.to_dict()
    text = "déjà vu\n\tprint('x')"
    assert codec.encode(text, add_bos=True, add_eos=True) == tok.encode(text, add_bos=True, add_eos=True)
