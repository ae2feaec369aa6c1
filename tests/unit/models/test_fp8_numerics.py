"""FP8 quantization and GEMMs against float64 references; the unscaled cast must fail."""

from __future__ import annotations

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models.fp8 import (BLOCK_128x128, E4M3, E5M2, FP8_MAX, RECIPES, ROWWISE, TENSORWISE,
                                 TILE_1x128, DelayedScalingState, Fp8Recipe, dequantize, fp8_grouped_mm,
                                 fp8_mm, quantize, unscaled_cast_control)

BOUND = 0.08  # relative Frobenius error of one FP8 GEMM (E4M3 ~4%, E5M2 grads ~6%)
CASES = {**RECIPES, "unscaled-cast": unscaled_cast_control()}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref).norm() / ref.norm())


def linear_errors(recipe: Fp8Recipe, *, use_scaled_mm: bool = True) -> tuple[float, float, float]:
    """Forward, input-grad and weight-grad errors of one FP8 linear against float64."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 256, 256, 192
    x64 = torch.randn(m, k, generator=gen, dtype=torch.float64)
    w64 = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.02  # init-scale weights
    g64 = torch.randn(m, n, generator=gen, dtype=torch.float64) * 1e-4  # gradient-scale values
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    state = DelayedScalingState(1, recipe.amax_history_len) if recipe.scaling == "delayed" else None
    for _ in range(2):  # twice: delayed scaling uses the history on the second step
        x.grad = w.grad = None
        out = fp8_grouped_mm(x, w[None], [m], recipe=recipe, state=state, use_scaled_mm=use_scaled_mm)
        out.backward(g64.float())
    return rel(out, x64 @ w64.T), rel(x.grad, g64 @ w64), rel(w.grad, g64.T @ x64)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_is_within_the_bound_of_float64(name):
    errors = linear_errors(RECIPES[name])
    assert max(errors) <= BOUND, errors
    assert min(errors) > 1e-3  # it really quantized


def test_unscaled_cast_fails_the_same_bound():
    errors = linear_errors(unscaled_cast_control())
    assert max(errors) > BOUND, errors  # gradients (~1e-4) flush to zero without a scale


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_scaled_mm_and_emulated_path_agree(name):
    recipe = RECIPES[name]
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(48, 96, generator=gen), torch.randn(80, 96, generator=gen)
    qa, _ = quantize(a, block=recipe.input_block)
    qb, _ = quantize(b, block=recipe.weight_block)
    real = fp8_mm(qa, qb, use_scaled_mm=True)
    emulated = fp8_mm(qa, qb, use_scaled_mm=False)
    torch.testing.assert_close(real, emulated, rtol=1e-5, atol=1e-5)
    # and through the whole autograd function
    assert linear_errors(recipe, use_scaled_mm=True) == pytest.approx(
        linear_errors(recipe, use_scaled_mm=False), rel=1e-4)


@pytest.mark.parametrize("block,scale_shape", [(TENSORWISE, (3, 1, 1)), (ROWWISE, (3, 200, 1)),
                                               (TILE_1x128, (3, 200, 3)), (BLOCK_128x128, (3, 2, 3))])
def test_scale_grids_and_padding_for_non_multiple_dims(block, scale_shape):
    x = torch.randn(3, 200, 300)
    q, amax = quantize(x, block=block)
    assert q.scale.shape == scale_shape == amax.shape
    assert q.data.dtype == E4M3 and q.data.shape == x.shape
    assert float(q.data.float().abs().max()) <= FP8_MAX[E4M3]
    assert rel(dequantize(q), x.double()) < 0.04


def test_finer_granularity_survives_outlier_rows():
    x = torch.randn(64, 256)
    x[0] *= 1e6  # one outlier token: tensorwise flushes every other row towards zero
    errors = {}
    for name, block in (("tensor", TENSORWISE), ("row", ROWWISE), ("tile", TILE_1x128)):
        q, _ = quantize(x, block=block)
        errors[name] = rel(dequantize(q)[1:], x[1:].double())
    assert errors["row"] < 0.04 and errors["tile"] < 0.04 and errors["tensor"] > 0.2


def test_transposed_square_blocks_are_still_valid_quantizations():
    w = torch.randn(256, 384)
    q, _ = quantize(w, block=BLOCK_128x128)
    torch.testing.assert_close(dequantize(q.t()), dequantize(q).t())


def test_delayed_scaling_uses_the_history_and_saturates_on_growth():
    recipe = RECIPES["delayed"]
    state = DelayedScalingState(1, 4)
    w = torch.randn(1, 16, 32)
    x = torch.randn(8, 32)
    fp8_grouped_mm(x, w, [8], recipe=recipe, state=state)
    assert float(state.x.history[0]) == pytest.approx(float(x.abs().max()))
    big = x * 100
    out = fp8_grouped_mm(big, w, [8], recipe=recipe, state=state)
    # the scale came from the old (100x smaller) amax, so the big input saturates
    assert rel(out, big.double() @ w[0].double().T) > 0.5
    assert float(state.x.history[0]) == pytest.approx(float(big.abs().max()))
    assert float(state.x.history[1]) == pytest.approx(float(x.abs().max()))


def test_grouped_fp8_equals_per_group_fp8():
    recipe = RECIPES["rowwise"]
    x = torch.randn(20, 64)
    w = torch.randn(3, 32, 64)
    sizes = [5, 0, 15]
    out = fp8_grouped_mm(x, w, sizes, recipe=recipe)
    parts = [fp8_grouped_mm(x[:5], w[0:1], [5], recipe=recipe),
             fp8_grouped_mm(x[5:], w[2:3], [15], recipe=recipe)]
    torch.testing.assert_close(out, torch.cat(parts))


def test_recipe_validation():
    with pytest.raises(SpecError, match="scaling"):
        Fp8Recipe("bad", ROWWISE, ROWWISE, scaling="delayed")
    with pytest.raises(SpecError):
        quantize(torch.randn(2, 2), dtype=torch.bfloat16)
    assert RECIPES["tensorwise"].grad_dtype == E5M2 and RECIPES["blockwise"].grad_dtype == E4M3
    assert "unscaled" not in " ".join(RECIPES)


@pytest.mark.parametrize("kernel_seconds, expected", [(0.0, True), (0.2, False)])
def test_models_skip_a_reference_scaled_mm_kernel(monkeypatch, kernel_seconds, expected):
    """oneDNN's reference FP8 matmul (some CPUs) was 800x slower than the emulated GEMM: models
    converted there must take the emulated path; a kernel at speed keeps ``_scaled_mm``."""
    import time

    from rayfleet.models.fp8 import convert_to_fp8, scaled_mm_fast
    from rayfleet.models.fp8.numerics import scaled_mm_supported
    from rayfleet.models import build_model, preset

    def kernel(a, b, *, scale_a, scale_b, out_dtype, **_):  # b arrives transposed, as the real one's
        time.sleep(kernel_seconds)
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", kernel)
    scaled_mm_fast.cache_clear()
    try:
        assert scaled_mm_supported("cpu", False)
        assert scaled_mm_fast("cpu") is expected
        report = convert_to_fp8(build_model(preset("tiny"), seed=0), "tensorwise")
        assert report.gemm == ("scaled_mm" if expected else "emulated")
    finally:
        scaled_mm_fast.cache_clear()


def test_the_torch_free_recipe_names_are_the_recipes():
    from rayfleet.models.fp8 import RECIPE_NAMES

    assert sorted(RECIPE_NAMES) == sorted(RECIPES)
