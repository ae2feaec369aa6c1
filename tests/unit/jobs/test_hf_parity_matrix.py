"""Issue 28's parity matrix on Hugging Face models: a dense Llama and a Qwen3-MoE, FP8 off and on.

Both models are built by ``transformers`` from tiny configs (no download), randomized
(``hf_fixtures.randomize``: O(1) logits, uneven routing) and saved with ``save_pretrained``; the
jobs load them through ``model: {hf: DIR}`` as users do. One set of four gloo ranks (no Ray) runs
every cell of both models and both precisions (``run_local_jobs``), two steps each, and each cell
is compared with the same job in one process (same data order):

- FP32: losses of both steps and the whole gradient of a probed weight after step 1 equal one
  process's (float tolerance, as the other parity tests).
- FP8 (``tensorwise``: E4M3 forward, E5M2 gradients, scales from each GEMM's own operands): a
  multi-rank run quantizes other tensors than one process does (a TP shard's weight, a CP rank's
  tokens, an ETP shard's hidden units), so it cannot equal one FP8 process. What must hold is that
  it is no further from exact (FP32) math than one FP8 process is: the probed gradient's distance
  from the FP32 gradient at most ``FP8_MARGIN`` times the single FP8 process's distance, measured
  in the same test. The rounding errors are sums over many elements of rounding steps no larger
  than one process's (a shard's or a subset's amax is at most the whole tensor's), so their norm
  concentrates near one process's; 1.5x is headroom for a different draw, not for a bug
  (measured 0.94-1.07x). The broken variants below land 2.7-5.4x out (the test asks for more
  than 2.25x). The gradient is the sharp check: the losses (one FP8 process 0.26-0.36% from FP32)
  separate less (working cells up to 1.5x, broken ones 1.6-2.0x), so they get a loose
  ``FP8_LOSS_MARGIN`` that only catches gross errors.
- Where the multi-rank run quantizes exactly the same tensors (ZeRO-2 over DP4 of the dense
  model: each rank's micro-batch is one of the reference's, FSDP gathers whole weights), FP8 must
  equal the single FP8 process at the FP32 tolerance.

Pipelines (interleaved 1F1B, DualPipeV) on the same two HF architectures, FP8 off and on, are in
``test_pipeline_schedules.py`` (every parameter's gradient, every micro-batch's loss).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rayfleet.jobs.local_processes import run_local, run_local_jobs  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from tests.unit.models.hf_fixtures import randomize  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 2e-6, 1e-4
FP8_MARGIN, FP8_LOSS_MARGIN = 1.5, 3.0
FP8 = "tensorwise"
PROBE = {"llama": "layers.1.attention.wq.weight",  # column-split under TP, fed by CP attention's backward
         "qwen3_moe": "layers.1.feed_forward.experts.w2"}  # row-split under ETP, experts over EP
CELLS = {  # (name, plan) on four ranks
    "llama": [("CP2 x TP2", ParallelPlan(cp=2, tp=2, micro_batch_size=1)),
              ("ZeRO-2 DP4", ParallelPlan(dp=4, zero_stage=2, micro_batch_size=1))],
    "qwen3_moe": [("CP2 x TP2 x EP2", ParallelPlan(cp=2, tp=2, ep=2, micro_batch_size=1)),
                  ("EP2 x ETP2 ZeRO-2 DP4", ParallelPlan(dp=4, ep=2, etp=2, zero_stage=2, micro_batch_size=1))],
}
BROKEN = [  # (model, cell name, train_worker control), all FP8: the harder case to catch
    ("llama", "CP2 x TP2", {"cp_control": "rank_order_kv"}),  # gathered K/V not put back in load-balanced order
    ("qwen3_moe", "CP2 x TP2 x EP2", {"cp_control": "rank_order_kv"}),
    ("qwen3_moe", "EP2 x ETP2 ZeRO-2 DP4", {"etp_control": "no_reduce"}),  # ETP partial outputs never summed
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False)
    configs = {"llama": LlamaConfig(**common),
               "qwen3_moe": Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True)}
    root = tmp_path_factory.mktemp("hf-matrix")
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize(model, seed=0)
        model.save_pretrained(root / name)
    return {name: str(root / name) for name in configs}


@pytest.fixture(scope="module")
def specs(hf_dirs, token_dataset) -> dict[tuple[str, str], TrainJobSpec]:
    return {(model, precision): TrainJobSpec.model_validate({
        "name": f"{model}-{precision}", "model": {"hf": uri}, "data": {"uri": token_dataset, "seq_len": 32},
        "steps": 2, "global_batch_size": 4, "precision": precision, "optimizer": {"lr": 1e-2, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 1}, "comm": {"a2a_overlap": False}})
        for model, uri in hf_dirs.items() for precision in ("fp32", FP8)}


@pytest.fixture(scope="module")
def references(specs) -> dict:
    return {key: run_local(spec, ParallelPlan(dp=1, micro_batch_size=1), grad_probe=PROBE[key[0]])
            for key, spec in specs.items()}


@pytest.fixture(scope="module")
def matrix(specs) -> dict:
    """{(model, precision, cell name, control): LocalRunResult} from one set of four ranks."""
    keys = [(model, precision, name, ()) for model, cells in CELLS.items() for precision in ("fp32", FP8)
            for name, _ in cells]
    keys += [(model, FP8, name, tuple(control.items())) for model, name, control in BROKEN]
    plans = {(model, name): plan for model, cells in CELLS.items() for name, plan in cells}
    results = run_local_jobs([(specs[(model, precision)], plans[(model, name)],
                               {"grad_probe": PROBE[model], **dict(control)})
                              for model, precision, name, control in keys])
    return dict(zip(keys, results))


def _grad(result, rank: int = 0) -> torch.Tensor:
    return result.metrics[rank][0]["grad_probe"]


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _loss_gap(result, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses))


def _fp8_bound(result, references, model: str) -> tuple[float, float, float, float]:
    """(grad gap, grad bound, loss gap, loss bound) of an FP8 run against the FP32 reference."""
    exact, fp8 = references[(model, "fp32")], references[(model, FP8)]
    grad_error, loss_error = _gap(_grad(fp8), _grad(exact)), _loss_gap(fp8, exact)
    assert grad_error > 1e-3 and loss_error > 1e-5  # FP8 was on in the reference
    worst = max(_gap(_grad(result, rank), _grad(exact)) for rank in range(len(result.metrics)))
    return worst, FP8_MARGIN * grad_error, _loss_gap(result, exact), FP8_LOSS_MARGIN * loss_error


CELL_IDS = [(model, name) for model, cells in CELLS.items() for name, _ in cells]


@pytest.mark.parametrize(("model", "name"), CELL_IDS)
def test_fp32_cell_equals_one_process(matrix, references, model, name) -> None:
    result, reference = matrix[(model, "fp32", name, ())], references[(model, "fp32")]
    ref_losses = torch.tensor(reference.losses, dtype=torch.float64)
    for rank, summary in enumerate(result.summaries):  # every rank reports the global loss
        torch.testing.assert_close(torch.tensor(summary.losses, dtype=torch.float64), ref_losses, rtol=LOSS_RTOL,
                                   atol=0)
        torch.testing.assert_close(_grad(result, rank), _grad(reference), rtol=GRAD_RTOL, atol=1e-7)


@pytest.mark.parametrize(("model", "name"), CELL_IDS)
def test_fp8_cell_is_as_close_to_fp32_as_one_fp8_process(matrix, references, model, name) -> None:
    grad_gap, grad_bound, loss_gap, loss_bound = _fp8_bound(matrix[(model, FP8, name, ())], references, model)
    assert grad_gap <= grad_bound, (grad_gap, grad_bound)
    assert loss_gap <= loss_bound, (loss_gap, loss_bound)


def test_fp8_zero2_over_dp_equals_one_fp8_process(matrix, references) -> None:
    """Same micro-batches and whole weights in every GEMM: the same FP8 quantization, so equal."""
    result, reference = matrix[("llama", FP8, "ZeRO-2 DP4", ())], references[("llama", FP8)]
    torch.testing.assert_close(torch.tensor(result.losses, dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(_grad(result), _grad(reference), rtol=GRAD_RTOL, atol=1e-7)


@pytest.mark.parametrize(("model", "name", "control"), BROKEN, ids=[f"{m}-{n}-{next(iter(c.values()))}"
                                                                    for m, n, c in BROKEN])
def test_broken_variants_miss_the_fp8_bound(matrix, references, model, name, control) -> None:
    grad_gap, grad_bound, _, _ = _fp8_bound(matrix[(model, FP8, name, tuple(control.items()))], references, model)
    assert grad_gap > 1.5 * grad_bound, (grad_gap, grad_bound)


def test_fp8_tp2_input_gradients_are_summed_over_tp_regression(matrix, references) -> None:
    """Regression (FP8 under TP): ``Fp8Linear`` unwrapped a column-split layer's replicated input
    with ``to_local()``, whose backward then took each TP rank's partial input gradient as the
    whole, so every gradient upstream of a column-split FP8 layer missed the peer shard's part.
    Llama TP2 FP8's q-projection gradient was 69% from FP32 (one FP8 process: 20%); now ~18%."""
    grad_gap, grad_bound, _, _ = _fp8_bound(matrix[("llama", FP8, "CP2 x TP2", ())], references, "llama")
    assert grad_gap <= grad_bound, (grad_gap, grad_bound)
