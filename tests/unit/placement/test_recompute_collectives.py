"""Full recompute reruns the layer's forward collectives (issue 27, ranking round).

Regression named after what it fixed: full recompute was priced as one more forward of the
layer's *compute* only, so a fully recomputed plan paid its EP dispatch/combine and its TP pair
once, as if backward could rebuild the layer's activations without communicating. Megatron's
full recompute checkpoints each transformer layer and calls its forward again in backward
(Megatron-Bridge, "Activation Recomputation": "the whole layer forward is executed again during
backward"), token dispatcher and sequence-parallel collectives included; MindSpeed's MoE
"zero memory" feature names the same cost ("re-communication"). The planner's DeepSeek-V3 and
Qwen3-235B favourites were fully recomputed EP16/EP8 ZeRO-3 shapes that got that rerun free.

Worked example (the module's MOE model, EP8 inside one H100 server, BF16, no EP overlap): a
forward dispatch ``d`` and combine ``r`` plus backward's two ``r`` is ``d + 3r``; full recompute
adds ``d + r``, so with BF16 on the wire (``d == r``) the layer's all-to-all is 6/4 of a plan
without recompute. The TP pair (all-gather + reduce-scatter forward, both mirrored backward)
likewise goes from ``ag + 3 rs`` to ``2 ag + 4 rs``: 6/4 in BF16.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan
from rayfleet.placement.step_time_model import layer_time
from rayfleet.platform.catalogue import get_accelerator

H100 = get_accelerator("H100")
MOE = ModelSpec(name="moe", num_layers=8, hidden_size=2048, ffn_hidden_size=8192, num_heads=16, num_kv_heads=8,
                vocab_size=32000, num_experts=64, top_k=4, moe_ffn_hidden_size=1024, seq_len=4096,
                global_batch_sequences=256, precision="bf16")
PLAN = ParallelPlan(tp=1, dp=8, ep=8, ep_overlap=False)


def _moe_layer(model: ModelSpec) -> int:
    return next(i for i in range(model.num_layers) if model.is_moe_layer(i))


def _dense_layer(model: ModelSpec) -> int:
    return next(i for i in range(model.num_layers) if not model.is_moe_layer(i))


def test_full_recompute_pays_the_forward_all_to_all_again() -> None:
    layer = _moe_layer(MOE)
    none = layer_time(MOE, PLAN, layer, H100).ep_comm
    full = layer_time(MOE, replace(PLAN, recompute="full"), layer, H100).ep_comm
    selective = layer_time(MOE, replace(PLAN, recompute="selective"), layer, H100).ep_comm
    assert none > 0
    assert full == pytest.approx(none * 6 / 4)
    # the broken variant (recompute priced as compute only) leaves the all-to-all unchanged
    assert full != pytest.approx(none)
    # selective recompute reruns norms / activations inside a rank: no collective again
    assert selective == pytest.approx(none)


def test_full_recompute_pays_the_forward_tp_pair_again() -> None:
    plan = ParallelPlan(tp=4, dp=2, tp_overlap=False)
    dense = ModelSpec(name="dense", num_layers=4, hidden_size=4096, ffn_hidden_size=14336, num_heads=32,
                      num_kv_heads=8, vocab_size=32000, seq_len=4096, global_batch_sequences=64, precision="bf16")
    layer = _dense_layer(dense)
    none = layer_time(dense, plan, layer, H100).tp_comm
    full = layer_time(dense, replace(plan, recompute="full"), layer, H100).tp_comm
    assert none > 0 and full == pytest.approx(none * 6 / 4)
