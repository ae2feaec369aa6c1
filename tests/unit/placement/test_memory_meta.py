"""Memory predictions equal the bytes of the actually sharded tensors (built on the meta device).

Each test builds, independently of the cost model, the modules one rank holds under a plan --
column/row-parallel attention and MLP shards, vocabulary-parallel embedding and head, the rank's
local experts split by expert TP -- and compares element counts and bytes with the prediction.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.memory_model import stage_memory, stage_param_counts
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import ParallelPlan, validate_plan

META = torch.device("meta")


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False, device=META, dtype=torch.bfloat16)


def _norm(n: int) -> nn.RMSNorm:
    return nn.RMSNorm(n, device=META, dtype=torch.bfloat16)


def _swiglu(h: int, width: int) -> nn.ModuleDict:
    return nn.ModuleDict({"w1": _linear(h, width), "w3": _linear(h, width), "w2": _linear(width, h)})


def _attention(m: ModelSpec, tp: int) -> nn.ModuleDict:
    h, nh, hd = m.hidden_size, m.num_heads, m.head_dim
    if m.kv_lora_rank:
        return nn.ModuleDict({
            "q_a": _linear(h, m.q_lora_rank), "q_norm": _norm(m.q_lora_rank),
            "q_b": _linear(m.q_lora_rank, nh // tp * (hd + m.rope_head_dim)),  # column parallel
            "kv_a": _linear(h, m.kv_lora_rank + m.rope_head_dim), "kv_norm": _norm(m.kv_lora_rank),  # replicated
            "kv_b": _linear(m.kv_lora_rank, nh // tp * 2 * hd), "o": _linear(nh // tp * hd, h),
        })
    kv_heads = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1  # GQA: replicate KV beyond kv heads
    return nn.ModuleDict({"q": _linear(h, nh // tp * hd), "k": _linear(h, kv_heads * hd),
                          "v": _linear(h, kv_heads * hd), "o": _linear(nh // tp * hd, h)})


def build_rank(m: ModelSpec, plan: ParallelPlan, stage: int) -> nn.Module:
    """The modules one rank of ``stage`` holds (any TP/EP coordinate: all are the same size)."""
    root = nn.ModuleDict()
    vocab_rows = -(-m.vocab_size // plan.tp)
    if stage == 0:
        root["embed"] = nn.Embedding(vocab_rows, m.hidden_size, device=META, dtype=torch.bfloat16)
    for layer in plan.stage_ranges(m.num_layers)[stage]:
        tp = plan.tp_of_layer(layer)
        block = nn.ModuleDict({"attn_norm": _norm(m.hidden_size), "attn": _attention(m, tp),
                               "mlp_norm": _norm(m.hidden_size)})
        if m.is_moe_layer(layer):
            block["router"] = _linear(m.hidden_size, m.num_experts)
            block["experts"] = nn.ModuleList(_swiglu(m.hidden_size, m.moe_ffn_hidden_size // plan.etp)
                                             for _ in range(m.num_experts // plan.ep))
            if m.num_shared_experts:
                block["shared"] = _swiglu(m.hidden_size, m.num_shared_experts * m.moe_ffn_hidden_size // tp)
        else:
            block["mlp"] = _swiglu(m.hidden_size, m.ffn_hidden_size // tp)
        root[f"layer{layer}"] = block
    if stage == plan.pp - 1:
        root["final_norm"] = _norm(m.hidden_size)
        root["head"] = _linear(m.hidden_size, vocab_rows)
    return root


def _numel(module: nn.Module, experts: bool) -> int:
    return sum(p.numel() for name, p in module.named_parameters() if (".experts." in name) == experts)


DENSE = ModelSpec(name="dense", num_layers=4, hidden_size=256, ffn_hidden_size=768, num_heads=8, num_kv_heads=2,
                  vocab_size=1000, seq_len=256, global_batch_sequences=64)
MIXTRAL_LIKE = ModelSpec(name="mixtral-like", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_heads=8,
                         num_kv_heads=4, vocab_size=1024, num_experts=8, top_k=2, moe_ffn_hidden_size=512,
                         seq_len=256, global_batch_sequences=64)
DEEPSEEK_LIKE = ModelSpec(name="deepseek-like", num_layers=5, hidden_size=256, ffn_hidden_size=640, num_heads=8,
                          num_kv_heads=8, head_dim=32, vocab_size=1000, num_experts=16, top_k=4, num_shared_experts=1,
                          moe_ffn_hidden_size=128, first_k_dense_layers=1, q_lora_rank=96, kv_lora_rank=64,
                          rope_head_dim=16, seq_len=256, global_batch_sequences=64)

CASES = [
    (DENSE, ParallelPlan(tp=1, dp=8)),
    (DENSE, ParallelPlan(tp=4, pp=2, dp=2)),           # tp > kv heads: one KV head per rank
    (DENSE, ParallelPlan(tp=2, pp=2, dp=2, stage_starts=(0, 3))),
    (MIXTRAL_LIKE, ParallelPlan(tp=1, dp=8, ep=8)),
    (MIXTRAL_LIKE, ParallelPlan(tp=2, pp=2, dp=4, ep=4, etp=2)),
    (MIXTRAL_LIKE, ParallelPlan(tp=4, dp=4, ep=8, etp=1)),  # EP folded over TP ranks
    (DEEPSEEK_LIKE, ParallelPlan(tp=2, pp=2, dp=4, ep=8, stage_starts=(0, 2))),
    (DEEPSEEK_LIKE, ParallelPlan(tp=1, pp=5, dp=4, ep=4)),
    (DEEPSEEK_LIKE, ParallelPlan(tp=4, dp=2, ep=2, etp=4)),
    (DENSE, ParallelPlan(tp=4, dp=2, layer_tp=(4, 2, 2, 4))),  # heterogeneous TP
]


@pytest.mark.parametrize("model,plan", CASES, ids=[f"{m.name}-{p.describe()}" for m, p in CASES])
def test_parameter_bytes_equal_sharded_meta_tensors(model: ModelSpec, plan: ParallelPlan) -> None:
    validate_plan(plan, model, world_size=plan.world_size, scaleup_domain_size=8)
    params = CostParams()
    for stage in range(plan.pp):
        rank = build_rank(model, plan, stage)
        counts = stage_param_counts(model, plan, stage)
        assert counts.dense == _numel(rank, experts=False)
        assert counts.expert == _numel(rank, experts=True)

        mem = stage_memory(model, plan, stage, num_microbatches=4, params=params)
        weights = sum(p.numel() * p.element_size() for p in rank.parameters())
        grads = sum(torch.empty_like(p, dtype=torch.float32).nbytes for p in rank.parameters())
        # ZeRO-1: FP32 master + Adam m, v of this rank's shard of each optimizer group
        dense_flat = torch.empty(_numel(rank, experts=False), device=META).chunk(plan.dp * plan.cp)[0]
        expert_flat = torch.empty(max(1, _numel(rank, experts=True)), device=META).chunk(plan.edp)[0]
        optimizer = 3 * dense_flat.nbytes + (3 * expert_flat.nbytes if counts.expert else 0)
        assert mem.weights == weights
        assert mem.gradients == grads
        assert mem.optimizer == pytest.approx(optimizer, rel=1e-12)


def test_total_params_match_a_whole_unsharded_model() -> None:
    for model in (DENSE, MIXTRAL_LIKE, DEEPSEEK_LIKE):
        whole = build_rank(model, ParallelPlan(), 0)
        assert sum(p.numel() for p in whole.parameters()) == model.total_params()


def test_broken_sharding_is_caught() -> None:
    """The comparison is sharp: forgetting to split the MLP over TP changes the count."""
    plan = ParallelPlan(tp=2, dp=4)
    rank = build_rank(DENSE, plan, 0)
    rank["layer0"]["mlp"] = _swiglu(DENSE.hidden_size, DENSE.ffn_hidden_size)  # unsharded by mistake
    assert stage_param_counts(DENSE, plan, 0).dense != _numel(rank, experts=False)


def test_fp8_weight_copies_are_sharded_by_zero3() -> None:
    """Regression (issue 20): the FP8 weight copy was never sharded, even under ZeRO-3."""
    from dataclasses import replace

    from rayfleet.placement.cost_params import CostParams

    with_copy = replace(CostParams(), fp8_primary_weights=False)  # a BF16 weight plus its FP8 copies
    plan = ParallelPlan(tp=2, dp=4, ep=8, zero_stage=3)
    m = MIXTRAL_LIKE
    counts = stage_param_counts(m, plan, 0)
    gathered = 2 * counts.total / m.num_layers  # two layers prefetched, unsharded
    bf16 = stage_memory(m, plan, 0, num_microbatches=1)
    assert bf16.weights == pytest.approx(2 * (counts.dense / 4 + counts.expert / plan.edp) + 2 * gathered)
    fp8 = stage_memory(replace(m, precision="fp8"), plan, 0, num_microbatches=1, params=with_copy)
    assert fp8.weights - bf16.weights == pytest.approx(2 * (counts.dense / 4 + counts.expert / plan.edp)
                                                       + 2 * gathered)
    # without ZeRO-3 every rank keeps its whole FP8 copy
    zero1 = replace(plan, zero_stage=1)
    assert (stage_memory(replace(m, precision="fp8"), zero1, 0, num_microbatches=1, params=with_copy).weights
            - stage_memory(m, zero1, 0, num_microbatches=1).weights) == 2 * counts.total
    # FP8 primary weights (the default, Megatron-Bridge's fp8_param_gather): no BF16 copy, so the
    # FP8 model stores as many bytes as the BF16 one
    assert stage_memory(replace(m, precision="fp8"), zero1, 0, num_microbatches=1).weights == \
        stage_memory(m, zero1, 0, num_microbatches=1).weights


def test_zero_stages_shard_more_and_bf16_moments_save_four_bytes() -> None:
    from dataclasses import replace

    plan = ParallelPlan(tp=2, dp=4, ep=8)
    deep = replace(MIXTRAL_LIKE, num_layers=16)  # ZeRO-3's two gathered layers are a small share
    mems = {z: stage_memory(deep, replace(plan, zero_stage=z), 0, num_microbatches=1) for z in (0, 1, 2, 3)}
    totals = [mems[z].weights + mems[z].gradients + mems[z].optimizer for z in (0, 1, 2, 3)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    counts = stage_param_counts(deep, plan, 0)
    bf16 = stage_memory(deep, replace(plan, optimizer_dtype="bf16"), 0, num_microbatches=1)
    assert mems[1].optimizer - bf16.optimizer == pytest.approx(4 * (counts.dense / 4 + counts.expert / plan.edp))


def test_virtual_stages_keep_more_microbatches_in_flight() -> None:
    from dataclasses import replace

    plan = ParallelPlan(tp=2, pp=4, dp=2)
    base = stage_memory(DENSE, plan, 0, num_microbatches=8).activations
    vp = stage_memory(DENSE, replace(plan, vpp=2), 0, num_microbatches=8).activations
    assert vp == pytest.approx(base * (1 + 3 / 8))


def test_activations_shrink_with_recompute_and_grow_with_microbatch() -> None:
    from dataclasses import replace

    base = ParallelPlan(tp=2, pp=2, dp=2, micro_batch_size=2)
    acts = {rc: stage_memory(DENSE, replace(base, recompute=rc), 0, num_microbatches=8).activations
            for rc in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    small = stage_memory(DENSE, replace(base, micro_batch_size=1), 0, num_microbatches=8).activations
    assert small == pytest.approx(acts["none"] / 2)
    # 1F1B: the first stage keeps pp micro-batches in flight, the last only one
    last = stage_memory(DENSE, base, 1, num_microbatches=8)
    assert last.activations < acts["none"]


def test_counts_match_rayfleet_models_built_on_meta() -> None:
    """When the real model package is present, its meta-device model has exactly the parameters
    the planner's spec predicts (GQA attention; untied embedding and head)."""
    config_mod = pytest.importorskip("rayfleet.models.config")
    transformer = pytest.importorskip("rayfleet.models.transformer")
    for name in ("tiny", "small"):
        if name not in config_mod.PRESETS:
            continue
        c = config_mod.PRESETS[name]
        spec = ModelSpec(name=name, num_layers=c.num_layers, hidden_size=c.dim, ffn_hidden_size=c.ffn_dim,
                         num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                         vocab_size=c.vocab_size, num_experts=c.num_experts, top_k=c.top_k,
                         num_shared_experts=c.num_shared_experts, moe_ffn_hidden_size=c.moe_ffn_dim,
                         first_k_dense_layers=c.num_dense_layers)
        model = transformer.build_model(c, device="meta")
        assert sum(p.numel() for p in model.parameters()) == spec.total_params()
        whole = stage_param_counts(spec, ParallelPlan(), 0)
        assert whole.total == spec.total_params()
