"""The prices rayfleet's router uses in a vLLM pool (``serving.vllm.routing``): running decodes
weigh ``decode_weight`` next to queued prefill, and a conversation's home replica pays only the
overload its turn adds. Worked examples of the two decisions seen in a replay of the multi-turn
benchmark workload (``benchmarks/serving.py: multiturn_workload``); each test also shows the
built-in engine's prices (the defaults, unchanged) taking the other decision."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.engine.replica_state import ReplicaSnapshot, ReplicaId
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.prefix_index import PrefixIndex

BLOCK = 32
VLLM = RouterPolicy(decode_weight=1 / BLOCK, marginal_overload_at_home=True)
A, B = ReplicaId("a"), ReplicaId("b")


def conversation_turn() -> tuple[list, PrefixIndex]:
    """A 6-block turn: 2 blocks of tenant system prompt (cached on both replicas) and 2 of the
    conversation's earlier turns (cached on ``a`` only, its home), then the new message."""
    prompt = hash_full_blocks(list(range(6 * BLOCK)), block_size=BLOCK, root=root_block_hash(model_id="t"))
    index = PrefixIndex()
    index.add_blocks(A, prompt[:4])
    index.add_blocks(B, prompt[:2])
    return prompt, index


def snap(rid: ReplicaId, *, active: int = 0, queued: int = 0, running: int = 0) -> ReplicaSnapshot:
    return ReplicaSnapshot(rid, 1000, 1000 - active - queued, active, queued, running, 16)


def test_defaults_are_the_built_in_engines_prices():
    assert RouterPolicy().decode_weight == 1.0 and RouterPolicy().marginal_overload_at_home is False
    with pytest.raises(SpecError, match="decode_weight"):
        RouterPolicy(decode_weight=-1.0)


def test_a_decoding_request_does_not_push_a_turn_off_its_cached_context():
    prompt, index = conversation_turn()
    # One request decoding on a (6 blocks of context), b idle.
    decoding = [snap(A, active=6, running=1), snap(B)]
    # a: 2 to prefill + 0.5 * 6/32 = 2.09; b: 4 to prefill.
    assert VLLM.choose_prefill(decoding, prompt, index).replica_id == A
    # Broken variant (the decode priced as queued prefill, the default): a costs 2 + 3 = 5 > 4,
    # and the turn is prefilled again on b.
    assert RouterPolicy().choose_prefill(decoding, prompt, index).replica_id == B
    # Prefill queued ahead still counts in full: 6 blocks waiting on a cost 3, and b wins.
    queued = [snap(A, queued=6, running=1), snap(B)]
    assert VLLM.choose_prefill(queued, prompt, index).replica_id == B


def test_the_home_replica_pays_only_the_overload_its_turn_adds():
    prompt, index = conversation_turn()
    # Both replicas equally busy now; a (the hot tenant's replica) did 60 blocks of recent work,
    # b 40: mean after this turn 53, a is 13% over it.
    busy = [snap(A, active=6, running=1), snap(B, active=6, running=1)]
    recent = {A: 60.0, B: 40.0}
    # Home price: a adds 2 blocks -> over 0.04 * (4 x 6) = 0.9; a costs 2.9 + load, b 4 + load.
    decision = VLLM.choose_prefill(busy, prompt, index, recent_work=recent)
    assert decision.replica_id == A
    # Broken variant (the whole excess, the default): a costs 2 + 24 * 0.17 = 6.1 > 4.
    assert RouterPolicy().choose_prefill(busy, prompt, index, recent_work=recent).replica_id == B
    # A new conversation of the same tenant (only the shared system prompt cached, on both) is
    # not at home anywhere: it still goes to b, under the mean, which keeps the long-run balance.
    new = prompt[:2] + hash_full_blocks([7] * 4 * BLOCK, block_size=BLOCK, root=prompt[1])
    assert VLLM.choose_prefill(busy, new, index, recent_work=recent).replica_id == B
