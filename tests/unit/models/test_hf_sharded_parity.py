"""Sharded training forward of an HF model equals transformers (issue 16: "the same with TP/EP/FSDP").

A tiny random Qwen3-MoE (fp32) is trained for ONE step from ``model: {hf: DIR}`` on two real
gloo processes (``run_local_many``, no Ray) under TP2, DP2 x EP2 (FSDP2 on the non-expert
weights) and DP2 with ZeRO-3. The step-1 loss the job reports is computed before the optimizer
update, so it must equal transformers' mean token cross-entropy on the same global batch, which
the test rebuilds from the job's deterministic data order (and checks through the reported
``sample_ids_hash``). rayfleet's trainer has no auxiliary balance loss (router-bias balancing,
applied after the step), and transformers adds none without ``output_router_logits``: both sides
are the plain LM loss. The next batch's transformers loss must differ from the job's loss by far
more than the tolerance, so a wrong batch cannot pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("rayfleet.jobs.parallel", reason="the train loop needs rayfleet.jobs.parallel")
transformers = pytest.importorskip("transformers")

from rayfleet.jobs.data import SampleOrder, TokenSamples  # noqa: E402
from rayfleet.jobs.local_processes import run_local_many  # noqa: E402
from rayfleet.jobs.loop import sample_ids_hash  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from tests.unit.models.hf_fixtures import save_tiny_moe_with_data  # noqa: E402

SEQ_LEN, GLOBAL_BATCH = 32, 4
ATOL = 1e-4
LAYOUTS = {
    "tp2": ParallelPlan(tp=2, micro_batch_size=2),
    "dp2_ep2_fsdp": ParallelPlan(dp=2, ep=2, micro_batch_size=2),
    "dp2_zero3": ParallelPlan(dp=2, micro_batch_size=2, zero_stage=3),
}


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    """A tiny random Qwen3-MoE HF dir (with its own BPE tokenizer) and a token dataset for it."""
    root = tmp_path_factory.mktemp("hfpar")
    save_tiny_moe_with_data(root, seed=3, shard_tokens=256, seq_len=SEQ_LEN)
    return root


def _spec(root) -> TrainJobSpec:
    return TrainJobSpec.model_validate({
        "name": "hf-sharded-parity", "model": {"hf": str(root / "hf")},
        "data": {"uri": str(root / "data"), "seq_len": SEQ_LEN}, "steps": 1, "global_batch_size": GLOBAL_BATCH,
        "precision": "fp32", "resources": {"num_workers": 2}, "comm": {"a2a_overlap": False},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 0, "kind": "constant"}})


def _global_batch(root, step: int) -> tuple[list[int], torch.Tensor]:
    """Sample ids and tokens ``[GLOBAL_BATCH, SEQ_LEN + 1]`` of 0-based ``step`` (the job's order)."""
    samples = TokenSamples(str(root / "data"), SEQ_LEN)
    order = SampleOrder(samples.num_samples, seed=0, chunk=samples.samples_per_shard,
                        window_chunks=max(1, samples.cached_shards // 2))
    ids = order.ids(step * GLOBAL_BATCH, GLOBAL_BATCH).tolist()
    return ids, samples.get(ids)


def _hf_loss(root, tokens: torch.Tensor) -> float:
    """transformers' mean next-token cross-entropy over every target token of ``tokens``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    assert not model.config.output_router_logits  # no aux loss on this side either
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.double()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def test_sharded_training_step_loss_equals_transformers(hf_job) -> None:
    spec = _spec(hf_job)
    results = run_local_many(spec, [(plan, {}) for plan in LAYOUTS.values()])
    ids, tokens = _global_batch(hf_job, 0)
    reference = _hf_loss(hf_job, tokens)
    _, next_tokens = _global_batch(hf_job, 1)
    wrong_batch = _hf_loss(hf_job, next_tokens)
    diffs = {}
    for name, result in zip(LAYOUTS, results):
        for rank, (summary, metrics) in enumerate(zip(result.summaries, result.metrics)):
            assert metrics[0]["sample_ids_hash"] == sample_ids_hash(ids), (name, rank)
            assert metrics[0]["tokens"] == GLOBAL_BATCH * SEQ_LEN, (name, rank)
            diffs[f"{name}/rank{rank}"] = abs(summary.losses[0] - reference)
            assert diffs[f"{name}/rank{rank}"] <= ATOL, (name, rank, summary.losses[0], reference)
        # the check can fail: the job's loss is far from transformers' loss on another batch
        assert abs(result.losses[0] - wrong_batch) > 100 * ATOL, (name, result.losses[0], wrong_batch)
    print(f"hf sharded parity: reference {reference:.6f}, max |diff| {max(diffs.values()):.2e}")
