"""Data-parallel load balancing through the router (``RouterCore`` + ``LongPrefillPolicy``): the
prefill work of a burst, long prompts included, is spread so that no replica queues while
another idles. Between polls the router only sees the work it booked itself, which is what
these tests read back (``snapshots[...].num_queued_blocks``)."""

from __future__ import annotations

import random

from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.routing.long_prefill import LongPrefillPolicy
from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
from rayfleet.serving.routing.router import RouterCore

BS = 16
NAMES = ["colocated-0", "colocated-1", "colocated-2"]


def _core(long_prefill: LongPrefillPolicy | None, *, mode: str = "prefix_aware") -> RouterCore:
    return RouterCore(roles={"colocated": NAMES}, mode=mode, block_size=BS, model_id="m", num_blocks_hint=4096,
                      long_prefill=long_prefill)


def _queued(core: RouterCore) -> list[int]:
    return [core.snapshots[ReplicaId(n)].num_queued_blocks for n in NAMES]


def _burst(core: RouterCore, lengths: list[int]) -> None:
    rng = random.Random(0)
    for n in lengths:
        core.route([rng.randrange(256) for _ in range(n)], max_tokens=8)


def test_one_long_prompt_is_spread_over_idle_replicas_instead_of_queueing_on_one():
    split = _core(LongPrefillPolicy(threshold_tokens=1024, min_span_tokens=256))
    _burst(split, [3072])
    assert min(_queued(split)) > 0 and max(_queued(split)) - min(_queued(split)) <= 1
    whole = _core(None)  # the broken variant: the whole prompt queues on one replica
    _burst(whole, [3072])
    assert sorted(_queued(whole)) == [0, 0, 3072 // BS]


def test_mixed_burst_leaves_no_replica_idle_while_another_queues():
    lengths = [2048, 64, 96, 4096, 32, 1536, 80, 3000, 48, 2500]
    split = _core(LongPrefillPolicy(threshold_tokens=1024, min_span_tokens=128))
    _burst(split, lengths)
    queued = _queued(split)
    total = sum(-(-n // BS) for n in lengths)
    assert sum(queued) == total
    # Every replica got work, and the busiest holds at most one short prompt's worth above the mean.
    assert min(queued) > 0 and max(queued) - total / 3 <= 96 // BS + 1, queued
    whole = _core(None)
    _burst(whole, lengths)
    assert max(_queued(whole)) - total / 3 > max(queued) - total / 3  # whole prompts balance worse


def test_spans_avoid_a_replica_that_already_has_a_backlog():
    policy = LongPrefillPolicy(threshold_tokens=1024, min_span_tokens=128)
    busy = ReplicaId(NAMES[0])
    for backlog in (40, 200):  # blocks already queued on the busy replica
        core = _core(policy)
        core.observe(busy, ReplicaSnapshot(busy, 4096, 4096, 0, num_queued_blocks=backlog, max_num_seqs=16))
        plan = core.route(list(range(256)) * 8, max_tokens=8)  # 2048 tokens = 128 blocks
        assert plan.spans and plan.spans[0].replica_id != busy  # the backlogged replica never goes first
        share = {s.replica_id: s.end - s.start for s in plan.spans}
        assert share.get(busy, 0) < min(v for k, v in share.items() if k != busy)
        if backlog > 128:  # more than the whole prompt: it gets nothing, the idle two split evenly
            assert busy not in share and _queued(core)[1:] == [64, 64]
        else:  # everyone ends with the same booked work: (40 + 128) / 3 = 56 blocks each
            assert _queued(core) == [56, 56, 56]


def test_round_robin_baseline_and_cached_prompts_are_not_split():
    policy = LongPrefillPolicy(threshold_tokens=1024, min_span_tokens=128)
    assert not _core(policy, mode="round_robin").route(list(range(256)) * 8, max_tokens=8).spans
    core = _core(policy)
    prompt = [7] * 2048
    core.index.add_blocks(ReplicaId(NAMES[1]), hash_full_blocks(prompt, block_size=BS,
                                                                root=root_block_hash(model_id="m")))
    plan = core.route(prompt, max_tokens=8)
    assert not plan.spans and plan.first[0] == NAMES[1]  # cached: one replica, no recompute
