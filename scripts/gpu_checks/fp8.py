"""FP8 on the device: ``torch._scaled_mm`` support, real vs emulated GEMMs, every recipe's loss
gap to BF16 over a short run, and FP8 vs BF16 GEMM speed.

Tolerances (stated, not tuned): a real and an emulated GEMM multiply the same FP8 values, so they
differ only by accumulation order and the output's rounding: relative Frobenius error <= 1e-3
with fp32 output (tensorwise), <= 8e-3 where cuBLASLt writes bf16 first (rowwise; bf16's unit
roundoff is 3.9e-3). A k that is not a multiple of 16 must take the emulated path (cuBLASLt
refuses it) and still give the emulated product; a row count that is not (an expert's group of
tokens: m=2099 made cuBLASLt fail with CUBLAS_STATUS_NOT_SUPPORTED on an H200) must take the
real path, its rows padded. A recipe's loss gap to BF16 is the relative
difference of the mean loss over the run's last quarter; it passes within max(2%, 3 x the gap
of a BF16 run whose init differs by 1e-6), the noise floor of that short run. FP8 GEMM speed
is judged at the large shapes only (M = 8192): >= 1.3x BF16, the goal of benchmarks/fp8_parity.py.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

from rayfleet.jobs.optim import lr_at
from rayfleet.models import build_model, preset
from rayfleet.models.fp8 import (E4M3, RECIPES, ROWWISE, TENSORWISE, Fp8Linear, convert_to_fp8, fp8_mm, quantize,
                                 scaled_mm_supported, unscaled_cast_control)
from rayfleet.models.fp8.numerics import _scaled_mm_layout

# (name, M tokens, K in, N out): the example models' GEMMs (tiny, small, Mixtral-8x7B and
# DeepSeek-V3 expert and attention projections) and one k not divisible by 16.
SHAPES = [("tiny.ffn", 256, 128, 384), ("small.expert", 512, 512, 512), ("small.ffn", 1024, 512, 1536),
          ("mixtral.ffn", 8192, 4096, 14336), ("deepseek.expert_up", 8192, 7168, 2048),
          ("deepseek.expert_down", 8192, 2048, 7168), ("odd_rows", 2099, 128, 128), ("odd_k", 256, 100, 384)]
QUICK_SHAPES = [("tiny.ffn", 64, 128, 384), ("odd_rows", 37, 128, 128), ("odd_k", 32, 100, 48)]
LARGE_M = 8192


def run(ctx) -> None:
    _probe(ctx)
    _real_vs_emulated(ctx)
    _raw_probes(ctx)
    _recipe_loss_gaps(ctx)
    _speed(ctx)


def _probe(ctx) -> None:
    dev = ctx.device.type
    tensorwise, rowwise = scaled_mm_supported(dev, False), scaled_mm_supported(dev, True)
    if ctx.on_cuda:
        cap = torch.cuda.get_device_capability(ctx.device)
        expected = cap >= (8, 9)  # Ada and Hopper have FP8 tensor cores
        ctx.record("scaled_mm_probe", tensorwise == expected and rowwise == expected,
                   f"capability {cap[0]}.{cap[1]}: tensorwise {tensorwise}, rowwise {rowwise} (expected {expected})",
                   tensorwise=tensorwise, rowwise=rowwise, capability=f"{cap[0]}.{cap[1]}")
    else:
        ctx.record("scaled_mm_probe", None, f"cpu: tensorwise {tensorwise}, rowwise {rowwise}",
                   tensorwise=tensorwise, rowwise=rowwise)


def _real_vs_emulated(ctx) -> None:
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    worst = {}
    for name, m, k, n in (QUICK_SHAPES if ctx.quick else SHAPES):
        a = torch.randn(m, k, device=ctx.device, generator=gen)
        b = torch.randn(n, k, device=ctx.device, generator=gen) * 0.05
        for label, block, tol in (("tensorwise", TENSORWISE, 1e-3), ("rowwise", ROWWISE, 8e-3)):
            qa, _ = quantize(a, block=block)
            qb, _ = quantize(b, block=block)
            layout = _scaled_mm_layout(qa, qb)
            real_path = layout is not None and scaled_mm_supported(ctx.device.type, layout == "row")
            real = fp8_mm(qa, qb, use_scaled_mm=True)
            emulated = fp8_mm(qa, qb, use_scaled_mm=False)
            err = ((real - emulated).norm() / emulated.norm()).item()
            exact_err = ((emulated - a @ b.t()).norm() / (a @ b.t()).norm()).item()  # FP8's own error, for scale
            if k % 16 and ctx.on_cuda:
                ok = not real_path and err == 0.0
                detail = f"k={k} takes the {'real' if real_path else 'emulated'} path (must fall back), err {err:.2e}"
            else:
                ok = err <= tol and (real_path or not ctx.on_cuda)
                detail = (f"{'real _scaled_mm' if real_path else 'emulated only'} vs emulated: rel err {err:.2e} "
                          f"(tol {tol:g}); fp8 vs fp32 product {exact_err:.2e}")
            ctx.record(f"gemm.{name}.{label}", ok, detail, m=m, k=k, n=n, real_path=real_path, rel_err=err,
                       fp8_vs_fp32_rel_err=exact_err)
            worst[label] = max(worst.get(label, 0.0), err)


def _raw_probes(ctx) -> None:
    """What cuBLASLt itself accepts (no padding, no copies): an odd row count, a scale off 16 bytes."""
    if not ctx.needs_cuda("raw_probes"):
        return
    a = torch.randn(2099, 128, device=ctx.device).to(E4M3)
    b = torch.randn(128, 128, device=ctx.device).to(E4M3)
    one = torch.ones((), device=ctx.device)
    grid = torch.ones(4, device=ctx.device)
    for name, sa, rows in (("raw_odd_rows", one, 2099), ("raw_scale_off_16_bytes", grid[1], 2096)):
        try:
            torch._scaled_mm(a[:rows], b.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16)
            accepted = True
        except RuntimeError:
            accepted = False
        ctx.record(name, None, f"torch._scaled_mm {'accepts' if accepted else 'refuses'} it (fp8_mm copes either way)",
                   accepted=accepted)


def _text_tokens(num_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's own sources (real text, on every machine)."""
    stdlib = Path(os.path.realpath(sysconfig.get_paths()["stdlib"]))
    data = bytearray()
    for path in sorted(stdlib.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= num_bytes:
            break
    return torch.tensor(list(data[:num_bytes]), dtype=torch.long)


def _train(ctx, recipe, batches: list[torch.Tensor], *, config, init_noise: float = 0.0) -> list[float]:
    model = build_model(config, device=ctx.device, seed=0)
    if init_noise:
        gen = torch.Generator(device=ctx.device).manual_seed(1234)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + init_noise * torch.randn(p.shape, device=ctx.device, generator=gen))
    if recipe is not None:
        convert_to_fp8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step, batch in enumerate(batches):
        for g in opt.param_groups:  # the train loop's own schedule: warmup, then cosine to 10%
            g["lr"] = lr_at(step, lr=3e-3, total_steps=len(batches), warmup_steps=max(1, len(batches) // 10))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_biases()
        losses.append(loss.item())
    return losses


def _recipe_loss_gaps(ctx) -> None:
    steps, batch, seq = (4, 2, 32) if ctx.quick else (120, 16, 256)
    config = preset("tiny")
    tokens = _text_tokens(steps * batch * (seq + 1) * 2).to(ctx.device)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, tokens.numel() - seq - 1, (steps, batch), generator=gen)
    batches = [torch.stack([tokens[s:s + seq + 1] for s in row.tolist()]) for row in starts]
    tail = max(1, steps // 4)

    def mean_tail(losses: list[float]) -> float:
        return sum(losses[-tail:]) / tail

    bf16 = mean_tail(_train(ctx, None, batches, config=config))
    noise = abs(mean_tail(_train(ctx, None, batches, config=config, init_noise=1e-6)) - bf16) / bf16
    bound = max(0.02, 3 * noise)
    ctx.record("recipes.bf16_noise_floor", None, f"BF16 vs BF16 with a 1e-6 init perturbation: {noise:.3%}",
               bf16_tail_loss=bf16, noise_gap=noise, steps=steps, tokens_per_step=batch * seq)
    gaps = {}
    for name, recipe in [*RECIPES.items(), ("unscaled-cast-control", unscaled_cast_control())]:
        try:
            tail_loss = mean_tail(_train(ctx, recipe, batches, config=config))
        except RuntimeError as exc:  # a recipe the device refuses is a failed check, not a lost group
            ctx.record(f"recipes.{name}", False, f"training raised {type(exc).__name__}: {str(exc)[:300]}")
            continue
        gap = (tail_loss - bf16) / bf16
        gaps[name] = gap
        if name == "unscaled-cast-control":
            ctx.record(f"recipes.{name}", None, f"broken-on-purpose control: gap {gap:+.3%} (recipes' bound {bound:.2%})",
                       tail_loss=tail_loss, gap=gap)
        elif ctx.quick:
            ctx.record(f"recipes.{name}", None, f"{steps} steps only (quick): gap {gap:+.3%}", tail_loss=tail_loss, gap=gap)
        else:
            ctx.record(f"recipes.{name}", abs(gap) <= bound, f"loss gap to BF16 {gap:+.3%} (bound {bound:.2%})",
                       tail_loss=tail_loss, gap=gap, bound=bound)


def _speed(ctx) -> None:
    if not ctx.needs_cuda("speed"):
        return
    if not scaled_mm_supported("cuda", False):
        ctx.skip("speed", "torch._scaled_mm is not supported on this GPU")
        return
    for name, m, k, n in SHAPES:
        if k % 16:
            continue
        a = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16) * 0.05
        qa, _ = quantize(a, dtype=E4M3)
        qw, _ = quantize(w, dtype=E4M3)
        ra, _ = quantize(a, dtype=E4M3, block=ROWWISE)
        rw, _ = quantize(w, dtype=E4M3, block=ROWWISE)
        flops = 2 * m * k * n
        t_bf16 = ctx.seconds_per_call(lambda: a @ w.t())
        t_tw = ctx.seconds_per_call(lambda: torch._scaled_mm(qa.data, qw.data.t(), scale_a=qa.scale.reshape(()),
                                                             scale_b=qw.scale.reshape(()), out_dtype=torch.bfloat16))
        t_rw = ctx.seconds_per_call(lambda: torch._scaled_mm(ra.data, rw.data.t(), scale_a=ra.scale.contiguous(),
                                                             scale_b=rw.scale.reshape(1, -1), out_dtype=torch.bfloat16))
        lin = torch.nn.Linear(k, n, bias=False, device=ctx.device, dtype=torch.bfloat16)
        fp8_lin = Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=ctx.device, dtype=torch.bfloat16),
                                        recipe=RECIPES["tensorwise"], use_scaled_mm=True)
        x = a.clone().requires_grad_()
        t_layer_bf16 = ctx.seconds_per_call(lambda: lin(x).sum().backward(), iters=5)
        t_layer_fp8 = ctx.seconds_per_call(lambda: fp8_lin(x).sum().backward(), iters=5)
        figures = dict(m=m, k=k, n=n, bf16_tflops=flops / t_bf16 / 1e12, fp8_tensorwise_tflops=flops / t_tw / 1e12,
                       fp8_rowwise_tflops=flops / t_rw / 1e12, gemm_speedup=t_bf16 / t_tw,
                       rowwise_speedup=t_bf16 / t_rw, layer_speedup=t_layer_bf16 / t_layer_fp8)
        detail = (f"BF16 {figures['bf16_tflops']:.0f} TF/s, FP8 tensorwise {figures['fp8_tensorwise_tflops']:.0f}, "
                  f"rowwise {figures['fp8_rowwise_tflops']:.0f}; GEMM x{figures['gemm_speedup']:.2f}, "
                  f"Fp8Linear fwd+bwd x{figures['layer_speedup']:.2f}")
        ctx.record(f"speed.{name}", figures["gemm_speedup"] >= 1.3 if m >= LARGE_M else None, detail, **figures)
