"""Per-rank loading: each rank's tensors equal the matching slice of the full load, and the
reader fetches only that rank's bytes along dim 0 (counted through a wrapping source)."""

from __future__ import annotations

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models.hf import from_hf_config, load_hf_weights
from rayfleet.models.hf.sharding import layout_shard_fn
from rayfleet.storage.safetensors_io import HFCheckpoint
from tests.unit.models.hf_fixtures import save_tiny

pytest.importorskip("transformers")


class CountingSource:
    """An HFCheckpoint that counts the elements it returns (what a rank actually read)."""

    def __init__(self, inner: HFCheckpoint) -> None:
        self.inner, self.elements = inner, 0

    def keys(self):
        return self.inner.keys()

    def shape(self, name):
        return self.inner.shape(name)

    def get(self, name, **kw):
        t = self.inner.get(name, **kw)
        self.elements += t.numel()
        return t


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("shard"))
    ckpt = HFCheckpoint(str(path))
    return ckpt, from_hf_config(ckpt.config)


def test_worked_example_tp2_ep4_boxes(qwen_moe):
    _, spec = qwen_moe  # 8 experts of width 32, dim 64, 4 heads of 16, dense layer 0 of width 96
    shard = layout_shard_fn(spec.config, tp_rank=1, tp=2, ep_rank=3, ep=4)
    assert shard("layers.1.feed_forward.experts.w1", (8, 32, 64)) == ((6, 8), (0, 32), (0, 64))
    assert shard("layers.0.attention.wq.weight", (64, 64)) == ((32, 64), (0, 64))
    assert shard("layers.0.attention.wo.weight", (64, 64)) == ((0, 64), (32, 64))
    assert shard("layers.0.feed_forward.w2.weight", (64, 96)) == ((0, 64), (48, 96))
    assert shard("layers.0.attention.q_norm.weight", (16,)) is None  # per-head norm: replicated
    assert shard("layers.1.feed_forward.router.weight", (8, 64)) is None


@pytest.mark.parametrize("tp, ep", [(1, 4), (2, 2), (4, 1)])
def test_every_rank_gets_exactly_its_slice_of_the_full_load(qwen_moe, tp, ep):
    ckpt, spec = qwen_moe
    full = load_hf_weights(spec, ckpt)
    full_elements = sum(t.numel() for t in full.values())
    for rank in range(tp * ep):
        source = CountingSource(ckpt)
        shard = layout_shard_fn(spec.config, tp_rank=rank % tp, tp=tp, ep_rank=rank // tp, ep=ep)
        part = load_hf_weights(spec, source, shard=shard)
        assert set(part) == set(full)
        for name, tensor in part.items():
            box = shard(name, tuple(full[name].shape))
            expected = full[name]
            for dim, (lo, hi) in enumerate(box or ()):
                expected = expected.narrow(dim, lo, hi - lo)
            assert torch.equal(tensor, expected), name
        # Dim-0 reads are exact, so a rank reads less than the whole checkpoint.
        assert source.elements < full_elements


def test_a_degree_that_does_not_divide_is_refused(qwen_moe):
    _, spec = qwen_moe
    with pytest.raises(SpecError, match="num_experts=8"):
        layout_shard_fn(spec.config, ep_rank=0, ep=3)("layers.1.feed_forward.experts.w1", (8, 32, 64))
