"""Token datasets through fsspec (local and memory://) and the `rayfleet data prepare` command."""

from __future__ import annotations

import argparse
import json
import uuid

import fsspec
import numpy as np
import pytest

from rayfleet.errors import SpecError
from rayfleet.models import ByteTokenizer
from rayfleet.cli import data as data_cli
from rayfleet.storage.tokens import (MANIFEST_NAME, find_text_files, load_tokens,
                                     prepare_token_dataset, read_manifest, read_shard_tokens)

TEXTS = {"a.py": "print('hello')\n", "pkg/b.py": "x = 'héllo'\n" * 40, "pkg/notes.txt": "skip me"}


@pytest.fixture()
def source_dir(tmp_path):
    for name, text in TEXTS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def expected_stream(names) -> list[int]:
    tok = ByteTokenizer()
    return [i for n in names for i in tok.encode(TEXTS[n], add_bos=True, add_eos=True)]


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_prepare_then_load_round_trips_the_documents(source_dir, tmp_path, scheme):
    out = str(tmp_path / "ds") if scheme == "local" else f"memory://tokens-{uuid.uuid4().hex}"
    manifest = prepare_token_dataset([str(source_dir)], out, shard_tokens=128, seq_len=32)
    stream = expected_stream(["a.py", "pkg/b.py"])  # *.py only, sorted
    assert manifest.num_tokens == len(stream) and manifest.num_documents == 2
    assert len(manifest.shards) == -(-len(stream) // 128)
    assert all(s.num_tokens <= 128 for s in manifest.shards)
    assert manifest.tokenizer == ByteTokenizer().to_dict()
    tokens = load_tokens(out)
    assert tokens.dtype == np.uint16 and tokens.tolist() == stream
    assert ByteTokenizer().decode(tokens).startswith("print('hello')")
    assert read_manifest(out) == manifest
    first = read_shard_tokens(out, manifest.shards[0])
    assert first.tolist() == stream[:128]
    assert load_tokens(out, max_tokens=50).tolist() == stream[:50]


def test_manifest_is_json_with_shards_counts_and_tokenizer(source_dir, tmp_path):
    prepare_token_dataset([str(source_dir / "a.py")], str(tmp_path / "ds"), shard_tokens=64, seq_len=8)
    raw = json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())
    assert raw["format"] == "rayfleet-tokens/1" and raw["tokenizer"]["name"] == "byte"
    assert raw["shards"][0] == {"path": "shard-00000.parquet", "num_tokens": 17, "num_rows": 3}


def test_missing_inputs_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        find_text_files([str(tmp_path / "nope")])
    with pytest.raises(SpecError, match="no files"):
        find_text_files([str(tmp_path)], glob="*.rs")
    with pytest.raises(SpecError, match="manifest"):
        read_manifest(str(tmp_path))
    with pytest.raises(SpecError, match="shard-tokens"):
        prepare_token_dataset([str(tmp_path)], str(tmp_path / "o"), shard_tokens=4, seq_len=8)


def test_cli_prepare_writes_to_memory(source_dir, capsys):
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers())
    out = f"memory://cli-{uuid.uuid4().hex}"
    args = parser.parse_args(["data", "prepare", str(source_dir), "--out", out, "--glob", "*.txt",
                              "--seq-len", "4", "--shard-tokens", "8"])
    assert args.func(args) == 0
    assert "shard" in capsys.readouterr().out
    assert load_tokens(out).tolist() == expected_stream(["pkg/notes.txt"])
    fs = fsspec.filesystem("memory")
    assert fs.exists(out.removeprefix("memory://") + "/" + MANIFEST_NAME)
