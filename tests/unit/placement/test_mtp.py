"""DeepSeek-V3's multi-token-prediction module is priced on the last stage (issue 27, ranking round).

Regression named after what it fixed: the DeepSeek-V3 preset had no MTP module, so a PP1 plan
(every device runs the whole model) paid nothing for it, and the planner's TP4 PP1 DP256 EP64
ZeRO-3 shape led the published PP8 VP4 EP64 plan by 6.2%. DeepSeek-V3 trains with one MTP
module (arXiv 2412.19437, section 2.2: D = 1; each module is one Transformer block, a linear
projection of the concatenated ``2h`` representation to ``h``, and the shared output head), and
Megatron-Bridge's DeepSeek-V3 recipe places it on the last pipeline stage (layout
``Et|(tt|)*30mL``: ``m`` = MTP, ``L`` = loss).

Worked example (DeepSeek-V3, TP4 PP1 DP256 EP64 mbs4 on H100): the head term of one micro-batch
grows by one more head pass, the 2h -> h projection (``3 x tokens x 2 x 2h^2 / tp / peak``) and
one last-layer block's compute and exposed communication; the last stage holds one more MoE
block's parameters and one more block of activations per micro-batch in flight.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.placement.memory_model import all_stage_param_counts, layer_param_counts, stage_activation_bytes
from rayfleet.placement.model_spec import ModelSpecInput, preset
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.step_time_model import edge_times, layer_time
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")
DSV3 = preset("deepseek-v3")
NO_MTP = replace(DSV3, mtp_depth=0)  # the broken variant: the preset before this round
PLAN = ParallelPlan(tp=4, pp=1, dp=256, ep=64, micro_batch_size=4, zero_stage=3, recompute="selective",
                    stage_starts=(0,))


def test_the_preset_trains_one_mtp_module_and_yaml_can_set_it() -> None:
    assert DSV3.mtp_depth == 1 and preset("qwen3-235b-a22b").mtp_depth == 0
    assert ModelSpecInput(preset="deepseek-v3", mtp_depth=0).to_spec().mtp_depth == 0


def test_mtp_adds_a_head_pass_a_projection_and_one_block_to_the_last_stage() -> None:
    _, head = edge_times(DSV3, PLAN, H100)
    _, bare = edge_times(NO_MTP, PLAN, H100)
    block = layer_time(DSV3, PLAN, DSV3.num_layers - 1, H100)
    tokens = PLAN.micro_batch_size * DSV3.seq_len
    # the head's peak: BF16 peak x the GEMM efficiency of the model's precision (edge_times)
    peak = 3 * tokens * DSV3.head_forward_flops_per_token() / PLAN.tp / bare
    proj = 3 * tokens * 2 * 2 * DSV3.hidden_size ** 2 / PLAN.tp / peak
    assert head == pytest.approx(2 * bare + proj + block.compute + block.tp_comm + block.ep_comm + block.cp_comm)
    assert head > bare + block.compute  # the broken variant pays none of it


def test_mtp_block_is_held_by_the_last_stage_only() -> None:
    plan = ParallelPlan(tp=2, pp=8, dp=64, ep=64, micro_batch_size=1)
    with_mtp, without = all_stage_param_counts(DSV3, plan), all_stage_param_counts(NO_MTP, plan)
    block = layer_param_counts(DSV3, plan, DSV3.num_layers - 1)
    assert with_mtp[:-1] == without[:-1]
    assert with_mtp[-1].expert - without[-1].expert == block.expert
    assert with_mtp[-1].dense - without[-1].dense == block.dense + 2 * DSV3.hidden_size ** 2 // plan.tp
    acts = [stage_activation_bytes(m, plan, plan.pp - 1, num_microbatches=8) for m in (DSV3, NO_MTP)]
    assert acts[0] > acts[1]
    assert stage_activation_bytes(DSV3, plan, 0, num_microbatches=8) == \
        stage_activation_bytes(NO_MTP, plan, 0, num_microbatches=8)

