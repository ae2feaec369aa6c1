"""`rayfleet data prepare` shows a progress bar of tokens that ends at the exact token count."""

from __future__ import annotations

import argparse
import re

from rayfleet.cli import data as data_cli


def test_prepare_shows_token_progress_to_the_exact_total(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.py").write_text("x = 1\n" * (40 + i))
    expected = sum(p.stat().st_size + 2 for p in src.iterdir())  # bytes + BOS/EOS per file
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers())
    args = parser.parse_args(["data", "prepare", str(src), "--out", str(tmp_path / "ds"),
                              "--seq-len", "16", "--shard-tokens", "256"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    bar = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("tokenizing: 100%"), bar
    done, total = re.search(r"\| (\S+)/(\S+) \[", bar).groups()
    assert done == total == f"{expected / 1000:.2f}k", bar  # tqdm's unit scale: 1270 -> 1.27k
    assert f"wrote {expected:,} tokens" in captured.out
