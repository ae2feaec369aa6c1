"""``rayfleet data prepare``: text files to tokenized Parquet shards (see ``storage.tokens``).

Registered by ``rayfleet.cli`` through ``register(subparsers)``; the handler returns an exit
code and lets ``RayfleetError`` reach the CLI, which prints it as one line.
"""

from __future__ import annotations

import argparse
import time

from rayfleet.storage.tokens import default_text_sources, prepare_token_dataset

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="prepare training data")
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    prepare = commands.add_parser(
        "prepare", help="tokenize text files into Parquet shards (byte tokenizer)",
        description="Tokenize text files into Parquet shards with a JSON manifest, through "
                    "fsspec (local paths, memory://, s3:// ...). Without SRC, uses the Python "
                    "standard library's sources.")
    prepare.add_argument("sources", nargs="*", metavar="SRC",
                         help="files or folders (searched recursively); default: Python stdlib")
    prepare.add_argument("--out", required=True, metavar="URI", help="dataset folder URI")
    prepare.add_argument("--shard-tokens", type=int, default=1 << 22, metavar="N",
                         help="tokens per shard (default 4194304)")
    prepare.add_argument("--seq-len", type=int, default=2048, metavar="N",
                         help="tokens per Parquet row (default 2048)")
    prepare.add_argument("--glob", default="*.py", help="file pattern inside folders (default *.py)")
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    sources = args.sources or default_text_sources()
    start = time.monotonic()
    manifest = prepare_token_dataset(sources, args.out, shard_tokens=args.shard_tokens,
                                     seq_len=args.seq_len, glob=args.glob)
    elapsed = time.monotonic() - start
    print(f"wrote {manifest.num_tokens:,} tokens from {manifest.num_documents:,} files into "
          f"{len(manifest.shards)} shard(s) at {args.out} in {elapsed:.1f}s "
          f"(tokenizer {manifest.tokenizer['name']}, vocab {manifest.tokenizer['vocab_size']})")
    return 0
