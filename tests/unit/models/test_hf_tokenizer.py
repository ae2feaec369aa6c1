"""HF tokenizers: a byte-level BPE trained locally with ``tokenizers``; ids, decoding and chat
templates equal ``transformers.AutoTokenizer``'s; ``rayfleet data prepare --tokenizer DIR``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import rayfleet.models
from rayfleet.errors import SpecError
from rayfleet.models.hf.tokenizer import HFTokenizer, train_byte_level_bpe
from rayfleet.cli import data as data_cli
from rayfleet.storage.safetensors_io import read_side_files, write_files
from rayfleet.storage.tokens import load_tokens, read_manifest

transformers = pytest.importorskip("transformers")

SAMPLES = ["def main():\n    print('héllo wörld')\n", "x = [i * 2 for i in range(10)]  # ünïcode ✓",
           "class Router(nn.Module):\n\tpass\n"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    texts = [p.read_text() for p in sorted(Path(rayfleet.models.__file__).parent.rglob("*.py"))]
    tok = train_byte_level_bpe(texts, vocab_size=400)
    out = tmp_path_factory.mktemp("tok")
    write_files(str(out), tok.to_files())
    return out


def test_ids_and_text_equal_autotokenizer(tokenizer_dir):
    ours = HFTokenizer.from_files(read_side_files(str(tokenizer_dir)))
    ref = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert ours.vocab_size == len(ref) == 400
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert len(ids) < len(text.encode())  # merges were learned: fewer tokens than bytes
        assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.encode("a", add_bos=True, add_eos=True) == [ours.bos_id, *ours.encode("a"), ours.eos_id]


def test_chat_template_renders_like_transformers(tokenizer_dir):
    ours = HFTokenizer.from_files(read_side_files(str(tokenizer_dir)))
    ref = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write a loop"}]
    text = ours.apply_chat_template(chat)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n") and "write a loop</s>" in text


def test_a_tokenizer_without_template_refuses_chat_with_the_fix(tokenizer_dir):
    files = read_side_files(str(tokenizer_dir))
    tok = HFTokenizer(files["tokenizer.json"].decode(), {"eos_token": "</s>"})
    with pytest.raises(SpecError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_data_prepare_with_an_hf_tokenizer(tokenizer_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(SAMPLES):
        (src / f"f{i}.py").write_text(text)
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers())
    out = tmp_path / "ds"
    args = parser.parse_args(["data", "prepare", str(src), "--out", str(out), "--seq-len", "16",
                              "--shard-tokens", "64", "--tokenizer", str(tokenizer_dir)])
    assert args.func(args) == 0
    manifest = read_manifest(str(out))
    tok = HFTokenizer.from_files(read_side_files(str(tokenizer_dir)))
    assert manifest.tokenizer["vocab_size"] == 400 and manifest.tokenizer["eos_id"] == tok.eos_id
    expected = [t for text in SAMPLES for t in tok.encode(text, add_bos=True, add_eos=True)]
    assert load_tokens(str(out)).tolist() == expected
