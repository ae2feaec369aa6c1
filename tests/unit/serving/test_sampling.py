"""Sampler: greedy is argmax and draws nothing; top-k/top-p keep the right tokens; seeds repeat."""

from __future__ import annotations

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.serving.engine.sampling import SamplingParams, _filter_logits, sample_tokens


def test_greedy_is_argmax_and_leaves_the_generator_alone():
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample_tokens(logits, [SamplingParams(temperature=0)] * 2, [gen, gen]) == [1, 0]
    assert torch.equal(gen.get_state(), state)


def test_top_p_and_top_k_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: (_filter_logits(logits, **kw) > float("-inf")).tolist()  # noqa: E731
    assert kept(top_k=0, top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(top_k=0, top_p=0.81) == [True, True, True, False]
    assert kept(top_k=0, top_p=0.1) == [True, False, False, False]  # the top token always stays
    assert kept(top_k=3, top_p=1.0) == [True, True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_top_p_that_underflows_the_dtype_still_keeps_the_top_token(dtype):
    """top_p=1e-308 is 0.0 in float32 (the fuzz test found it: every token dropped, NaN
    probabilities, a 500); the nucleus keeps the top token and sampling draws it."""
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15])).to(dtype)
    kept = (_filter_logits(logits, top_k=0, top_p=1e-308) > float("-inf")).tolist()
    assert kept == [False, True, False, False]
    params = [SamplingParams(temperature=1.0, top_p=1e-308)]
    assert sample_tokens(logits[None], params, [torch.Generator().manual_seed(0)]) == [1]


def test_same_seed_same_tokens():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0)]
    draw = lambda seed: [sample_tokens(logits, params, [g])[0]  # noqa: E731
                         for g in [torch.Generator().manual_seed(seed)] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_k", -1), ("stop", ("",))])
def test_bad_params_are_spec_errors(field, value):
    with pytest.raises(SpecError, match=field):
        SamplingParams(**{field: value})
    assert SamplingParams(stop="END").stop == ("END",)
