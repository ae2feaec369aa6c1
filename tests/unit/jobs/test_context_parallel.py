"""Context parallelism: the chunk-pair attention math, the data split, and every model family on two ranks.

The pure tests check :func:`attend_chunks` (what one CP rank computes from its queries and the
gathered K/V) against causal attention over the whole sequence, forward and backward, for
cp = 2 and 3, grouped-query heads and MLA-shaped heads (value width != q/k width); the two
broken variants (gathered K/V in rank order, no causal mask inside a chunk) must miss.

The three-rank test (this file is also the ranks' script; cp = 3, so the ring's next and
previous ranks differ) builds each model family the trainer runs — rayfleet's MoE, Llama,
Qwen3-MoE (both through the HF config mapping) and DeepSeek-V3's MLA — once whole and once with
:func:`apply_context_parallel` for each K/V exchange (all-gather, ring), feeds the CP model each
rank's chunks, and compares the loss (global token mean) and every parameter gradient (summed
over the CP ranks) with the whole-sequence model on the same rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from rayfleet.jobs.parallel.context_parallel import (_global_chunks, attend_chunks, cp_positions, merge_partials,
                                                     block_attention, split_for_context_parallel)
from rayfleet.models.layers import causal_attention

HERE = Path(__file__).resolve()
SEQ_LEN = 24


def _family_configs() -> dict:
    from rayfleet.models.config import MoEConfig
    from rayfleet.models.hf.config_map import from_hf_config

    small = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                 rms_norm_eps=1e-6, rope_theta=10000.0)
    return {
        "rayfleet-moe": MoEConfig(vocab_size=96, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
                                  moe_ffn_dim=32, num_experts=4, top_k=2, num_dense_layers=1, max_seq_len=64),
        "llama": from_hf_config({**small, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2,
                                 "intermediate_size": 64}).config,
        "qwen3-moe": from_hf_config({**small, "architectures": ["Qwen3MoeForCausalLM"], "num_key_value_heads": 2,
                                     "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 32,
                                     "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}).config,
        "deepseek-v3-mla": from_hf_config({**small, "architectures": ["DeepseekV3ForCausalLM"], "intermediate_size": 64,
                                           "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                           "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                                           "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                                           "v_head_dim": 6}).config,
    }


def _rank_main(out_dir: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from rayfleet.jobs.local_processes import leave_after_barrier
    from rayfleet.jobs.parallel.context_parallel import ContextParallelAttention, apply_context_parallel, model_inputs
    from rayfleet.jobs.parallel.context_parallel_ring import RingAttention
    from rayfleet.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    report = {}
    for name, config, exchange in [(n, c, e) for n, c in _family_configs().items() for e in ("all_gather", "ring")]:
        tokens = torch.randint(0, config.vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(7))
        whole_tokens = tokens[:, 1:].numel()
        whole = build_model(config, seed=3)
        logits = whole(tokens[:, :-1])
        ref_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum")
        (ref_loss / whole_tokens).backward()
        split = build_model(config, seed=3)
        core = RingAttention if exchange == "ring" else ContextParallelAttention
        attend = core(group=dist.group.WORLD, cp_rank=rank, cp=cp)
        assert apply_context_parallel(split, attend=attend, cp_rank=rank, cp=cp) == config.num_layers
        inputs, targets = model_inputs(tokens, cp_rank=rank, cp=cp)
        logits = split(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        (loss / whole_tokens).backward()  # the global token mean: every rank divides by all tokens
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst, grads = 0.0, dict(whole.named_parameters())
        for pname, param in split.named_parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad)  # CP ranks act as data-parallel ranks for parameter gradients
            ref = grads[pname].grad if grads[pname].grad is not None else torch.zeros_like(grad)
            worst = max(worst, float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
        report[f"{name}/{exchange}"] = {"loss": float(total), "ref_loss": float(ref_loss), "worst_grad_rel": worst,
                                        "local_tokens": targets.numel(), "whole_tokens": whole_tokens, "cp": cp}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    leave_after_barrier()


@pytest.fixture(scope="module")
def family_reports(tmp_path_factory) -> list[dict]:
    from rayfleet.jobs.local_processes import run_script_ranks

    out = tmp_path_factory.mktemp("cp_families")
    run_script_ranks(str(HERE), [str(out)], 3)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1, 2)]


@pytest.mark.parametrize("exchange", ["all_gather", "ring"])
@pytest.mark.parametrize("family", ["rayfleet-moe", "llama", "qwen3-moe", "deepseek-v3-mla"])
def test_cp3_matches_the_whole_sequence_for_each_model_family(family_reports, family, exchange) -> None:
    for report in family_reports:
        got = report[f"{family}/{exchange}"]
        assert got["cp"] == 3 and got["local_tokens"] * 3 == got["whole_tokens"]  # a third of the tokens each
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5)
        assert got["worst_grad_rel"] < 1e-4, got


# --- the chunk-pair math, pure ------------------------------------------------------------

def _qkv(*, heads: int, kv_heads: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, SEQ_LEN, 8), (2, kv_heads, SEQ_LEN, 8), (2, kv_heads, SEQ_LEN, dv)]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes)


def _cp_output_and_grads(q, k, v, weight, *, cp: int, control: str):
    """Every rank's attend_chunks on its share (K/V laid out as the all-gather delivers them)."""
    total = 0.0
    outs = []
    for rank in range(cp):
        mine = cp_positions(SEQ_LEN, cp_rank=rank, cp=cp)
        k_gathered = [k[:, :, cp_positions(SEQ_LEN, cp_rank=j, cp=cp)] for j in range(cp)]
        v_gathered = [v[:, :, cp_positions(SEQ_LEN, cp_rank=j, cp=cp)] for j in range(cp)]
        out = attend_chunks(q[:, :, mine], _global_chunks(k_gathered, cp=cp, control=control),
                            _global_chunks(v_gathered, cp=cp, control=control), cp_rank=rank, cp=cp,
                            control=control)
        outs.append((mine, out))
        total = total + (out * weight[:, :, mine]).sum()
    grads = torch.autograd.grad(total, (q, k, v))
    return outs, grads


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("heads, kv_heads, dv", [(4, 2, 8), (4, 4, 6)])  # GQA; MLA-shaped (v width 6)
def test_chunk_pairs_equal_causal_attention_forward_and_backward(cp, heads, kv_heads, dv) -> None:
    q, k, v = _qkv(heads=heads, kv_heads=kv_heads, dv=dv)
    ref = causal_attention(q, k, v)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    outs, grads = _cp_output_and_grads(q, k, v, weight, cp=cp, control="none")
    for mine, out in outs:
        torch.testing.assert_close(out, ref[:, :, mine], rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("control", ["rank_order_kv", "unmasked_diagonal"])
def test_broken_variants_miss_causal_attention(control) -> None:
    q, k, v = _qkv(heads=4, kv_heads=2, dv=8)
    ref = causal_attention(q, k, v)
    weight = torch.ones_like(ref)
    outs, _ = _cp_output_and_grads(q, k, v, weight, cp=2, control=control)
    worst = max(float((out - ref[:, :, mine]).detach().abs().max()) for mine, out in outs)
    assert worst > 0.1


def test_merge_of_partials_is_the_softmax_over_their_union() -> None:
    q, k, v = _qkv(heads=2, kv_heads=2, dv=8)
    whole, _ = block_attention(q, k, v, causal=False)
    blocks = (slice(0, 5), slice(5, 17), slice(17, None))
    parts = [block_attention(q, k[:, :, s], v[:, :, s], causal=False) for s in blocks]
    torch.testing.assert_close(merge_partials(parts), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_load_balanced_split_hands_each_token_to_one_rank_at_its_global_position(cp) -> None:
    tokens = torch.arange(2 * (SEQ_LEN + 1)).reshape(2, SEQ_LEN + 1)
    seen = []
    loads = []
    for rank in range(cp):
        share = split_for_context_parallel(tokens, cp_rank=rank, cp=cp)
        torch.testing.assert_close(share.inputs, tokens[:, :-1].gather(1, share.positions))
        torch.testing.assert_close(share.targets, tokens[:, 1:].gather(1, share.positions))
        seen += share.positions[0].tolist()
        loads.append(sum(p + 1 for p in share.positions[0].tolist()))  # causal keys attended
    assert sorted(seen) == list(range(SEQ_LEN))
    assert max(loads) - min(loads) <= (SEQ_LEN // (2 * cp)) ** 2  # balanced up to one chunk's triangle
    chunk = SEQ_LEN // (2 * cp)
    assert cp_positions(SEQ_LEN, cp_rank=0, cp=cp)[-1] == SEQ_LEN - 1  # rank 0 also holds the last chunk
    assert cp_positions(SEQ_LEN, cp_rank=0, cp=cp)[:chunk].tolist() == list(range(chunk))


def test_seq_len_not_divisible_by_two_cp_is_refused_with_the_fix(job_dict) -> None:
    from rayfleet.errors import SpecError
    from rayfleet.jobs.spec import TrainJobSpec

    bad = {**job_dict, "resources": {"num_workers": 3}, "plan": {"cp": 3, "dp": 1}}  # seq_len 32
    with pytest.raises((SpecError, ValueError), match="divisible by 6"):
        TrainJobSpec.model_validate(bad)
    ok = {**job_dict, "resources": {"num_workers": 2}, "plan": {"cp": 2, "dp": 1}}
    assert TrainJobSpec.model_validate(ok).plan.cp == 2  # the capability table runs CP now


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _rank_main(sys.argv[1])
