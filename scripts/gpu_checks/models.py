"""The models on the device: the MoE preset, an MLA variant of it and a tiny Hugging Face
Qwen3-MoE, CPU fp32 vs device fp32 logits and gradients, and BF16 autocast vs CPU fp32.

Tolerances (stated, not tuned): fp32 on two devices differs only by reduction order, so logits
agree within 1e-4 of the largest logit and every parameter's gradient within 1e-4 relative
(Frobenius); TF32 is switched off for these comparisons (torch's default for matmuls, set
explicitly so a changed default cannot loosen them). BF16 autocast (the training precision) vs
CPU fp32: logits within 3e-2 relative (Frobenius; bf16 keeps 8 mantissa bits, unit roundoff
3.9e-3, compounded over the layers) and the loss within 1e-2 relative; 1e-1 for the logits of
the Hugging Face model, whose weights are drawn at std 0.15 (the oracle tests' scale, where
logits are O(1) and routing is uneven: bf16's rounding of larger activations flips more
near-tied routing choices, counted in the detail; measured 5.3e-2 on CPU). Routing is part of the
model: a near-tied router score that flips between devices shows up as a logit mismatch here,
and the detail then counts the flipped (token, expert) choices.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from rayfleet.models import build_model, preset
from rayfleet.models.hf import build_hf_model
from rayfleet.models.hf.weights import DictSource

LOGIT_TOL, GRAD_TOL, BF16_LOGIT_TOL, BF16_LOSS_TOL = 1e-4, 1e-4, 3e-2, 1e-2

# A tiny Qwen3-MoE, as tests/unit/models/hf_fixtures.py builds it (first layer dense, qk-norm).
QWEN3_MOE = dict(vocab_size=211, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
                 head_dim=16)


def run(ctx) -> None:
    if ctx.on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    batch, seq = (2, 16) if ctx.quick else (4, 128)
    mla = preset("tiny", kv_lora_rank=32, q_lora_rank=48, rope_head_dim=16, head_dim=32, v_head_dim=32,
                 num_kv_heads=4)
    for name, make in (("moe_tiny", lambda: build_model(preset("tiny"), seed=0)),
                       ("moe_small", lambda: build_model(preset("small"), seed=0)),
                       ("mla_tiny", lambda: build_model(mla, seed=0))):
        if name == "moe_small" and ctx.quick:
            continue
        _compare(ctx, name, make(), batch, seq)
    _hf_qwen3_moe(ctx, batch, seq)


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _forward_backward(model, tokens: torch.Tensor, *, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
        if hasattr(logits, "logits"):  # a transformers model
            logits = logits.logits
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float().cpu(), loss.item(), grads


def _routing(model) -> list[torch.Tensor]:
    return [m.last_tokens_per_expert.detach().cpu() for m in getattr(model, "moe_layers", lambda: [])()
            if getattr(m, "last_tokens_per_expert", None) is not None]


def _compare(ctx, name: str, cpu_model, batch: int, seq: int, *, bf16_logit_tol: float = BF16_LOGIT_TOL) -> None:
    cpu_model = cpu_model.float()
    dev_model = copy.deepcopy(cpu_model).to(ctx.device)
    tokens = _tokens(cpu_model.config.vocab_size, batch, seq)
    ref_logits, ref_loss, ref_grads = _forward_backward(cpu_model, tokens)
    ref_routing = _routing(cpu_model)
    logits, loss, grads = _forward_backward(dev_model, tokens.to(ctx.device))
    routing = _routing(dev_model)
    flips = sum(int((a - b).abs().sum().item()) // 2 for a, b in zip(ref_routing, routing))
    logit_err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    grad_errs = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items() if g.norm() > 0}
    worst = max(grad_errs, key=grad_errs.get)
    missing = sorted(set(ref_grads) ^ set(grads))
    ok = logit_err <= LOGIT_TOL and grad_errs[worst] <= GRAD_TOL and not missing
    ctx.record(f"{name}.fp32", ok, f"{ctx.device} vs cpu: logits {logit_err:.2e} (tol {LOGIT_TOL:g}), worst grad "
               f"{grad_errs[worst]:.2e} at {worst} (tol {GRAD_TOL:g}); routing counts differ by {flips} choices"
               + (f"; gradients only on one side: {missing[:3]}" if missing else ""),
               logit_rel_err=logit_err, worst_grad_rel_err=grad_errs[worst], worst_grad_param=worst,
               loss_cpu=ref_loss, loss_device=loss, routing_flips=flips, params=len(grad_errs))
    bf16_logits, bf16_loss, _ = _forward_backward(dev_model, tokens.to(ctx.device), autocast=True)
    bf16_flips = sum(int((a - b).abs().sum().item()) // 2 for a, b in zip(ref_routing, _routing(dev_model)))
    rel = ((bf16_logits - ref_logits).norm() / ref_logits.norm()).item()
    loss_rel = abs(bf16_loss - ref_loss) / ref_loss
    ctx.record(f"{name}.bf16", rel <= bf16_logit_tol and loss_rel <= BF16_LOSS_TOL,
               f"bf16 autocast on {ctx.device} vs cpu fp32: logits {rel:.2e} (tol {bf16_logit_tol:g}), "
               f"loss {loss_rel:.2e} (tol {BF16_LOSS_TOL:g}); routing counts differ by {bf16_flips} choices",
               logit_rel_err=rel, loss_rel_err=loss_rel, routing_flips=bf16_flips, logit_tol=bf16_logit_tol)


def _hf_qwen3_moe(ctx, batch: int, seq: int) -> None:
    try:
        import transformers
    except ImportError:
        ctx.skip("hf_qwen3_moe", "transformers is not installed")
        return
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that logits are O(1) and routing is uneven
        for pname, p in hf.named_parameters():
            p.copy_((1 + 0.2 * torch.randn(p.shape, generator=gen)) if "norm" in pname
                    else 0.15 * torch.randn(p.shape, generator=gen))
    config = {**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    model, _ = build_hf_model(config, DictSource(dict(hf.state_dict())))
    _compare(ctx, "hf_qwen3_moe", model, batch, seq, bf16_logit_tol=1e-1)
    # transformers itself on the device is the outside oracle for rayfleet's mapping there
    tokens = _tokens(QWEN3_MOE["vocab_size"], batch, seq).to(ctx.device)
    hf_dev, ours = hf.to(ctx.device), copy.deepcopy(model).float().to(ctx.device).eval()
    with torch.no_grad():
        ref, out = hf_dev(tokens).logits.float(), ours(tokens).float()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    ctx.record("hf_qwen3_moe.vs_transformers", err <= LOGIT_TOL,
               f"rayfleet vs transformers {transformers.__version__} on {ctx.device}: logits {err:.2e} (tol {LOGIT_TOL:g})",
               logit_rel_err=err, transformers=transformers.__version__)
