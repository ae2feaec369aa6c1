"""Training data: fixed-length samples from Parquet token shards, split deterministically by DP rank.

Design decisions:
- A *sample* is ``seq_len + 1`` consecutive tokens of the dataset's token stream (inputs plus
  the shifted targets); sample ``i`` starts at token ``i * seq_len``, so neighbours share one
  token and every token is predicted exactly once per epoch. Sample ids are global and
  independent of how shards were cut.
- The order is a pure function of ``(seed, epoch)`` (or the identity without shuffling): the
  sample ids are cut into chunks of about one shard each, the chunks are permuted, and the
  samples of every window of ``window_chunks`` consecutive chunks are permuted together (shard
  shuffle + windowed sample shuffle). A window touches only a few shards, so a small shard
  cache serves it; a global permutation would re-read a shard for almost every sample of a
  large dataset. A *position* counts samples consumed since
  the start of training, so the global batch of every step is "the next ``global_batch_size``
  ids of the order" whatever the number of workers. That one integer is the loader's whole
  state: restoring it at any DP size neither skips nor repeats a sample.
- Each DP replica takes a contiguous slice of the global batch: equal slices, or on mixed
  fleets ``replica_microbatches[r] * micro_batch_size`` sequences for replica ``r`` (the
  planner's speed-proportional split). TP/PP/EP peers of a replica read the same slice.
- Shards are read whole through fsspec/pyarrow (``rayfleet.storage.tokens``) and kept in a
  small LRU cache (``2 * window_chunks`` shards: a chunk may straddle two). Random access keeps
  the position exact, which a streaming shuffle buffer would make approximate.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rayfleet.errors import SpecError
from rayfleet.storage.tokens import TokenManifest, read_manifest, read_shard_tokens

__all__ = ["TokenSamples", "SampleOrder", "StepBatch", "DistributedTokenLoader", "replica_slices"]


class TokenSamples:
    """Random access to the ``seq_len + 1``-token samples of a token dataset at ``uri``."""

    def __init__(self, uri: str, seq_len: int, *, manifest: TokenManifest | None = None,
                 cached_shards: int = 4) -> None:
        if seq_len < 1:
            raise SpecError("data.seq_len", seq_len, "must be positive", "use e.g. 256")
        self.uri, self.seq_len = uri, seq_len
        self.manifest = manifest or read_manifest(uri)
        self._starts = np.cumsum([0] + [s.num_tokens for s in self.manifest.shards]).tolist()
        self.num_tokens = self._starts[-1]
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_shards = max(1, cached_shards)
        self.shard_reads = 0  # cache misses, for tests and diagnostics

    def _shard(self, index: int) -> np.ndarray:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        tokens = read_shard_tokens(self.uri, self.manifest.shards[index])
        self.shard_reads += 1
        self._cache[index] = tokens
        if len(self._cache) > self._cached_shards:
            self._cache.popitem(last=False)
        return tokens

    @property
    def samples_per_shard(self) -> int:
        shards = self.manifest.shards
        return max(1, self.num_tokens // max(1, len(shards)) // self.seq_len)

    @property
    def cached_shards(self) -> int:
        return self._cached_shards

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        parts = []
        shard = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            base = self._starts[shard]
            tokens = self._shard(shard)
            take = min(stop, base + tokens.size) - start
            parts.append(tokens[start - base:start - base + take])
            start += take
            shard += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def get(self, ids: np.ndarray | list[int]) -> torch.Tensor:
        """Samples ``[len(ids), seq_len + 1]`` int64, in the order of ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(f"sample ids must lie in [0, {self.num_samples})")
        out = np.empty((ids.size, self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(ids.tolist()):
            out[row] = self._tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)
        return torch.from_numpy(out)


class SampleOrder:
    """Global position -> sample id: chunk shuffle + windowed shuffle per epoch (pure; no I/O).

    ``chunk``: samples per chunk (None: one global permutation); ``window_chunks``: chunks whose
    samples are shuffled together.
    """

    def __init__(self, num_samples: int, *, seed: int, shuffle: bool = True, chunk: int | None = None,
                 window_chunks: int = 2) -> None:
        if num_samples < 1:
            raise SpecError("data.uri", num_samples, "the dataset holds no complete sample",
                            "use a larger dataset or a shorter data.seq_len")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.chunk = None if chunk is None or chunk >= num_samples else max(1, chunk)
        self.window_chunks = max(1, window_chunks)
        self._epoch: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        n = self.num_samples
        if not self.shuffle:
            perm = np.arange(n)
        else:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            if self.chunk is None:
                perm = rng.permutation(n)
            else:
                starts = np.arange(0, n, self.chunk)
                chunks = rng.permutation(len(starts))
                windows = []
                for w in range(0, len(chunks), self.window_chunks):
                    ids = np.concatenate([np.arange(starts[c], min(starts[c] + self.chunk, n))
                                          for c in chunks[w:w + self.window_chunks]])
                    windows.append(rng.permutation(ids))
                perm = np.concatenate(windows)
        self._epoch = (epoch, perm)
        return perm

    def ids(self, position: int, count: int) -> np.ndarray:
        """Sample ids at positions ``[position, position + count)`` (crossing epochs as needed)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(position + filled, self.num_samples)
            take = min(count - filled, self.num_samples - offset)
            out[filled:filled + take] = self._permutation(epoch)[offset:offset + take]
            filled += take
        return out


def replica_slices(global_batch_size: int, *, dp_size: int, micro_batch_size: int,
                   replica_microbatches: tuple[int, ...] | None = None) -> tuple[range, ...]:
    """Index range of each DP replica within the global batch (contiguous, in replica order)."""
    if replica_microbatches is None:
        if global_batch_size % (dp_size * micro_batch_size):
            raise SpecError("global_batch_size", global_batch_size,
                            f"is not divisible by dp*micro_batch_size = {dp_size * micro_batch_size}",
                            "pick a batch that every replica's micro-batches divide")
        sizes = [global_batch_size // dp_size] * dp_size
    else:
        if len(replica_microbatches) != dp_size or sum(replica_microbatches) * micro_batch_size != global_batch_size:
            raise SpecError("plan.replica_microbatches", replica_microbatches,
                            f"needs {dp_size} counts with sum x micro_batch_size = {global_batch_size}",
                            "use the planner's split or make the counts add up")
        sizes = [n * micro_batch_size for n in replica_microbatches]
    starts = np.cumsum([0] + sizes).tolist()
    return tuple(range(a, b) for a, b in zip(starts, starts[1:]))


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's data as seen by one DP replica.

    Attributes:
        step: 0-based step the batch feeds.
        position: global samples consumed before this batch.
        sample_ids: the whole global batch's sample ids (every replica's), in order.
        local_ids: this replica's slice of ``sample_ids``.
        microbatches: ``[micro_batch_size, seq_len + 1]`` int64 tensors covering ``local_ids``.
    """

    step: int
    position: int
    sample_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    microbatches: tuple[torch.Tensor, ...]

    @property
    def num_local_tokens(self) -> int:
        """Predicted (target) tokens on this replica."""
        return sum(mb.shape[0] * (mb.shape[1] - 1) for mb in self.microbatches)


class DistributedTokenLoader:
    """Yields this DP replica's :class:`StepBatch` for each step; state is one global position."""

    def __init__(self, samples: TokenSamples, *, global_batch_size: int, dp_rank: int, dp_size: int,
                 micro_batch_size: int, replica_microbatches: tuple[int, ...] | None = None,
                 shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.samples = samples
        # a window of chunks (~one shard each) may straddle 2x as many shards: size it to the cache
        self.order = SampleOrder(samples.num_samples, seed=seed, shuffle=shuffle, chunk=samples.samples_per_shard,
                                 window_chunks=max(1, samples.cached_shards // 2))
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.slice = replica_slices(global_batch_size, dp_size=dp_size, micro_batch_size=micro_batch_size,
                                    replica_microbatches=replica_microbatches)[dp_rank]
        self.position = 0

    @property
    def step(self) -> int:
        return self.position // self.global_batch_size

    def peek_ids(self) -> np.ndarray:
        """The next global batch's sample ids, without consuming them."""
        return self.order.ids(self.position, self.global_batch_size)

    def next_batch(self) -> StepBatch:
        ids = self.peek_ids()
        local = ids[self.slice.start:self.slice.stop]
        tokens = self.samples.get(local)
        micro = tuple(tokens[i:i + self.micro_batch_size] for i in range(0, len(local), self.micro_batch_size))
        batch = StepBatch(step=self.step, position=self.position, sample_ids=tuple(ids.tolist()),
                          local_ids=tuple(local.tolist()), microbatches=micro)
        self.position += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Global position plus what it is only meaningful with (checked on load)."""
        return {"position": self.position, "seed": self.order.seed, "shuffle": self.order.shuffle,
                "num_samples": self.samples.num_samples, "seq_len": self.samples.seq_len,
                "shuffle_chunk": self.order.chunk, "shuffle_window_chunks": self.order.window_chunks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]``; raises when the dataset or order no longer match."""
        for key in ("seed", "shuffle", "num_samples", "seq_len", "shuffle_chunk", "shuffle_window_chunks"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise SpecError(f"data.{key}", state[key], f"the checkpoint's data order used {key}={state[key]} "
                                f"but this job has {mine}", "resume with the dataset and data settings it was saved with")
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"negative data position {position}")
        self.position = position
