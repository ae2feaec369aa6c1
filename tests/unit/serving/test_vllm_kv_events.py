"""vLLM's KV events -> a vLLM replica's exact, published cache state -> the router's index.

The decoder reads batches that vLLM's own msgspec classes encode (and that vLLM's own
``ZmqEventPublisher`` sends over an ipc socket); the mapper rewrites vLLM's salted hashes into
the token-block hashes the router computes from a prompt's token ids; the replica's hash log
carries them to ``PoolRouterCore``, where an evicted block stops attracting the request. Each
check is run against a broken variant that it must reject.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgspec
import pytest

from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
from rayfleet.serving.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from rayfleet.serving.routing.hash_log import HashLogPublisher
from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing.pool_router import PoolRouterCore
from rayfleet.serving.routing.prompt_hashes import PromptHashCache
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.vllm.kv_event_feed import TokenBlockMapper

BS, MODEL = 4, "tiny-moe"
PROMPT = list(range(100, 113))  # 3 full blocks of 4 and one token over


def _vk():
    """vLLM's ``kv_events`` module. pyproject's ``pythonpath = ["tests"]`` makes ``tests/vllm`` (the
    vLLM tier's package) shadow vLLM itself, so import it with ``tests/`` off the path; the real
    vLLM then stays imported (unit sessions never import the tier's package)."""
    shadow = sys.modules.get("vllm")
    if shadow is not None and not hasattr(shadow, "__version__"):
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
    tests_dir = Path(__file__).resolve().parents[2]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != tests_dir]
    try:
        return pytest.importorskip("vllm.distributed.kv_events")
    finally:
        sys.path[:] = saved


def _vllm_batch(vk, events, ts=1.5):
    return msgspec.msgpack.Encoder().encode(vk.KVEventBatch(ts=ts, events=events))


def _stored(vk, hashes, parent, tokens, medium="GPU"):
    return vk.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                          lora_id=None, medium=medium, lora_name=None)


def _router_hashes(tokens):
    return PromptHashCache(block_size=BS, model_id=MODEL).hashes(tokens)


def _decoded_as_published(decode, vk) -> tuple:
    payload = _vllm_batch(vk, [_stored(vk, [11, 12], None, PROMPT[:8]), _stored(vk, [b"\x0d" * 32], 12, PROMPT[8:12]),
                               vk.BlockRemoved(block_hashes=[11], medium="GPU"), vk.AllBlocksCleared()])
    return decode(payload)


def test_decoder_reads_vllm_msgspec_batches_and_a_broken_decoder_fails_the_same_check():
    from rayfleet.serving.vllm.kv_event_feed import decode_kv_event_batch

    vk = _vk()

    def check(batch) -> bool:
        a, b, c, d = batch.events
        return (batch.ts == 1.5 and a == BlockStored((11, 12), None, tuple(PROMPT[:8]), BS, None, "GPU")
                and b.block_hashes == (b"\x0d" * 32,) and b.parent_block_hash == 12
                and isinstance(c, BlockRemoved) and c.block_hashes == (11,) and d.cleared)

    assert check(_decoded_as_published(decode_kv_event_batch, vk))

    # Broken: a decoder that reads the events' maps by hand and forgets the parent link.
    def naive(payload):
        from rayfleet.serving.vllm.kv_event_feed import VLLMEventBatch
        ts, events = msgspec.msgpack.decode(payload)[:2]
        out = []
        for e in events:
            if e.get("type") == "BlockStored":
                out.append(BlockStored(tuple(e["block_hashes"]), None, tuple(e["token_ids"]), e["block_size"],
                                       e.get("lora_id"), e.get("medium")))
            elif e.get("type") == "BlockRemoved":
                out.append(BlockRemoved(tuple(e["block_hashes"]), e.get("medium")))
            else:
                out.append(AllBlocksCleared())
        return VLLMEventBatch(ts, tuple(out))

    assert not check(_decoded_as_published(naive, vk))
    with pytest.raises(msgspec.DecodeError):
        decode_kv_event_batch(b"\x93not a batch")


def test_mapper_gives_the_hashes_the_router_computes_from_prompt_tokens():
    mapper = TokenBlockMapper(model_id=MODEL, block_size=BS)
    # vLLM stores the prompt's blocks in two steps (chunked prefill), with its own salted hashes.
    out = mapper.map([BlockStored((901, 902), None, tuple(PROMPT[:8]), BS),
                      BlockStored((903,), 902, tuple(PROMPT[8:12]), BS)])
    router = _router_hashes(PROMPT)
    assert [h for e in out for h in e.stored] == list(router) and len(router) == 3
    assert mapper.cached() == frozenset(router)

    # Broken: hashing each event from the root (no parent chain) matches only the first event.
    def unchained(events):
        return [h for e in events for h in hash_full_blocks(e.token_ids, block_size=BS, root=root_block_hash(model_id=MODEL))]

    assert unchained([BlockStored((901, 902), None, tuple(PROMPT[:8]), BS),
                      BlockStored((903,), 902, tuple(PROMPT[8:12]), BS)]) != list(router)


def test_mapper_translates_removals_drops_unchainable_stores_and_reannouncements():
    mapper = TokenBlockMapper(model_id=MODEL, block_size=BS)
    router = _router_hashes(PROMPT)
    mapper.map([BlockStored((901, 902, 903), None, tuple(PROMPT[:12]), BS)])
    assert mapper.map([BlockStored((901,), None, tuple(PROMPT[:4]), BS)]) == []  # a reused block, re-announced
    assert mapper.map([BlockRemoved((903,))]) == [BlockRemoved((router[2],))]
    assert mapper.map([BlockRemoved((903,)), BlockRemoved((777,), medium="CPU")]) == []  # already gone / other tier
    assert mapper.map([BlockStored((905,), 999, (1, 2, 3, 4), BS)]) == [] and mapper.num_unchained == 1
    assert mapper.cached() == frozenset(router[:2])
    assert mapper.map([AllBlocksCleared()])[0].cleared and len(mapper) == 0
    # Broken: a mapper that ignores BlockRemoved keeps claiming the evicted block.
    assert router[2] in (frozenset(router) - frozenset()) and router[2] not in mapper.cached() | set(router[:2])


def test_two_vllm_hashes_of_the_same_tokens_share_one_router_hash_until_both_are_evicted():
    mapper = TokenBlockMapper(model_id=MODEL, block_size=BS)
    h = _router_hashes(PROMPT[:4])[0]
    mapper.map([BlockStored((1,), None, tuple(PROMPT[:4]), BS), BlockStored((2,), None, tuple(PROMPT[:4]), BS)])
    assert mapper.map([BlockRemoved((1,))]) == [] and mapper.cached() == {h}  # the other copy still serves it
    assert mapper.map([BlockRemoved((2,))]) == [BlockRemoved((h,))]


def _core_with(stats_by_replica) -> PoolRouterCore:
    core = PoolRouterCore(role="colocated", policy=RouterPolicy(load_weight=0.1), tokens_per_block=BS)
    for rid, stats in stats_by_replica.items():
        core.observe(rid, stats, now_s=0.0)
    return core


def _stats(log: HashLogPublisher, version: int) -> dict:
    return {"version": version, "num_total_blocks": 64, "num_free_blocks": 64, "num_active_blocks": 0,
            **log.fields(time.monotonic())}


def test_events_drive_the_router_an_evicted_block_stops_attracting_the_prompt():
    mapper = TokenBlockMapper(model_id=MODEL, block_size=BS)
    log_a, log_b = HashLogPublisher(), HashLogPublisher()
    log_a.apply(mapper.map([BlockStored((901, 902, 903), None, tuple(PROMPT[:12]), BS)]))
    hint = RouteHint(block_hashes=_router_hashes(PROMPT), num_prompt_blocks=4, num_blocks_needed=5)
    core = _core_with({"a": _stats(log_a, 1), "b": _stats(log_b, 1)})
    assert core.index.match_prefix(hint.block_hashes) == {"a": 3}
    assert core.rank(["b", "a"], hint)[0] == ["a"]

    # vLLM evicts the first block (LRU over a full cache): the prefix is gone from "a".
    log_a.apply(mapper.map([BlockRemoved((901,))]))
    core = _core_with({"a": _stats(log_a, 1), "b": _stats(log_b, 1)})
    assert core.index.match_prefix(hint.block_hashes) == {}
    # Broken variant: the text-block estimate (what an engine without events publishes) keeps
    # every block it served, so "a" would still claim the whole prefix.
    stale = _core_with({"a": {"version": 1, "num_total_blocks": 64, "num_free_blocks": 64, "num_active_blocks": 0,
                              "block_hashes": frozenset(hint.block_hashes)}})
    assert stale.index.match_prefix(hint.block_hashes) == {"a": 3}


def test_subscriber_receives_vllm_publisher_batches_over_a_private_ipc_socket():
    vk = _vk()
    from rayfleet.serving.vllm.kv_event_subscriber import KV_EVENTS_TOPIC, KVEventSubscriber, private_ipc_endpoint

    endpoint = private_ipc_endpoint()
    import os
    import stat

    assert endpoint.startswith("ipc://") and stat.S_IMODE(os.stat(os.path.dirname(endpoint[6:])).st_mode) == 0o700
    sub = KVEventSubscriber(endpoint, model_id=MODEL, block_size=BS)
    pub = vk.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic=KV_EVENTS_TOPIC)
    try:
        # ZMQ's slow joiner: a message sent before the subscription reached the publisher is lost
        # (vLLM's engine publishes only after it started, long after the replica connected);
        # here, probe with empty batches until one arrives.
        deadline = time.monotonic() + 60
        while sub.num_batches < 1 and time.monotonic() < deadline:
            pub.publish(vk.KVEventBatch(ts=0.0, events=[]))
            time.sleep(0.2)
        seen = sub.num_batches
        pub.publish(vk.KVEventBatch(ts=1.0, events=[_stored(vk, [1, 2], None, PROMPT[:8])]))
        pub.publish(vk.KVEventBatch(ts=2.0, events=[vk.BlockRemoved(block_hashes=[2], medium="GPU")]))
        while sub.num_batches < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = sub.drain()
    finally:
        pub.shutdown()
        sub.close()
    router = _router_hashes(PROMPT)
    assert [e.stored or e.removed for e in got] == [tuple(router[:2]), (router[1],)]
    assert sub.num_gaps == 0 and sub.num_errors == 0


def test_a_sequence_gap_clears_the_replica_instead_of_keeping_blocks_it_may_have_evicted():
    from rayfleet.serving.vllm.kv_event_subscriber import KVEventSubscriber
    vk = _vk()
    sub = KVEventSubscriber.__new__(KVEventSubscriber)  # its message handler alone, no thread
    sub.endpoint, sub.mapper = "test", TokenBlockMapper(model_id=MODEL, block_size=BS)
    import queue
    sub._out, sub._last_seq = queue.SimpleQueue(), None
    sub.num_batches = sub.num_events = sub.num_gaps = sub.num_errors = 0
    sub._on_message([b"kv", (0).to_bytes(8, "big"), _vllm_batch(vk, [_stored(vk, [1], None, PROMPT[:4])])])
    sub._on_message([b"kv", (2).to_bytes(8, "big"), _vllm_batch(vk, [_stored(vk, [5], None, PROMPT[4:8])])])
    events = sub.drain()
    assert sub.num_gaps == 1 and [e.cleared for e in events] == [False, True, False]
    log = HashLogPublisher()
    log.apply(events)
    assert log.cached == set(_router_hashes(PROMPT[4:8]))  # the block before the gap is not claimed
    # Broken: without the clear, the block published before the gap (maybe evicted since) stays.
    kept = HashLogPublisher()
    kept.apply([e for e in events if not e.cleared])
    assert _router_hashes(PROMPT[:4])[0] in kept.cached


class _Tokenizer:
    """A character tokenizer with a BOS (1) and a chat template, shaped like a Hugging Face one."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        assert not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


def test_router_prompt_tokens_are_what_vllm_caches_for_chat_and_completion_requests():
    from types import SimpleNamespace

    from rayfleet.serving.vllm.prompt_tokens import PromptTokenizer

    tok = PromptTokenizer(_Tokenizer())
    chat = SimpleNamespace(messages=[{"role": "user", "content": [{"type": "text", "text": "hello fleet"}]}])
    # vLLM renders the template and encodes it without special tokens (the template has them).
    engine_ids = _Tokenizer().encode("<user>hello fleet<assistant>", add_special_tokens=False)
    assert tok.token_ids(chat) == engine_ids
    assert tok.token_ids(SimpleNamespace(prompt="abc")) == [1, 97, 98, 99]  # completions: with BOS
    assert tok.token_ids(SimpleNamespace(prompt=[5, 6, 7])) == [5, 6, 7]
    assert tok.token_ids(SimpleNamespace(input=["x"])) is None

    # The replica's hashes (vLLM's stored blocks, mapped) match the router's for the chat prompt...
    mapper = TokenBlockMapper(model_id=MODEL, block_size=BS)
    n = len(engine_ids) // BS * BS
    mapper.map([BlockStored(tuple(range(1000, 1000 + n // BS)), None, tuple(engine_ids[:n]), BS)])
    assert set(_router_hashes(tok.token_ids(chat))) == mapper.cached()
    # ...and a broken tokenization (special tokens added to the rendered chat: one BOS shifts every
    # block) matches none of them.
    assert not set(_router_hashes(_Tokenizer().encode("<user>hello fleet<assistant>"))) & mapper.cached()


@pytest.mark.parametrize("fields, on", [
    ({}, True),
    ({"engine": {"kind": "vllm", "block_size": 32, "enable_prefix_caching": False}}, False),  # vLLM emits nothing
    ({"model": {"hf": "s3://bucket/m"}}, False),  # the ingress cannot load its tokenizer
    ({"vllm": {"device": "cpu", "request_router": "power_of_two"}}, False),  # Serve's LLMServer: no subscriber
    ({"mode": "disaggregated"}, False),
])
def test_kv_events_are_on_exactly_where_a_rayfleet_replica_subscribes_and_its_router_can_tokenize(fields, on):
    from rayfleet.serving.spec import ServeSpec
    from rayfleet.serving.vllm.config import KV_EVENTS_CONFIG, llm_config_fields, uses_kv_events

    base = {"engine": {"kind": "vllm", "block_size": 32}, "model": {"hf": "/models/tiny-moe"}, "vllm": {"device": "cpu"},
            **fields}
    spec = ServeSpec.parse(base)
    role = "colocated" if spec.mode == "colocated" else "decode"
    cfg = llm_config_fields(spec, role)
    assert uses_kv_events(spec, role) is on
    assert cfg["engine_kwargs"].get("kv_events_config") == (KV_EVENTS_CONFIG if on else None)
    router = (cfg["deployment_config"].get("request_router_config") or {}).get("request_router_kwargs", {})
    assert ("token_blocks" in router) is on
    # No endpoint in the shared config: each replica sets a private one (never vLLM's tcp://*:5557).
    assert "endpoint" not in KV_EVENTS_CONFIG
