"""Which rank of a wide-EP replica takes a new request (data-parallel attention balancing).

Design decisions:
- A rank's cost for a request is the token work queued ahead of it: prompt tokens not yet
  computed (waiting and partly prefilled requests) plus one token per running request (its
  next decode), plus the request's own prompt tokens minus those whose KV the rank already
  holds (its prefix hit). The request goes to the rank with the lowest cost; ties to the
  lower rank. So no rank queues while another idles, and a shared prefix pulls a request to
  the rank that has it unless that rank is busier by more than the hit saves.
- The front's view of a rank is its last ``StepReport`` plus what the front itself assigned
  since (``DPBalancer.assigned``): a burst of arrivals between two steps is spread, not all
  sent to the rank that looked lightest before the burst.
- Which blocks a rank holds is the front's own record of the prompts it sent there (hashes
  from ``block_hash``), bounded per rank: an approximation of the rank's prefix cache (which
  may have evicted some), as the replica router's prefix index is.
- ``policy="round_robin"`` is the baseline without balancing (requests in turn).
Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rayfleet.serving.engine.block_hash import BlockHash, hash_full_blocks, root_block_hash

__all__ = ["RankLoad", "DPBalancer"]


@dataclass(frozen=True)
class RankLoad:
    """A rank's queue as of its last step, in tokens and requests."""

    num_queued_tokens: int
    num_running: int
    num_waiting: int


class DPBalancer:
    """Chooses a rank per request; mutated by ``choose`` (assignments, prefix record) and
    ``observe`` (a rank's reported load replaces what was assigned before it)."""

    def __init__(self, num_ranks: int, *, block_size: int, policy: Literal["balanced", "round_robin"] = "balanced",
                 model_id: str = "", max_blocks_per_rank: int = 4096) -> None:
        self.num_ranks, self.block_size, self.policy = num_ranks, block_size, policy
        self.root = root_block_hash(model_id=model_id, cache_salt=None)
        self.loads = [RankLoad(0, 0, 0)] * num_ranks
        self.assigned = [0] * num_ranks  # tokens sent to each rank since its last report
        self.blocks: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_ranks)]
        self.max_blocks = max_blocks_per_rank
        self._turn = 0

    def observe(self, rank: int, load: RankLoad) -> None:
        self.loads[rank] = load
        self.assigned[rank] = 0

    def cost(self, rank: int, prompt_len: int, hashes: Sequence[BlockHash]) -> int:
        load = self.loads[rank]
        hit = 0
        for h in hashes:  # a prefix hit stops at the first block the rank does not hold
            if h not in self.blocks[rank]:
                break
            hit += self.block_size
        return load.num_queued_tokens + load.num_running + self.assigned[rank] + prompt_len - hit

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        hashes = hash_full_blocks(list(prompt_token_ids), block_size=self.block_size, root=self.root)
        if self.policy == "round_robin":
            rank = self._turn % self.num_ranks
            self._turn += 1
        else:
            rank = min(range(self.num_ranks), key=lambda r: (self.cost(r, len(prompt_token_ids), hashes), r))
        self.assigned[rank] += len(prompt_token_ids)
        record = self.blocks[rank]
        for h in hashes:
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.max_blocks:
            record.popitem(last=False)
        return rank
