"""Expert-tensor-parallel training runs against the single-process reference (real gloo processes).

Each 4-rank run trains the tiny MoE (4 experts, hidden 64, split into two halves of 32) on the
same data order for 3 steps and must reproduce the reference's losses and the whole gradient of a
row-parallel (``w2``) or column-parallel (``w1``) expert weight, or of a router, after step 1:
the hidden-unit split, the ETP all-gather of rows, the reduce-scatter of partial outputs, the EP
dispatch around them and the EDP gradient reduction all have to be right for that. The broken
variant (``etp_control="no_reduce"``: each rank keeps its own partial output, the reduce left
out) must miss.
"""

from __future__ import annotations

import pytest
import torch

from rayfleet.jobs.checkpoint.hook import FlashCheckpointHook
from rayfleet.jobs.local_processes import run_local, run_local_many
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.models.expert_tensor_parallel import expert_major_order
from rayfleet.placement.plan import ParallelPlan

from run_hooks import StopAfter

W2 = "layers.1.feed_forward.experts.w2"  # row-parallel under ETP
W1 = "layers.2.feed_forward.experts.w1"  # column-parallel under ETP
ROUTER = "layers.2.feed_forward.router.weight"
LOSS_RTOL = 2e-6
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def spec(token_dataset) -> TrainJobSpec:
    return TrainJobSpec.model_validate({
        "name": "etp-parity", "model": {"preset": "tiny"}, "data": {"uri": token_dataset, "seq_len": 32},
        "steps": 3, "global_batch_size": 4, "precision": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 1}, "comm": {"a2a_overlap": False}})


@pytest.fixture(scope="module")
def references(spec):
    return {name: run_local(spec, ParallelPlan(dp=1, micro_batch_size=2), grad_probe=name) for name in (W2, W1, ROUTER)}


def _assert_losses(result, reference) -> None:
    ref = torch.tensor(reference.losses, dtype=torch.float64)
    for summary in result.summaries:  # every rank reports the global loss
        torch.testing.assert_close(torch.tensor(summary.losses, dtype=torch.float64), ref, rtol=LOSS_RTOL, atol=0)


def _assert_matches(result, reference) -> None:
    _assert_losses(result, reference)
    expected = reference.metrics[0][0]["grad_probe"]
    for metrics in result.metrics:
        assert metrics[0]["tokens"] == reference.metrics[0][0]["tokens"]
        torch.testing.assert_close(metrics[0]["grad_probe"], expected, rtol=GRAD_RTOL, atol=1e-7)


def _loss_gap(result, reference) -> float:
    got = torch.tensor(result.losses, dtype=torch.float64)
    ref = torch.tensor(reference.losses, dtype=torch.float64)
    return float(((got - ref).abs() / ref.abs()).max())


def test_expert_major_order_worked_example() -> None:
    # peer 0 holds a (expert 0) and b b (expert 1); peer 1 holds c c c (expert 0)
    order = expert_major_order(torch.tensor([[1, 2], [3, 0]]))
    assert order.tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_major_order(torch.zeros(2, 3, dtype=torch.int64)).tolist() == []


def test_four_ranks_ep2_etp2_and_etp2_match_and_a_missing_etp_reduce_does_not(spec, references) -> None:
    """EP2 x ETP2 over the DP ranks (EDP=1, experts outside FSDP); EP2 x ETP2 on TP2 x DP2 (ETP is
    the TP pair, which splits its tokens first); ETP2 alone over DP4 (experts FSDP-sharded over
    EDP=2, gradients rescaled; ZeRO-1 and ZeRO-3); ETP2 = TP2 without EP (router gradient: TP-summed over the split
    tokens); CP2 x EP2 x ETP2; PP2 x ETP2 (losses); and the ETP reduce left out."""
    results = run_local_many(spec, [
        (ParallelPlan(dp=4, ep=2, etp=2, micro_batch_size=1), {"grad_probe": W2}),
        (ParallelPlan(tp=2, dp=2, ep=2, etp=2, micro_batch_size=1), {"grad_probe": W1}),
        (ParallelPlan(dp=4, etp=2, micro_batch_size=1), {"grad_probe": W1}),
        (ParallelPlan(dp=4, etp=2, micro_batch_size=1, zero_stage=3), {"grad_probe": W2}),
        (ParallelPlan(tp=2, dp=2, etp=2, micro_batch_size=1), {"grad_probe": ROUTER}),
        (ParallelPlan(cp=2, dp=2, ep=2, etp=2, micro_batch_size=1), {"grad_probe": W2}),
        (ParallelPlan(pp=2, dp=2, etp=2, micro_batch_size=1), {}),
        (ParallelPlan(dp=4, ep=2, etp=2, micro_batch_size=1), {"grad_probe": W2, "etp_control": "no_reduce"}),
    ])
    _assert_matches(results[0], references[W2])
    _assert_matches(results[1], references[W1])
    _assert_matches(results[2], references[W1])
    _assert_matches(results[3], references[W2])
    _assert_matches(results[4], references[ROUTER])
    _assert_matches(results[5], references[W2])
    _assert_losses(results[6], references[W2])
    broken = results[7]
    assert _loss_gap(broken, references[W2]) > 100 * LOSS_RTOL
    with pytest.raises(AssertionError):
        _assert_matches(broken, references[W2])


def test_ep2_etp2_with_overlapped_dispatch_matches(spec, references) -> None:
    """The EP dispatcher's two overlapped chunks each run the ETP collectives around their experts."""
    overlap = spec.model_copy(update={"comm": spec.comm.model_copy(update={"a2a_overlap": True})})
    (result,) = run_local_many(overlap, [(ParallelPlan(tp=2, dp=2, ep=2, etp=2, micro_batch_size=1),
                                          {"grad_probe": W2})])
    _assert_matches(result, references[W2])
    hidden = [m["a2a_hidden_fraction"] for m in result.metrics[0]]
    assert all(h is not None and 0.0 <= h <= 1.0 for h in hidden)


def test_fp8_ep2_etp2_stays_close_to_the_fp8_reference(spec) -> None:
    """FP8 (tensorwise) scales each ETP shard's GEMMs by its own weights and rows: near, not equal."""
    fp8 = spec.model_copy(update={"precision": "tensorwise"})
    ref = run_local(fp8, ParallelPlan(dp=1, micro_batch_size=2))
    (etp,) = run_local_many(fp8, [(ParallelPlan(dp=4, ep=2, etp=2, micro_batch_size=1), {})])
    losses = torch.tensor(etp.losses)
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]
    assert _loss_gap(etp, ref) < 0.01




def _storage_hook(job: str, uri: str) -> FlashCheckpointHook:
    return FlashCheckpointHook(job=job, snapshot_every=1, persist_every=1, checkpoint_uri=uri, shm_root=None)


def test_ep2_etp2_checkpoints_reshard_to_one_process_and_back(spec, references, tmp_path) -> None:
    """An EP2 x ETP2 run stopped after step 1 continues at one process from storage with the
    reference's remaining losses; a one-process checkpoint continues at EP2 x ETP2 the same way."""
    etp_plan, one = ParallelPlan(dp=4, ep=2, etp=2, micro_batch_size=1), ParallelPlan(dp=1, micro_batch_size=2)
    ref = torch.tensor(references[W2].losses[1:], dtype=torch.float64)
    for first, then, name in ((etp_plan, one, "from-etp"), (one, etp_plan, "into-etp")):
        uri = str(tmp_path / name)
        (stopped,) = run_local_many(spec, [(first, {"should_stop": StopAfter(1)})], hooks=_storage_hook(name, uri))
        assert stopped.summaries[0].stopped and stopped.summaries[0].steps_completed == 1
        (resumed,) = run_local_many(spec, [(then, {})], hooks=_storage_hook(f"{name}-resumed", uri))
        assert resumed.summaries[0].first_step == 1
        for summary in resumed.summaries:
            torch.testing.assert_close(torch.tensor(summary.losses, dtype=torch.float64), ref, rtol=LOSS_RTOL,
                                       atol=0)


def test_a_qwen3_moe_shaped_model_matches_at_ep2_etp2_and_tp2(spec) -> None:
    """The Hugging Face Qwen3-MoE mapping (softmax router, QK-norm, no shared experts, every layer
    MoE), random-initialized: EP2 x ETP2, ETP2 over DP4 and TP2 x DP2 x EP2 x ETP2 equal one process.
    (TP2 left the reference by ~4e-5 until the QK-norm gradients were summed over TP.)"""
    from dataclasses import asdict

    from rayfleet.models.hf.config_map import from_hf_config

    config = from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 320, "hidden_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
                             "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                             "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}).config
    assert config.num_shared_experts == 0 and config.router_score == "softmax"
    qwen = spec.model_copy(update={"model": spec.model.model_copy(update={"preset": None, "config": asdict(config)})})
    probe = "layers.0.feed_forward.experts.w2"
    reference = run_local(qwen, ParallelPlan(dp=1, micro_batch_size=2), grad_probe=probe)
    results = run_local_many(qwen, [
        (ParallelPlan(dp=4, ep=2, etp=2, micro_batch_size=1), {"grad_probe": probe}),
        (ParallelPlan(dp=4, etp=2, micro_batch_size=1), {"grad_probe": probe}),
        (ParallelPlan(tp=2, dp=2, ep=2, etp=2, micro_batch_size=1), {"grad_probe": probe}),
    ])
    for result in results:
        _assert_matches(result, reference)
