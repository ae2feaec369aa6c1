"""KV cache tiers (engine pool -> node host memory -> disk), the global index and the tier policy.

The core property: greedy outputs of the real tiny model are identical whether a prompt's
prefix blocks come from the engine pool, host memory, disk, another node's tiers, or are
recomputed (no cache) -- and a lost pool, a stale index entry or a corrupt disk block turns
into a recompute, never into wrong tokens.
"""

from __future__ import annotations

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models import build_model, preset
from rayfleet.serving.engine.block_hash import BlockHash
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.kv.tier_connector import KVTierConnector
from rayfleet.serving.kv.host_pool import HostKVPool
from rayfleet.serving.kv.global_index import GlobalKVIndex, KVLocation
from rayfleet.serving.kv.tier_policy import KVTierPolicy, LoadRun
from rayfleet.serving.kv.tiers import KVBlockData, NodeKVTiers, Tier
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.storage.kv_disk import _HEADER, DiskKVStore

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144]  # 3 full blocks of 4 can be hit
FILLERS = [[200 + i] * 40 for i in range(2)]  # 46 tokens each with outputs: the whole 12-block pool


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def _block(value: float, *, dtype=torch.float32) -> KVBlockData:
    return KVBlockData(torch.full((3, 4, 2, 32), value, dtype=dtype), torch.full((3, 4, 2, 32), -value, dtype=dtype))


@pytest.fixture(scope="module")
def model():
    """The tiny preset with init_std 0.1 instead of 0.02. At 0.02 its attention is so flat that
    greedy tokens do not depend on the prefix at all (checked below), so a test of "the loaded
    KV is the right KV" would pass with wrong KV; at 0.1 the prefix decides the tokens."""
    return build_model(preset("tiny", max_seq_len=256, init_std=0.1), seed=3, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def reference(model, greedy_reference):
    other_prefix = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] + PROMPT[-1:]
    ref = greedy_reference(model, PROMPT, GREEDY.max_tokens)
    assert ref != greedy_reference(model, other_prefix, GREEDY.max_tokens), "the prefix must matter"
    return ref


def _engine(model, node, *, index=None, peers=None, prefetch_window=8, **config) -> LLMEngine:
    config = {"block_size": 4, "num_blocks": 12, "max_num_batched_tokens": 64, **config}
    connector = KVTierConnector(node, index=index, peers=peers, policy=KVTierPolicy(prefetch_window=prefetch_window))
    return LLMEngine(model, EngineConfig(**config), kv_tiers=connector)


def _run(engine: LLMEngine, prompt=PROMPT):
    (result,) = engine.generate([prompt], GREEDY)
    return result


def _fill_and_evict(engine: LLMEngine) -> None:
    """Run the prompt, then fillers that need every block: the prompt's blocks are evicted."""
    for filler in FILLERS:
        _run(engine, filler)


def _prompt_hashes(engine: LLMEngine) -> list[BlockHash]:
    return engine.block_hashes_of(PROMPT)[:3]


# -- pure parts ---------------------------------------------------------------------------------


def test_policy_worked_example():
    E, H, D = Tier.ENGINE, Tier.HOST, Tier.DISK
    waiting = [(E, E, H, H, None), (H, D, D, D), (D, H, None)]
    decision = KVTierPolicy(prefetch_window=1).decide(waiting, num_free_blocks=5, num_reserved_blocks=1,
                                                      admit_window=2)
    assert decision.loads == (LoadRun(0, 4), LoadRun(1, 2))
    assert decision.prefetch == ((1, 2), (1, 3), (2, 0))
    # Nothing to load when the run is already engine-resident; nothing at all with no budget.
    assert KVTierPolicy().decide([(E, E)], num_free_blocks=9, num_reserved_blocks=0, admit_window=1).is_empty
    starved = KVTierPolicy(prefetch_window=0).decide(waiting, num_free_blocks=3, num_reserved_blocks=3,
                                                     admit_window=2)
    assert starved.loads == (LoadRun(0, 2),) or starved.loads == ()
    assert all(load.num_blocks <= 2 for load in starved.loads)


def test_host_pool_lru_order_and_capacity():
    pool = HostKVPool(2)
    assert pool.put(_h(1), "a") == [] and pool.put(_h(2), "b") == []
    assert pool.get(_h(1)) == "a"  # 1 is now the most recently used
    assert pool.put(_h(3), "c") == [(_h(2), "b")]
    assert pool.put(_h(1), "ignored") == [] and pool.get(_h(1)) == "a"  # immutable blocks
    assert pool.keys() == [_h(3), _h(1)] and len(pool) == 2
    assert HostKVPool(0).put(_h(9), "x") == [(_h(9), "x")]  # capacity 0: pass-through
    with pytest.raises(SpecError, match="host_blocks"):
        HostKVPool(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_block_bytes_round_trip(dtype):
    block = KVBlockData(torch.randn(3, 4, 2, 8).to(dtype), torch.randn(3, 4, 2, 8).to(dtype))
    back = KVBlockData.from_bytes(block.to_bytes())
    assert back.k.dtype == dtype and torch.equal(back.k, block.k) and torch.equal(back.v, block.v)
    with pytest.raises(ValueError):
        KVBlockData.from_bytes(block.to_bytes()[:-2])


def test_a_pickled_block_carries_its_own_bytes_not_the_buffer_it_views():
    """Write-back copies many evicted blocks out at once and sends each as a view of that copy;
    Ray pickles what it sends. Before the fix each block shipped the whole buffer (90x)."""
    import pickle

    k, v = torch.randn(4, 90, 16, 2, 64), torch.randn(4, 90, 16, 2, 64)
    blocks = [KVBlockData(k[:, i], v[:, i]) for i in range(90)]
    data = pickle.dumps(blocks)
    assert len(data) < 1.1 * sum(b.nbytes for b in blocks)  # 5.9 MB; views would be 531 MB
    back = pickle.loads(data)
    assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(blocks, back))
    read = KVBlockData.from_bytes(blocks[0].to_bytes())  # K and V halves of one buffer
    assert len(pickle.dumps(read)) < 1.1 * read.nbytes


@pytest.mark.parametrize("uri_kind", ["local", "memory"])
def test_disk_store_atomic_lru_capacity_and_restart(tmp_path, uri_kind):
    uri = str(tmp_path / "kv") if uri_kind == "local" else f"memory://kv-test-{tmp_path.name}"
    store = DiskKVStore(uri, capacity_blocks=2)
    assert store.put(b"a" * 16, b"A") == [] and store.put(b"b" * 16, b"B") == []
    assert store.get(b"a" * 16) == b"A"  # a is now the most recently used
    assert store.put(b"c" * 16, b"C") == [b"b" * 16]  # LRU goes; the disk tier is the last one
    assert store.get(b"b" * 16) is None and len(store) == 2
    files = [p for p in store.fs.find(store.root)]
    assert len(files) == 2 and not any(".tmp-" in p for p in files)  # no temp file survives a write
    assert store.take_removed() == [b"b" * 16]
    # A new process adopts the files (and the capacity) of the old one.
    again = DiskKVStore(uri, capacity_blocks=1)
    assert len(again) == 1 and len(again.fs.find(again.root)) == 1
    if uri_kind == "memory":
        store.fs.rm(store.root, recursive=True)


def test_disk_store_detects_corruption(tmp_path):
    store = DiskKVStore(str(tmp_path), capacity_blocks=4)
    payload = _block(1.5).to_bytes()
    store.put(b"k" * 16, payload)
    path = store._path(b"k" * 16)
    frame = bytearray(open(path, "rb").read())
    frame[_HEADER.size + 100] ^= 0x40  # one flipped bit inside the K tensor
    open(path, "wb").write(bytes(frame))
    # The broken variant: without the checksum the flipped bit would be served as KV.
    assert not torch.equal(KVBlockData.from_bytes(bytes(frame[_HEADER.size:])).k, _block(1.5).k)
    assert store.get(b"k" * 16) is None and store.num_corrupt == 1 and b"k" * 16 not in store
    # Wrong name, truncated file: also misses.
    store.put(b"m" * 16, payload)
    open(store._path(b"m" * 16), "wb").write(frame[:50])
    assert store.get(b"m" * 16) is None and store.num_corrupt == 2


def test_node_tiers_write_back_order_and_capacity(tmp_path):
    node = NodeKVTiers("n0", host_blocks=2, disk_uri=str(tmp_path), disk_blocks=3)
    node.put_many([(_h(i), _block(i)) for i in range(4)])  # 0, 1 overflow host memory to disk
    assert node.host.keys() == [_h(2), _h(3)] and node.disk.keys() == [_h(0), _h(1)]
    node.put_many([(_h(4), _block(4)), (_h(5), _block(5))])  # 2 then 3 go down; disk drops 0
    assert node.host.keys() == [_h(4), _h(5)] and node.disk.keys() == [_h(1), _h(2), _h(3)]
    assert node.lookup([_h(0), _h(1), _h(5)]) == [None, Tier.DISK, Tier.HOST]
    (hit,) = node.get_many([_h(2)])  # a disk hit is promoted to host memory (4 goes to disk)
    assert hit.tier is Tier.DISK and torch.equal(hit.block.k, _block(2).k)
    assert node.host.keys() == [_h(5), _h(2)] and len(node.disk) == 3 and _h(4) in node.disk
    stats = node.stats()
    assert stats.num_host_blocks <= 2 and stats.num_disk_blocks <= 3 and stats.disk_hits == 1
    index = GlobalKVIndex()
    index.apply_tier_events(node.take_events())
    index.check_consistency()
    assert {h for loc in index.locations() for h in [loc]} == {KVLocation("n0", Tier.HOST), KVLocation("n0", Tier.DISK)}
    assert set(index._location_to_hashes[KVLocation("n0", Tier.HOST)]) == set(node.host.keys())
    assert set(index._location_to_hashes[KVLocation("n0", Tier.DISK)]) == set(map(BlockHash, node.disk.keys()))


def test_index_match_prefix_and_loss():
    index = GlobalKVIndex()
    a_host, b_disk, r0 = KVLocation("a", Tier.HOST), KVLocation("b", Tier.DISK), KVLocation("a", Tier.ENGINE, "r0")
    index.add(a_host, [_h(1), _h(2), _h(3)])
    index.add(b_disk, [_h(1), _h(3)])
    index.add(r0, [_h(1), _h(2)])
    assert index.match_prefix([_h(1), _h(2), _h(3), _h(4)]) == {a_host: 3, b_disk: 1, r0: 2}
    assert index.locate(_h(1)) == [r0, a_host, b_disk]  # fastest tier first
    assert index.remove_replica("r0") == 2 and index.remove_node("a") == 3
    index.check_consistency()
    assert index.locations() == [b_disk] and index.num_entries == 2


# -- the engine with tiers: outputs identical from every source ----------------------------------


def test_outputs_identical_from_engine_host_disk_peer_and_no_cache(model, reference, tmp_path):
    no_cache = LLMEngine(model, EngineConfig(block_size=4, num_blocks=12, enable_prefix_caching=False))
    assert list(_run(no_cache).output_token_ids) == reference

    # Engine pool: the second run hits the pool itself.
    node = NodeKVTiers("a", host_blocks=64)
    first = _engine(model, node)
    assert _run(first).num_cached_tokens == 0
    engine_hit = _run(first)
    assert engine_hit.num_cached_tokens == 12 and list(engine_hit.output_token_ids) == reference

    # Host memory: the blocks were evicted from replica 1's pool; replica 2 on the node loads them.
    _fill_and_evict(first)
    assert all(node.lookup(_prompt_hashes(first)))
    second = _engine(model, node)
    host_hit = _run(second)
    assert host_hit.num_cached_tokens == 12 and list(host_hit.output_token_ids) == reference
    assert second.kv_tiers.stats().loaded_from_host == 3

    # Disk: host memory of 2 blocks pushes the prompt's blocks down to disk.
    disk_node = NodeKVTiers("b", host_blocks=2, disk_uri=str(tmp_path / "disk"), disk_blocks=64)
    writer = _engine(model, disk_node)
    _run(writer)
    _fill_and_evict(writer)
    assert disk_node.lookup(_prompt_hashes(writer)) == [Tier.DISK] * 3
    reader = _engine(model, disk_node)
    disk_hit = _run(reader)
    assert disk_hit.num_cached_tokens == 12 and list(disk_hit.output_token_ids) == reference
    assert reader.kv_tiers.stats().loaded_from_disk == 3 and reader.kv_tiers.stats().loaded_from_host == 0

    # Another node's tiers, found through the global index.
    index = GlobalKVIndex()
    index.apply_tier_events(node.take_events())
    peers = {"a": node}
    remote = _engine(model, NodeKVTiers("c", host_blocks=8), index=index, peers=peers.get)
    peer_hit = _run(remote)
    assert peer_hit.num_cached_tokens == 12 and list(peer_hit.output_token_ids) == reference
    assert remote.kv_tiers.stats().loaded_from_peers == 3
    for engine in (first, second, writer, reader, remote):
        assert engine.block_pool.num_free_blocks == 12  # nothing leaked by loads


def test_engine_write_back_is_tail_first_and_bounded(model, tmp_path):
    node = NodeKVTiers("a", host_blocks=3, disk_uri=str(tmp_path), disk_blocks=5)
    engine = _engine(model, node)
    result = _run(engine)
    full = engine.block_hashes_of(list(PROMPT) + list(result.output_token_ids))  # 19 tokens: 4 full blocks
    assert len(full) == 4 and not node.host.keys()  # nothing written back before an eviction
    engine.generate([[250] * 47], SamplingParams(max_tokens=1, temperature=0))  # all 12 blocks
    # The request freed its blocks tail first, so its tail was evicted (and written back) first;
    # host memory (3 blocks) keeps the head of the chain, the overflow went to disk in order.
    written = [h for h in node.host.keys() + list(map(BlockHash, node.disk.keys())) if h in full]
    assert node.disk.keys() == [full[3]] and node.host.keys() == [full[2], full[1], full[0]]
    assert written and engine.kv_tiers.stats().written_back == 4
    _fill_and_evict(engine)
    assert len(node.host) <= 3 and len(node.disk) <= 5 and len(node.disk.fs.find(node.disk.root)) <= 5


def test_corrupt_disk_block_is_recomputed_not_served(model, reference, tmp_path):
    node = NodeKVTiers("a", host_blocks=0, disk_uri=str(tmp_path), disk_blocks=64)
    writer = _engine(model, node)
    _run(writer)
    _fill_and_evict(writer)
    hashes = _prompt_hashes(writer)
    assert node.lookup(hashes) == [Tier.DISK] * 3
    path = node.disk._path(hashes[1])
    frame = bytearray(open(path, "rb").read())
    for i in range(_HEADER.size, len(frame), 7):  # scramble block 1's K/V
        frame[i] ^= 0x5A
    open(path, "wb").write(bytes(frame))
    reader = _engine(model, node)
    result = _run(reader)
    assert list(result.output_token_ids) == reference
    assert result.num_cached_tokens == 4  # block 0 loaded, block 1 corrupt: the rest recomputed
    assert node.stats().num_corrupt == 1 and reader.kv_tiers.stats().load_failures == 1


def test_killed_host_pool_keeps_index_consistent_and_requests_succeed(model, reference):
    a, b = NodeKVTiers("a", host_blocks=64), NodeKVTiers("b", host_blocks=64)
    index = GlobalKVIndex()
    peers = {"a": a, "b": b}
    on_a = _engine(model, a, index=index, peers=peers.get)
    _run(on_a)
    _fill_and_evict(on_a)
    index.apply_tier_events(a.take_events())
    index.apply_engine_events("a", "replica-a", [])
    assert index.num_blocks_at(KVLocation("a", Tier.HOST)) > 0

    a.shutdown()  # node a's host pool dies; nobody has told the index yet (stale entries)
    on_b = _engine(model, b, index=index, peers=peers.get)
    result = _run(on_b)
    assert list(result.output_token_ids) == reference and result.num_cached_tokens == 0
    index.check_consistency()
    assert all(loc.node_id != "a" for loc in index.locations())  # the failed read dropped node a
    # The replica on node a has lost its node tiers too: it still serves, recomputing.
    again = _run(on_a)
    assert list(again.output_token_ids) == reference
    assert on_a.block_pool.num_free_blocks == 12 and on_b.block_pool.num_free_blocks == 12
    # Explicit loss (what the actor shell does when it sees the node die) is consistent as well.
    _fill_and_evict(on_b)
    index.apply_tier_events(b.take_events())
    assert index.remove_node("b") > 0 and index.num_entries == 0
    index.check_consistency()


def test_queued_requests_prefetch_disk_blocks_into_host_memory(model, reference, tmp_path):
    writer = _engine(model, NodeKVTiers("a", host_blocks=0, disk_uri=str(tmp_path), disk_blocks=64))
    _run(writer)
    _fill_and_evict(writer)
    # The node's pool restarts: host memory is empty, the disk files are adopted.
    node = NodeKVTiers("a", host_blocks=16, disk_uri=str(tmp_path), disk_blocks=64)
    hashes = _prompt_hashes(writer)
    assert node.lookup(hashes) == [Tier.DISK] * 3
    # One sequence at a time: the second request waits while the first (a long one) runs.
    engine = _engine(model, node, max_num_seqs=1)
    engine.add_request("long", [240] * 30, SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("queued", PROMPT, GREEDY)
    engine.step()  # admits "long"; "queued" is in the prefetch window
    engine.kv_tiers.wait_for_prefetch()
    assert node.lookup(hashes) == [Tier.HOST] * 3 and node.stats().num_prefetched == 3
    outputs: dict[str, list[int]] = {"long": [], "queued": []}
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    assert outputs["queued"] == reference and cached["queued"] == 12
    assert engine.kv_tiers.stats().loaded_from_host == 3 and engine.kv_tiers.stats().loaded_from_disk == 0


def test_control_wrong_kv_under_the_right_hash_changes_tokens(model, reference):
    """The broken variant the tests above guard against: a tier that serves other KV under the
    prompt's hashes. The engine trusts the hash, so the tokens change."""
    node = NodeKVTiers("a", host_blocks=64)
    writer = _engine(model, node)
    _run(writer)
    _fill_and_evict(writer)
    for h in _prompt_hashes(writer):
        block = node.host.remove(h)
        node.host.put(h, KVBlockData(block.k * 0.5, block.v.flip(1)))
    result = _run(_engine(model, node))
    assert result.num_cached_tokens == 12 and list(result.output_token_ids) != reference


def test_tiers_need_prefix_caching(model):
    with pytest.raises(SpecError, match="enable_prefix_caching"):
        LLMEngine(model, EngineConfig(block_size=4, num_blocks=8, enable_prefix_caching=False),
                  kv_tiers=KVTierConnector(NodeKVTiers("a", host_blocks=4)))


def test_serve_spec_kv_cache_field_and_errors(tmp_path):
    from rayfleet.serving.spec import ServeSpec

    spec = ServeSpec.parse({"kv_cache": {"host_blocks": 1024, "disk": {"uri": str(tmp_path), "blocks": 4096}}})
    assert spec.kv_cache.enabled and spec.kv_cache.disk.blocks == 4096
    assert not ServeSpec.parse({}).kv_cache.enabled
    with pytest.raises(SpecError, match=r"kv_cache.disk.blocks=8: .*Fix: raise disk.blocks to at least 64"):
        ServeSpec.parse({"kv_cache": {"host_blocks": 64, "disk": {"uri": str(tmp_path), "blocks": 8}}})
    with pytest.raises(SpecError, match=r"kv_cache.disk.uri='nope://x'.*protocol 'nope'"):
        ServeSpec.parse({"kv_cache": {"disk": {"uri": "nope://x", "blocks": 8}}})
    with pytest.raises(SpecError, match=r"kv_cache.host_blocks=-1"):
        ServeSpec.parse({"kv_cache": {"host_blocks": -1}})
