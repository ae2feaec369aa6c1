"""Activation memory per recompute mode, worked on DeepSeek-V3's published layout.

Facts taken from the DeepSeek-V3 technical report (arXiv 2412.19437) and nothing else:
- section 4.2 / table of hyper-parameters: 61 layers, the first 3 dense; hidden 7168; 128 heads
  of 128 dims; MLA KV compression 512, query compression 1536, decoupled RoPE 64 per head;
  1 shared + 256 routed experts of intermediate size 2048, 8 routed per token; sequence 4096.
- section 3.2: PP16, EP64 over 8 nodes, ZeRO-1 DP, 2048 H800 (80 GB), DualPipe, no TP.
- section 3.2.3: "we recompute all RMSNorm operations and MLA up-projections during
  back-propagation", so their outputs are not stored.
- section 3.3.3: the inputs of SwiGLU are cached (FP8) and its output recomputed in backward;
  FP8 GEMMs keep their inputs FP8; AdamW moments in BF16, master weights and gradients FP32.

The three recompute modes, as the memory model defines them (``memory_model.layer_activation_bytes``):
- ``none``: every tensor backward needs is saved;
- ``selective``: DeepSeek-V3's set (RMSNorm outputs, MLA up-projection outputs q/k/v, SwiGLU
  output); Megatron's ``core_attn`` selective recompute saves nothing more under flash attention,
  which never stores the s x s scores, so it is not a separate mode;
- ``full``: each layer's input only, plus one layer's working set.

Below, every byte count is written out by hand from those facts; the memory model must agree,
and the report's layout must fit 80 GB only with the report's recompute.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.placement.cost_model import GIB, balanced_plan, plan_memory
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.memory_model import layer_activation_bytes
from rayfleet.placement.model_spec import preset
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.catalogue import get_accelerator

DEEPSEEK = preset("deepseek-v3", global_batch_sequences=15360)
H800 = replace(get_accelerator("H100"), name="H800", intra_node_link_gbps=200.0)
REPORT_PLAN = ParallelPlan(tp=1, pp=16, dp=128, ep=64, micro_batch_size=1, zero_stage=1, optimizer_dtype="bf16",
                           activation_dtype="fp8", dualpipe=True, recompute="selective")
TOKENS = 4096
H, HEADS, HEAD_DIM, ROPE, Q_LORA, KV_LORA = 7168, 128, 128, 64, 1536, 512
TOP_K, SHARED, MOE_FFN, DENSE_FFN = 8, 1, 2048, 18432


def _hand_layer_bytes(moe: bool, recompute: str) -> int:
    """Bytes per token one layer saves, from the report's facts (BF16 = 2 bytes, FP8 = 1)."""
    kept_bf16 = 2 * H + HEADS * HEAD_DIM  # residual into attention and MLP; attention core output
    fp8 = Q_LORA + KV_LORA + ROPE  # MLA latents (inputs of the up-projections)
    ffn = (TOP_K + SHARED) * MOE_FFN if moe else DENSE_FFN
    fp8 += TOP_K * H if moe else 0  # dispatched token copies (expert fc1 input)
    swiglu_in = 2 * ffn  # cached FP8 (section 3.3.3)
    if recompute == "none":
        kept_bf16 += HEADS * (2 * (HEAD_DIM + ROPE) + HEAD_DIM)  # q, k (with RoPE part), v
        fp8 += 2 * H + ffn  # the two RMSNorm outputs; SwiGLU output (fc2 input)
    return 2 * kept_bf16 + fp8 + swiglu_in


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("moe", [False, True])
def test_layer_activation_bytes_match_the_hand_count(moe: bool, recompute: str) -> None:
    layer = DEEPSEEK.num_layers - 1 if moe else 0
    plan = ParallelPlan(recompute=recompute, activation_dtype="fp8")
    assert layer_activation_bytes(DEEPSEEK, plan, layer, CostParams()) == TOKENS * _hand_layer_bytes(moe, recompute)


def test_worked_numbers() -> None:
    # MoE layer, selective: 2*(2*7168 + 16384) + (2112 + 57344) + 2*9*2048 = 157,760 B/token = 616.25 MiB
    assert TOKENS * _hand_layer_bytes(True, "selective") == 646_184_960
    # without recompute it is 321,600 B/token (1,256.25 MiB): q/k/v alone are 131,072 B/token
    assert TOKENS * _hand_layer_bytes(True, "none") == 1_317_273_600
    # dense layer, selective: 100,416 B/token = 392.25 MiB
    assert TOKENS * _hand_layer_bytes(False, "selective") == 411_303_936


def test_the_reports_layout_fits_80gb_only_with_the_reports_recompute() -> None:
    """Stage 0 holds the most activations (16 micro-batches in flight under 1F1B-like warm-up).
    With the balanced split it holds 3 dense + 2 MoE layers: selective recompute keeps
    16 x (3 x 392.25 + 2 x 616.25) MiB = 37.64 GiB; without recompute 87.64 GiB, more than the
    whole 80 GB before weights and optimizer states are counted."""
    by_mode = {}
    for mode in ("none", "selective", "full"):
        plan = balanced_plan(DEEPSEEK, replace(REPORT_PLAN, recompute=mode), H800, CostParams())
        mem, _, usable = plan_memory(DEEPSEEK, plan, H800)
        by_mode[mode] = (plan, mem, usable)
    plan, mem, usable = by_mode["selective"]
    assert plan.stage_starts[:2] == (0, 5) and mem.stage == 0
    hand = 16 * (3 * TOKENS * _hand_layer_bytes(False, "selective") + 2 * TOKENS * _hand_layer_bytes(True, "selective"))
    assert mem.activations == pytest.approx(hand)
    assert hand / GIB == pytest.approx(37.64, abs=0.01)
    assert usable == pytest.approx(0.9 * 80 * GIB)
    assert mem.total <= usable < 80 * GIB  # fits with the allocator's 10% margin
    none = by_mode["none"][1]
    assert none.activations > 80 * GIB and none.total > 1.4 * usable
    full = by_mode["full"][1]
    assert full.activations < mem.activations < none.activations  # the modes are ordered
    # the broken variant: "selective" as attention-core recompute only (Megatron's core_attn),
    # which under flash attention saves what "none" saves, leaves the layout 80 GB short
    assert none.total > 80 * GIB
