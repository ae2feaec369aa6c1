"""Validation during training (``eval:``): which samples, the spec's errors, val_loss in the loop's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("rayfleet.jobs.parallel", reason="the train loop needs rayfleet.jobs.parallel")

from rayfleet.errors import SpecError  # noqa: E402
from rayfleet.jobs.data import TokenSamples  # noqa: E402
from rayfleet.jobs.evaluation import eval_sample_ids, is_eval_step, replica_eval_ids  # noqa: E402
from rayfleet.jobs.local_processes import run_local  # noqa: E402
from rayfleet.jobs.planning import check_dataset  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.jobs.train_metrics import plot_metrics  # noqa: E402
from rayfleet.models import build_model  # noqa: E402
from rayfleet.models.config import MoEConfig  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from rayfleet.storage.model_registry import load_servable  # noqa: E402
from rayfleet.storage.tokens import CharCodec, prepare_token_dataset, write_token_dataset  # noqa: E402


@pytest.fixture(scope="module")
def val_dataset(tmp_path_factory) -> str:
    """Held-out byte-tokenized text (the training fixture's tokenizer), ~6k tokens."""
    root = tmp_path_factory.mktemp("val")
    (root / "src").mkdir()
    (root / "src" / "held_out.txt").write_text("the router sends each token to its experts; " * 140)
    prepare_token_dataset([str(root / "src")], str(root / "val"), shard_tokens=2048, seq_len=64, glob="*.txt")
    return str(root / "val")


def _spec(job_dict: dict, val: str, **overrides) -> TrainJobSpec:
    base = {**job_dict, "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 1},
            "eval": {"uri": val, "every_n_steps": 2, "batches": 2}}
    return TrainJobSpec.model_validate({**base, **overrides})


# -- which samples, when ------------------------------------------------------------------------
def test_eval_samples_are_fixed_sorted_and_split_without_overlap():
    ids = eval_sample_ids(1000, 48)
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 48
    assert np.array_equal(ids, eval_sample_ids(1000, 48))  # no step, seed or world size in it
    assert not np.array_equal(ids, np.arange(48))  # spread over the split, not its first samples
    shares = [replica_eval_ids(ids, dp_rank=r, dp_size=3) for r in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == ids.tolist() and {len(s) for s in shares} == {16}
    with pytest.raises(ValueError):
        eval_sample_ids(10, 11)


def test_eval_steps_every_n_and_the_last():
    assert [s for s in range(1, 11) if is_eval_step(s, every_n_steps=4, last_step=10)] == [4, 8, 10]


# -- the spec's errors name field, value and fix ---------------------------------------------------
def test_eval_section_errors_name_the_field(job_dict, val_dataset):
    with pytest.raises(SpecError, match=r"eval\.every_n_steps"):
        _spec(job_dict, val_dataset, eval={"uri": val_dataset, "every_n_steps": 0})
    with pytest.raises(SpecError, match=r"eval\.batchs.*allowed here: batches, every_n_steps, uri"):
        _spec(job_dict, val_dataset, eval={"uri": val_dataset, "batchs": 3})
    with pytest.raises(SpecError, match=r"eval\.uri.*not a token dataset.*Fix: point it at a validation split"):
        check_dataset(_spec(job_dict, val_dataset, eval={"uri": val_dataset + "-missing"}))
    with pytest.raises(SpecError, match=r"eval\.batches=500.*Fix: set eval\.batches <= \d+"):
        check_dataset(_spec(job_dict, val_dataset, eval={"uri": val_dataset, "batches": 500}))


def test_eval_split_with_another_tokenizer_is_refused(job_dict, val_dataset, tmp_path):
    codec = CharCodec.for_text("abc ")
    write_token_dataset([np.array(codec.encode("abc " * 500), dtype=np.uint16)], str(tmp_path / "chars"),
                        tokenizer=codec, num_documents=1, sources=["x"], seq_len=64, shard_tokens=1024)
    with pytest.raises(SpecError, match=r"eval\.uri.*tokenizer 'char'.*'byte'"):
        check_dataset(_spec(job_dict, val_dataset, eval={"uri": str(tmp_path / "chars")}))


# -- the loop ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory, token_dataset, val_dataset):
    """One job run three times in one process: with eval (twice) and without; plus its final model."""
    out = tmp_path_factory.mktemp("eval-model")
    job = {"name": "unit", "model": {"preset": "tiny"}, "data": {"uri": token_dataset, "seq_len": 32},
           "steps": 5, "global_batch_size": 8, "precision": "fp32", "output": {"uri": str(out)}}
    spec = _spec(job, val_dataset)
    plan = ParallelPlan(dp=1, micro_batch_size=4)
    with_eval = run_local(spec, plan)
    again = run_local(spec, plan)
    without = run_local(TrainJobSpec.model_validate({**spec.to_dict(), "eval": None, "output": None}), plan)
    return spec, with_eval, again, without, str(out)


def test_val_loss_beside_loss_on_eval_steps(eval_runs):
    _, with_eval, _, _, _ = eval_runs
    rows = with_eval.metrics[0]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 5]
    assert all("loss" in r for r in rows)
    evaluated = [r for r in rows if "val_loss" in r]
    assert all(r["val_tokens"] == 2 * 8 * 32 and r["eval_time_s"] > 0 for r in evaluated)
    assert all(0 < r["val_loss"] < np.log(259) for r in evaluated)  # learned: below a uniform guess


def test_evaluation_is_deterministic_and_leaves_training_unchanged(eval_runs):
    _, with_eval, again, without, _ = eval_runs
    vals = [[r["val_loss"] for r in run.metrics[0] if "val_loss" in r] for run in (with_eval, again)]
    assert vals[0] == vals[1]
    assert with_eval.losses == without.losses  # eval mode, no_grad, nothing of training's state touched


def test_val_loss_equals_the_final_models_loss_on_the_validation_samples(eval_runs, val_dataset):
    spec, with_eval, _, _, out = eval_runs
    servable = load_servable(out)
    model = build_model(MoEConfig.from_dict(servable.config), device="cpu")
    model.load_state_dict(servable.state_dict)
    model.eval()
    samples = TokenSamples(val_dataset, 32)
    batch = samples.get(eval_sample_ids(samples.num_samples, 2 * 8))
    with torch.no_grad():
        logits = model(batch[:, :-1])
    expected = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))
    assert with_eval.metrics[0][-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_two_ranks_all_reduce_the_same_mean(eval_runs, tmp_path):
    spec, with_eval, _, _, _ = eval_runs
    two = run_local(TrainJobSpec.model_validate({**spec.to_dict(), "output": None}),
                    ParallelPlan(dp=2, micro_batch_size=2))
    for rank_rows in two.metrics:  # every rank holds the same, global figure
        vals = [r["val_loss"] for r in rank_rows if "val_loss" in r]
        ref = [r["val_loss"] for r in with_eval.metrics[0] if "val_loss" in r]
        assert vals == pytest.approx(ref, rel=1e-4)
    fig = plot_metrics(two.metrics[0], str(tmp_path / "loss.png"))
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["train", "validation"] and (tmp_path / "loss.png").stat().st_size > 0


def test_fp8_delayed_scaling_history_is_not_moved_by_evaluation(job_dict, val_dataset):
    # Every forward records amax into the delayed recipe's history; evaluation's forwards must not
    # (without the save/restore in Evaluator.evaluate the losses after the first eval differ).
    spec = _spec(job_dict, val_dataset, precision="delayed", steps=4, eval={"uri": val_dataset, "every_n_steps": 1})
    plan = ParallelPlan(dp=1, micro_batch_size=4)
    with_eval = run_local(spec, plan)
    without = run_local(TrainJobSpec.model_validate({**spec.to_dict(), "eval": None}), plan)
    assert len([r for r in with_eval.metrics[0] if "val_loss" in r]) == 4
    assert with_eval.losses == without.losses


def test_val_loss_survives_parquet_and_is_drawn_from_it(eval_runs, tmp_path):
    from rayfleet.jobs.train_metrics import MetricsWriter, read_metrics, write_run_plot

    _, with_eval, _, _, _ = eval_runs
    writer = MetricsWriter(str(tmp_path / "run" / "metrics"), flush_every=2)
    for row in with_eval.metrics[0]:
        writer.write(row)
    writer.close()
    table = read_metrics(str(tmp_path / "run" / "metrics"))
    vals = [v for v in table.column("val_loss").to_pylist() if v is not None]
    assert vals == [r["val_loss"] for r in with_eval.metrics[0] if "val_loss" in r]
    assert write_run_plot(str(tmp_path / "run")) == f"{tmp_path}/run/metrics.png"
    fig = plot_metrics(table)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["train", "validation"]
