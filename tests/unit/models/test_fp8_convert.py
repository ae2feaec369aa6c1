"""Converters: what gets FP8 and, above all, what never does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rayfleet.models.fp8.functional as fp8_functional
import rayfleet.models.fp8.numerics as fp8_numerics
from rayfleet.errors import SpecError
from rayfleet.models import MoETransformer, RMSNorm, Router, build_model, materialize, preset
from rayfleet.models.fp8 import (RECIPES, Fp8GroupedExperts, Fp8Linear, convert_to_fp8,
                                 unscaled_cast_control)

TOKENS = torch.randint(0, 259, (2, 17), generator=torch.Generator().manual_seed(0))


def train_step(model: MoETransformer) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(TOKENS[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), TOKENS[:, 1:].flatten())
    loss.backward()
    return loss


def test_converts_exactly_the_allowlisted_gemms_and_keeps_parameters():
    model = build_model(preset("tiny"), seed=0)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    report = convert_to_fp8(model, "tensorwise")
    expected = set()
    for i, layer in enumerate(model.layers):
        expected |= {f"layers.{i}.attention.{p}" for p in ("wq", "wk", "wv", "wo")}
        if i < preset("tiny").num_dense_layers:
            expected |= {f"layers.{i}.feed_forward.{p}" for p in ("w1", "w2", "w3")}
        else:
            expected |= {f"layers.{i}.feed_forward.experts"}
            expected |= {f"layers.{i}.feed_forward.shared_experts.{p}" for p in ("w1", "w2", "w3")}
    assert set(report.converted) == expected
    # torch 2.13 CPU runs real FP8 GEMMs, unless this CPU only has oneDNN's reference kernel
    assert report.gemm == ("scaled_mm" if fp8_numerics.scaled_mm_fast("cpu") else "emulated")
    assert list(model.state_dict()) == keys  # checkpoints are interchangeable with BF16
    assert all(p is before[n] for n, p in model.named_parameters())


def test_router_norms_embeddings_and_head_never_see_fp8():
    model = build_model(preset("tiny"), seed=0)
    # A filter admitting everything cannot widen the allowlist.
    convert_to_fp8(model, "blockwise", module_filter=lambda fqn: True)
    high_precision = {"tok_embeddings": model.tok_embeddings, "output": model.output, "norm": model.norm}
    for name, module in model.named_modules():
        if isinstance(module, (Router, RMSNorm)):
            high_precision[name] = module
    unconverted = build_model(preset("tiny"), device="meta")  # the classes before any conversion
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is type(unconverted.tok_embeddings)
    assert not any(isinstance(m, (Fp8Linear, Fp8GroupedExperts)) for m in high_precision.values())

    seen = []

    def check(module, args, output):
        tensors = [t for t in (*args, *(output if isinstance(output, tuple) else (output,)),
                               *module.parameters(recurse=False)) if isinstance(t, torch.Tensor)]
        seen.append(module)
        assert all(t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors)

    for module in high_precision.values():
        module.register_forward_hook(check)
    # Spy on the one quantize entry point: no high-precision parameter may pass through it.
    protected = {p.data_ptr() for m in high_precision.values() for p in m.parameters()}
    quantized_ptrs = []
    real_quantize = fp8_functional.quantize

    def spy(x, **kwargs):
        quantized_ptrs.append(x.data_ptr())
        return real_quantize(x, **kwargs)

    fp8_functional.quantize = spy
    try:
        train_step(model)
    finally:
        fp8_functional.quantize = real_quantize
    assert len(seen) == len(high_precision)  # every hook fired
    assert quantized_ptrs and not protected & set(quantized_ptrs)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_trains_a_step_close_to_bf16(name):
    reference = build_model(preset("tiny"), seed=0)
    ref_loss = train_step(reference)
    model = build_model(preset("tiny"), seed=0)
    convert_to_fp8(model, name)
    loss = train_step(model)
    assert abs(loss.item() / ref_loss.item() - 1) < 0.01
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        if q.grad.norm() > 0:
            assert float((p.grad - q.grad).norm() / q.grad.norm()) < 0.3, n


def test_unscaled_control_loses_the_gradients():
    model = build_model(preset("tiny"), seed=0)
    convert_to_fp8(model, unscaled_cast_control())
    train_step(model)
    assert float(model.layers[0].attention.wq.weight.grad.abs().max()) == 0.0


def test_convert_on_meta_then_materialize_resets_delayed_state():
    model = build_model(preset("tiny"), device="meta")
    report = convert_to_fp8(model, "delayed")
    assert report.gemm == "emulated"  # nothing to probe on meta; callers pass use_scaled_mm
    materialize(model, device="cpu", seed=0)
    histories = [b for n, b in model.named_buffers() if n.endswith("history")]
    assert histories and all(float(h.abs().sum()) == 0 for h in histories)
    assert torch.isfinite(train_step(model))


def test_converting_twice_is_an_error():
    model = build_model(preset("tiny"), seed=0)
    convert_to_fp8(model, "rowwise")
    with pytest.raises(SpecError, match="already converted"):
        convert_to_fp8(model, "rowwise")
    with pytest.raises(SpecError, match="recipe"):
        convert_to_fp8(build_model(preset("tiny"), seed=0), "fp4")


def test_a_job_driver_validates_its_spec_without_importing_dtensor():
    """``models.fp8`` loads its names on first use: the driver (``rayfleet.jobs.train``) and Ray
    Train's controller read recipes only, and ``torch.distributed.tensor`` costs ~1 s of CPU per
    process start; the converter still resolves through the package."""
    import subprocess
    import sys

    code = ("import sys, rayfleet.jobs.train; print('torch.distributed.tensor' in sys.modules); "
            "from rayfleet.models.fp8 import convert_to_fp8, RECIPES; print(callable(convert_to_fp8), bool(RECIPES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr
