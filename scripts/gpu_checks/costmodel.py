"""The cost model's GEMM, attention and HBM constants measured on this GPU, beside ``CostParams``.

Measures (units: efficiency = achieved FLOP/s / the catalogue's dense peak for that precision):
- BF16 and FP8 GEMM efficiency of a large square GEMM and of expert-shaped GEMMs
  ``[rows, hidden] @ [hidden, ffn]`` at 16..8192 rows (FP8: ``torch._scaled_mm``, e4m3,
  tensorwise scales, rows padded to 16), each curve fitted to ``peak x rows / (rows + knee)``,
  the model's form (``step_time_model.layer_time``);
- FP8 "with casts": the amax + scale + e4m3 cast of the activation before each ``_scaled_mm``
  (current scaling; the weight cast is cached in training, so it is left out);
- fused causal attention forward+backward (``scaled_dot_product_attention``, BF16, head dim 128)
  at the presets' sequence lengths, FLOPs counted as the model counts them (backward = 2 x
  forward), so the figure is the ``attention_efficiency`` that would predict the measured time;
- HBM bandwidth of a large device-to-device copy (bytes read + written) / the catalogue's GB/s:
  the model prices every HBM-bound term at 100% of the catalogue figure.

Design decisions:
- Judgements compare like with like and say what a raw kernel cannot confirm. ``bf16_gemm_efficiency``
  is itself a measured large-GEMM constant: confirmed within +-``TOLERANCE``. ``gemm_efficiency``
  is fitted on whole FP8 training runs (casts, amax, launches included): the raw FP8 GEMM is a
  ceiling, so the constant passes when it is at or below the ceiling with casts (+ tolerance),
  and the detail gives the share the fit attributes to everything else. The knee is a lower bound
  of the model's (grouped GEMMs, small-K weight-gradient GEMMs add to it): it passes when the
  measured knee is at most the constant (+ tolerance). Attention is judged for the kernel
  rayfleet's models call (SDPA's default choice) against ``attention_efficiency``, +- tolerance.
- On ``--device cpu`` every path runs at tiny sizes and the figures are recorded, but the
  judgements are skips: CPU numbers say nothing about an H100's constants.
- The least-squares fit is ours (a log grid over the knee, the peak in closed form per knee, then
  a golden-section refinement): two parameters, no scipy on the GPU machines.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfleet.placement.cost_params import CostParams
from rayfleet.platform.catalogue import AcceleratorSpec, get_accelerator

__all__ = ["TOLERANCE", "KneeFit", "fit_knee", "run"]

TOLERANCE = 0.15  # relative: a measured constant within +-15% of the assumed one confirms it
ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_ROWS = (16, 32, 64, 128, 256)
# (label, hidden, ffn): Qwen3-235B-A22B's experts (4096 -> 1536), DeepSeek-V3's (7168 -> 2048)
EXPERT_SHAPES = (("qwen3-235b 4096x1536", 4096, 1536), ("deepseek-v3 7168x2048", 7168, 2048))
QUICK_EXPERT_SHAPES = (("quick 128x64", 128, 64),)  # quick (CPU): the code path, not a figure
# local experts of one grouped GEMM: Qwen3-235B's 128 experts at EP16 (the published plans run EP8-EP32)
GROUPED_EXPERTS = 8
SQUARE, QUICK_SQUARE = 8192, 128  # quick: an FP8 256^3 GEMM emulated on CPU took 1.4 s a call
ATTN_SEQ_LENS, QUICK_ATTN_SEQ_LENS = (2048, 4096, 8192), (128, 256)  # examples: 2048; presets: 4096, 8192
ATTN_TOKENS, QUICK_ATTN_TOKENS = 32768, 256  # batch = tokens / seq_len
ATTN_HEADS, QUICK_ATTN_HEADS, HEAD_DIM = 32, 2, 128
COPY_BYTES, QUICK_COPY_BYTES = 2 << 30, 16 << 20


@dataclass(frozen=True)
class KneeFit:
    """``efficiency(rows) = peak x rows / (rows + knee)`` fitted by least squares; ``rms`` of the residuals."""

    peak: float
    knee: float
    rms: float


def fit_knee(rows: list[float], efficiency: list[float]) -> KneeFit:
    """Least-squares ``peak, knee`` for the points; for a fixed knee the best peak is closed-form."""
    assert len(rows) == len(efficiency) >= 2

    def sse_at(log_knee: float) -> tuple[float, float]:
        g = [r / (r + math.exp(log_knee)) for r in rows]
        peak = sum(e * x for e, x in zip(efficiency, g)) / sum(x * x for x in g)
        return sum((e - peak * x) ** 2 for e, x in zip(efficiency, g)), peak

    grid = [math.log(0.25) + i * (math.log(65536.0) - math.log(0.25)) / 200 for i in range(201)]
    best = min(range(len(grid)), key=lambda i: sse_at(grid[i])[0])
    lo, hi = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden-section search of the bracket around the best grid point
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if sse_at(a)[0] < sse_at(b)[0]:
            hi = b
        else:
            lo = a
    sse, peak = sse_at((lo + hi) / 2)
    return KneeFit(peak, math.exp((lo + hi) / 2), math.sqrt(sse / len(rows)))


def _accelerator(ctx) -> tuple[AcceleratorSpec, str]:
    """The catalogue entry of this GPU (H200 by name, else H100); on CPU the H100's, labelled."""
    if not ctx.on_cuda:
        return get_accelerator("H100"), "cpu (fractions of the H100's peaks; meaningless)"
    name = torch.cuda.get_device_name(ctx.device)
    return get_accelerator("H200" if "H200" in name else "H100"), name


def _scaled_mm_available(ctx) -> str | None:
    """None when ``torch._scaled_mm`` runs here, else why not."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return "this torch has no float8_e4m3fn / _scaled_mm"
    try:
        a = torch.ones(16, 32, device=ctx.device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=ctx.device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=ctx.device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        return f"_scaled_mm does not run on {ctx.device.type}: {str(exc).splitlines()[0][:160]}"
    return None


def _gemm_call(ctx, precision: str, rows: int, hidden: int, ffn: int, *, experts: int = 1,
               with_cast: bool = False):
    """A no-argument callable running ``[rows, hidden] @ [hidden, ffn]`` in ``precision``, for
    ``experts`` experts at once (BF16 only: ``bmm``, a grouped GEMM with equal rows per expert)."""
    dtype = torch.bfloat16 if ctx.on_cuda or precision == "fp8" else torch.float32
    lead = (experts,) if experts > 1 else ()
    x = torch.randn(*lead, rows, hidden, device=ctx.device, dtype=dtype)
    w = torch.randn(*lead, ffn, hidden, device=ctx.device, dtype=dtype)  # [ffn, hidden]: its .t() is column-major
    if precision == "bf16":
        wt = w.transpose(-1, -2)
        return (lambda: torch.bmm(x, wt)) if experts > 1 else (lambda: torch.mm(x, wt))
    assert experts == 1, "FP8 expert curves time one expert per launch"
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale_w = (w.abs().amax().float() / fp8_max).clamp(min=1e-12)
    qw = (w.float() / scale_w).to(torch.float8_e4m3fn).t()
    scale_x = (x.abs().amax().float() / fp8_max).clamp(min=1e-12)
    qx = (x.float() / scale_x).to(torch.float8_e4m3fn)

    def fp8_mm():
        if with_cast:  # current scaling in eager PyTorch: the activation's amax, then the scaled cast
            sx = (x.abs().amax().float() / fp8_max).clamp(min=1e-12)
            q = (x / sx.to(x.dtype)).to(torch.float8_e4m3fn)
            return torch._scaled_mm(q, qw, scale_a=sx, scale_b=scale_w, out_dtype=torch.bfloat16)
        return torch._scaled_mm(qx, qw, scale_a=scale_x, scale_b=scale_w, out_dtype=torch.bfloat16)
    return fp8_mm


def _seconds(ctx, fn, reps: int) -> float:
    """Seconds of one ``fn()`` timed over ``reps`` back-to-back calls. On a GPU the calls are
    captured in a CUDA graph: a 16-row GEMM takes a few microseconds, less than launching it from
    Python, and a training step's grouped GEMM is one launch for all its experts, so launch gaps
    are not the GEMM's cost. Falls back to plain launches where capture fails."""
    def repeated():
        for _ in range(reps):
            fn()
    if ctx.on_cuda:
        try:
            side = torch.cuda.Stream(ctx.device)
            side.wait_stream(torch.cuda.current_stream(ctx.device))
            with torch.cuda.stream(side):
                repeated()  # warm-up off the capture (cuBLAS picks and allocates its workspace)
            torch.cuda.current_stream(ctx.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                repeated()
            return ctx.seconds_per_call(graph.replay) / reps
        except RuntimeError:
            pass
    return ctx.seconds_per_call(repeated) / reps


def _gemm_efficiency(ctx, precision: str, rows: int, hidden: int, ffn: int, peak_flops: float, *,
                     experts: int = 1, **kw) -> float:
    call = _gemm_call(ctx, precision, rows, hidden, ffn, experts=experts, **kw)
    flops = 2.0 * experts * rows * hidden * ffn
    reps = 1 if ctx.quick else max(1, min(100, int(2e11 / flops)))  # ~0.2 ms+ per timed replay on a GPU
    return flops / _seconds(ctx, call, reps) / peak_flops


def _gemms(ctx, accel: AcceleratorSpec, precision: str) -> dict:
    """Square-GEMM efficiency and fitted curves per expert shape (one expert per launch; for BF16
    also ``GROUPED_EXPERTS`` experts in one ``bmm``); records each as a measurement."""
    peak = accel.peak_tflops(precision) * 1e12
    square = QUICK_SQUARE if ctx.quick else SQUARE
    out = {"square": _gemm_efficiency(ctx, precision, square, square, square, peak), "curves": {}}
    ctx.record(f"{precision}_gemm_square", None, f"{square}^3 {precision.upper()} GEMM: {out['square']:.3f} of "
               f"{accel.peak_tflops(precision):.0f} TFLOP/s", efficiency=out["square"],
               tflops=out["square"] * peak / 1e12, size=square)
    if precision == "fp8":
        out["square_eager_cast"] = _gemm_efficiency(ctx, precision, square, square, square, peak, with_cast=True)
        ctx.record("fp8_gemm_square_eager_cast", None, "with the activation's amax + cast as eager PyTorch "
                   f"kernels (unfused: abs, amax, divide, cast): {out['square_eager_cast']:.3f}",
                   efficiency=out["square_eager_cast"], size=square)
    rows = QUICK_ROWS if ctx.quick else ROWS
    shapes = QUICK_EXPERT_SHAPES if ctx.quick else EXPERT_SHAPES
    curves = [(label, h, f, 1) for label, h, f in shapes]
    if precision == "bf16":
        label, h, f = shapes[0]
        curves.append((f"{label} x{GROUPED_EXPERTS} grouped", h, f, GROUPED_EXPERTS))
    for label, hidden, ffn, experts in curves:
        effs = [_gemm_efficiency(ctx, precision, r, hidden, ffn, peak, experts=experts) for r in rows]
        fit = fit_knee([float(r) for r in rows], effs)
        out["curves"][label] = fit
        ctx.record(f"{precision}_expert_gemm[{label}]", None,
                   f"fit: peak {fit.peak:.3f} of {precision.upper()} peak, half at {fit.knee:.0f} rows per expert "
                   f"(rms {fit.rms:.3f})", rows=list(rows), efficiency=effs, fitted_peak=fit.peak,
                   fitted_knee_rows=fit.knee, fit_rms=fit.rms, hidden=hidden, ffn=ffn, experts=experts)
    return out


def _default_backend(q: torch.Tensor) -> str:
    """The SDPA backend PyTorch picks for causal attention on ``q``-shaped inputs (private API)."""
    from torch.nn.attention import SDPBackend

    try:
        index = torch._fused_sdp_choice(q, q, q, None, 0.0, True)
        return next(name for name, b in SDPBackend.__members__.items() if int(b.value) == int(index))
    except (AttributeError, RuntimeError, StopIteration, TypeError):
        return "unknown"


def _attention(ctx, accel: AcceleratorSpec) -> tuple[dict[str, float], str]:
    """Model-counted fwd+bwd efficiency per SDPA backend (``default`` = what rayfleet's layers get),
    and the name of the default backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"default": None}
    if ctx.on_cuda:
        backends.update(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)
    seq_lens = QUICK_ATTN_SEQ_LENS if ctx.quick else ATTN_SEQ_LENS
    tokens, heads = (QUICK_ATTN_TOKENS, QUICK_ATTN_HEADS) if ctx.quick else (ATTN_TOKENS, ATTN_HEADS)
    dtype = torch.bfloat16 if ctx.on_cuda else torch.float32
    peak = accel.peak_bf16_tflops * 1e12
    result: dict[str, float] = {}
    default = "unknown"
    for name, backend in backends.items():
        effs, fwd_effs = [], []
        try:
            for s in seq_lens:
                batch = max(1, tokens // s)
                q, k, v = (torch.randn(batch, heads, s, HEAD_DIM, device=ctx.device, dtype=dtype, requires_grad=True)
                           for _ in range(3))
                grad = torch.randn_like(q)
                if backend is None:
                    default = _default_backend(q.detach())
                fwd_flops = 2.0 * batch * heads * s * s * HEAD_DIM  # 4 b h s^2 d, halved by the causal mask

                def forward():
                    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def forward_backward():
                    out = forward()
                    q.grad = k.grad = v.grad = None
                    out.backward(grad)

                with torch.no_grad():
                    fwd_effs.append(fwd_flops / ctx.seconds_per_call(forward) / peak)
                effs.append(3 * fwd_flops / ctx.seconds_per_call(forward_backward) / peak)
        except RuntimeError as exc:  # a backend this build or GPU lacks
            ctx.skip(f"attention[{name}]", f"SDPA backend {name} does not run: {str(exc).splitlines()[0][:160]}")
            continue
        result[name] = sum(effs) / len(effs)
        ctx.record(f"attention[{name}]", None, f"causal BF16 d{HEAD_DIM} fwd+bwd {result[name]:.3f} of the BF16 "
                   f"peak (mean over seq {','.join(map(str, seq_lens))}; backward counted as 2x forward)",
                   seq_lens=list(seq_lens), efficiency=effs, forward_efficiency=fwd_effs, mean=result[name],
                   heads=heads, head_dim=HEAD_DIM, **({"backend": default} if backend is None else {}))
    return result, default


def _hbm(ctx, accel: AcceleratorSpec) -> float:
    """Device-to-device copy bandwidth (read + written) as a fraction of the catalogue's HBM GB/s."""
    nbytes = QUICK_COPY_BYTES if ctx.quick else COPY_BYTES
    src = torch.empty(nbytes // 2, device=ctx.device, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = ctx.seconds_per_call(lambda: dst.copy_(src))
    gbps = 2 * nbytes / seconds / 1e9
    fraction = gbps / accel.hbm_bandwidth_gbps
    ctx.record("hbm_bandwidth", None, f"copy of {nbytes / 2**30:.2f} GiB: {gbps:.0f} GB/s read+written, "
               f"{fraction:.3f} of the catalogue's {accel.hbm_bandwidth_gbps:.0f}", gbps=gbps, fraction=fraction,
               catalogue_gbps=accel.hbm_bandwidth_gbps, bytes=nbytes)
    return fraction


def _judge(ctx, name: str, ok: bool, detail: str, **figures) -> None:
    if ctx.on_cuda:
        ctx.record(name, ok, detail, **figures)
    else:
        ctx.skip(name, "CPU figures are not the GPU's; would judge: " + detail)


def _judgements(ctx, params: CostParams, measured: dict) -> None:
    tol = TOLERANCE
    bf16 = measured["bf16_gemm_efficiency"]
    _judge(ctx, "bf16_gemm_efficiency", abs(bf16 / params.bf16_gemm_efficiency - 1) <= tol,
           f"large BF16 GEMM measured {bf16:.3f} vs assumed {params.bf16_gemm_efficiency} (the same quantity, a "
           f"measured constant: confirmed within +-{tol:.0%} relative)", measured=bf16,
           assumed=params.bf16_gemm_efficiency)
    ceiling = measured.get("fp8_gemm_ceiling_with_cast")
    if ceiling is None:
        ctx.skip("gemm_efficiency", "no FP8 measurement here")
    else:
        share = 1 - params.gemm_efficiency / ceiling
        _judge(ctx, "gemm_efficiency", params.gemm_efficiency <= ceiling * (1 + tol),
               f"fitted end-to-end FP8 constant {params.gemm_efficiency} vs this GPU's ceiling {ceiling:.3f} (raw "
               f"_scaled_mm {measured['fp8_gemm_ceiling']:.3f} plus a fused current-scaling cast of "
               f"{params.fp8_cast_bytes} B per activation element at the measured HBM rate; eager unfused casts "
               f"{measured['fp8_gemm_eager_cast']:.3f}). Not the same quantity: consistent when the constant is at "
               f"or below the ceiling (+{tol:.0%}); the fit leaves {share:.0%} of the ceiling to what whole runs add "
               "(norms, launches, small-K weight-gradient GEMMs, stragglers), which a kernel cannot confirm",
               measured_ceiling=ceiling, assumed=params.gemm_efficiency, implied_other_share=share)
    grouped, single = measured["gemm_rows_at_half_efficiency"], measured["knees"]
    _judge(ctx, "gemm_rows_at_half_efficiency", grouped <= params.gemm_rows_at_half_efficiency * (1 + tol),
           f"raw grouped BF16 GEMM ({measured['knee_source']}) halves its efficiency at {grouped:.0f} rows per "
           f"expert vs assumed {params.gemm_rows_at_half_efficiency:.0f}; one expert per launch: "
           + ", ".join(f"{k} {v:.0f}" for k, v in single.items() if "grouped" not in k)
           + f". The model's knee also carries what a step adds (small-K weight-gradient GEMMs, FP8's larger knee: "
           f"no FP8 grouped GEMM is timed here), so a raw knee at or below it (+{tol:.0%}) is consistent and one "
           "above it means the model is optimistic for small experts", measured=grouped,
           assumed=params.gemm_rows_at_half_efficiency, **{f"knee[{k}]": v for k, v in single.items()})
    attn = measured.get("attention_efficiency_default")
    if attn is not None:
        best = measured.get("attention_efficiency_best", attn)
        _judge(ctx, "attention_efficiency", abs(attn / params.attention_efficiency - 1) <= tol,
               f"SDPA as rayfleet's layers call it ({measured.get('attention_default_backend', '?')}) {attn:.3f}, "
               f"best backend {best:.3f}, vs assumed {params.attention_efficiency} (fitted on Megatron/TE runs, whose "
               f"kernel may differ; the same quantity for rayfleet's own jobs), +-{tol:.0%}",
               measured=attn, measured_best_backend=best, assumed=params.attention_efficiency)
    hbm = measured["hbm_fraction"]
    _judge(ctx, "hbm_bandwidth", abs(hbm - 1) <= tol,
           f"copy bandwidth {hbm:.3f} of the catalogue's; the model prices HBM-bound terms (permutes, casts, "
           f"optimizer, wgrad accumulation) at 1.0 of it, so they take {1 / hbm - 1:+.0%} longer than priced; +-{tol:.0%}",
           measured_fraction=hbm, assumed_fraction=1.0)


def _fused_cast_ceiling(ctx, accel: AcceleratorSpec, params: CostParams, raw: float, hbm_fraction: float) -> float:
    """FP8 square-GEMM efficiency with the activation's cast priced as the model prices it
    (``fp8_cast_bytes`` per element at the measured HBM rate), as Transformer Engine fuses it."""
    n = QUICK_SQUARE if ctx.quick else SQUARE
    flops, peak = 2.0 * n ** 3, accel.peak_tflops("fp8") * 1e12
    cast_s = params.fp8_cast_bytes * n * n / (hbm_fraction * accel.hbm_bandwidth_gbps * 1e9)
    ceiling = flops / (flops / (raw * peak) + cast_s) / peak
    ctx.record("fp8_gemm_square_fused_cast", None, f"raw _scaled_mm {raw:.3f} + a fused cast at the measured HBM "
               f"rate: {ceiling:.3f}", efficiency=ceiling, cast_s=cast_s, size=n)
    return ceiling


def run(ctx) -> None:
    torch.manual_seed(0)
    accel, gpu = _accelerator(ctx)
    params = CostParams()
    ctx.record("accelerator", None, f"{gpu}: catalogue {accel.name} (BF16 {accel.peak_bf16_tflops:.0f}, FP8 "
               f"{accel.peak_fp8_tflops:.0f} TFLOP/s, HBM {accel.hbm_bandwidth_gbps:.0f} GB/s)",
               catalogue=accel.name, gpu=gpu, on_cuda=ctx.on_cuda)
    measured: dict = {"catalogue": accel.name, "gpu": gpu, "on_cuda": ctx.on_cuda}
    measured["hbm_fraction"] = _hbm(ctx, accel)
    bf16 = _gemms(ctx, accel, "bf16")
    knees = {f"bf16 {k}": fit.knee for k, fit in bf16["curves"].items()}
    measured["bf16_gemm_efficiency"] = bf16["square"]
    why_not = _scaled_mm_available(ctx)
    if why_not:
        ctx.skip("fp8_gemm", why_not)
    else:
        fp8 = _gemms(ctx, accel, "fp8")
        knees.update({f"fp8 {k}": fit.knee for k, fit in fp8["curves"].items()})
        measured.update(fp8_gemm_ceiling=fp8["square"], fp8_gemm_eager_cast=fp8["square_eager_cast"],
                        fp8_gemm_ceiling_with_cast=_fused_cast_ceiling(ctx, accel, params, fp8["square"],
                                                                       measured["hbm_fraction"]))
    measured["knees"] = knees
    # the model's knee is per expert in a grouped GEMM: the grouped curve is the same quantity
    measured["knee_source"] = next(k for k in knees if "grouped" in k)
    measured["gemm_rows_at_half_efficiency"] = knees[measured["knee_source"]]
    attn, default_backend = _attention(ctx, accel)
    if attn:
        measured["attention_efficiency_default"] = attn.get("default", max(attn.values()))
        measured["attention_efficiency_best"] = max(attn.values())
        measured["attention_default_backend"] = default_backend
    ctx.record("measured_constants", None, "the measured counterparts of CostParams' constants"
               + ("" if ctx.on_cuda else " (CPU: meaningless, the code path only)"), **measured,
               assumed={"gemm_efficiency": params.gemm_efficiency, "bf16_gemm_efficiency": params.bf16_gemm_efficiency,
                        "gemm_rows_at_half_efficiency": params.gemm_rows_at_half_efficiency,
                        "attention_efficiency": params.attention_efficiency, "hbm_fraction": 1.0})
    _judgements(ctx, params, measured)
    if ctx.time_left_s() > 60:
        from gpu_checks.calibrate import calibration_rows, markdown_table

        rows, replaced = calibration_rows(measured)
        ctx.record("calibration_table", None, f"published runs re-predicted with {', '.join(replaced)} measured"
                   + ("" if ctx.on_cuda else " (CPU figures: the code path only)"), rows=rows,
                   markdown_lines=markdown_table(rows, measured).splitlines())
    else:
        ctx.skip("calibration_table", f"{ctx.time_left_s():.0f} s left; run scripts/gpu_checks/calibrate.py on the JSON")
