"""``EngineConfig``: the KV pool and batching limits of one engine replica.

Its own module so that the serve spec (``serving.spec``), which maps onto it, and the config
readers do not load the engine (and torch) to read a frozen dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.errors import SpecError

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """KV pool and batching limits of one engine replica."""

    block_size: int = 16
    num_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # None: min(model max_seq_len, num_blocks * block_size)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_kv_events: bool = False
    model_id: str = ""  # part of every block hash: engines of different models never share
    seed: int = 0  # generator for requests without their own seed
    # Never sample ids >= this (the tokenizer's size; see ``sampling``). None: the model's vocab.
    vocab_limit: int | None = None
    max_num_waiting: int | None = None  # bound of the waiting queue (None: unbounded)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise SpecError(name, getattr(self, name), "must be positive", f"pass {name} >= 1")
