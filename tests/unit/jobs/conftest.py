"""Fixtures for the jobs unit tests: a small real token dataset written with the storage layer."""

from __future__ import annotations

import random

import pytest

from rayfleet.storage.tokens import prepare_token_dataset

_WORDS = ("expert router token shard fleet rank step loss batch layer gradient tensor mesh plan node "
          "rail snapshot parquet manifest accelerator pipeline replica").split()


@pytest.fixture(scope="session")
def token_dataset(tmp_path_factory) -> str:
    """~24k tokens of seeded text in several 4096-token shards (samples cross shard edges)."""
    root = tmp_path_factory.mktemp("tokens")
    src = root / "src"
    src.mkdir()
    rng = random.Random(0)
    for i in range(6):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(500, 800))]
        (src / f"doc{i}.txt").write_text(" ".join(words) + "\n")
    out = root / "dataset"
    prepare_token_dataset([str(src)], str(out), shard_tokens=4096, seq_len=64, glob="*.txt")
    return str(out)


@pytest.fixture()
def job_dict(token_dataset) -> dict:
    """A valid tiny job (callers override fields)."""
    return {"name": "unit", "model": {"preset": "tiny"}, "data": {"uri": token_dataset, "seq_len": 32},
            "steps": 4, "global_batch_size": 8, "precision": "fp32", "resources": {"num_workers": 1}}
