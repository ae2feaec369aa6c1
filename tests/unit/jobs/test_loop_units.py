"""Pieces of the loop without processes: loss averaging, schedule, optimizer groups, metrics I/O."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from rayfleet.jobs.loop import loss_scale, sample_ids_hash
from rayfleet.jobs.train_metrics import (METRIC_KEYS, MetricsWriter, expert_load_stats, mfu, model_flops_per_token,
                                   read_metrics)
from rayfleet.jobs.optim import build_optimizer, lr_at
from rayfleet.models import preset


def _grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], averaging: str) -> torch.Tensor:
    """Gradient after each 'replica' backpropagates its scaled summed loss and DP averages the grads."""
    global_tokens = sum(y.numel() for _, y in batches)
    per_replica = []
    for x, y in batches:
        model.zero_grad()
        loss_sum = nn.functional.cross_entropy(model(x), y, reduction="sum")
        scale = loss_scale(averaging, local_tokens=y.numel(), global_tokens=global_tokens, grad_divide=len(batches))
        (loss_sum * scale).backward()
        per_replica.append(model.weight.grad.clone())
    return torch.stack(per_replica).mean(0)  # what a DP gradient all-reduce (mean) produces


@pytest.mark.parametrize("averaging,matches", [("global_tokens", True), ("replica_mean_control", False)])
def test_loss_averaging_weights_replicas_by_tokens(averaging, matches) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 5, bias=False)
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # the reference: mean over all tokens
    reference = model.weight.grad.clone()
    uneven = [(x[:6], y[:6]), (x[6:], y[6:])]  # a fast replica with 6 tokens, a slow one with 2
    got = _grads(model, uneven, averaging)
    assert torch.allclose(got, reference, atol=1e-6) is matches
    even = [(x[:4], y[:4]), (x[4:], y[4:])]  # with equal shares both rules agree
    assert torch.allclose(_grads(model, even, averaging), reference, atol=1e-6)


def test_schedule_worked_example() -> None:
    lrs = [lr_at(s, lr=1.0, total_steps=10, warmup_steps=2, min_lr_ratio=0.1) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0) and lrs[2] == pytest.approx(1.0)
    assert lrs[9] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # monotone decay after warmup
    assert lrs[5] == pytest.approx(0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * 3 / 7)).item()))
    assert lr_at(7, lr=2.0, total_steps=10, warmup_steps=2, kind="constant") == 2.0
    assert lr_at(0, lr=1.0, total_steps=1) == 1.0


def test_optimizer_decays_matrices_only() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, lr=0.1, weight_decay=0.5)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert decayed == {id(model[0].weight)} and opt.param_groups[0]["weight_decay"] == 0.5
    assert opt.param_groups[1]["weight_decay"] == 0.0 and len(opt.param_groups[1]["params"]) == 3


def test_mfu_and_expert_load() -> None:
    config = preset("tiny")
    per_token = model_flops_per_token(config)
    assert per_token == 6 * config.num_params().active
    # 989e12 tokens/s of a 2-FLOP model fill 2 H100 at the BF16 peak (989 TFLOP/s each)
    assert mfu(989e12, flops_per_token=2.0, accelerators=["H100"] * 2, precision="bf16") == pytest.approx(1.0)
    assert mfu(1979e12, flops_per_token=1.0, accelerators=["H100"], precision="tensorwise") == pytest.approx(1.0)
    # a mixed fleet sums its peaks: one H100 (989) + one P800 (345 TFLOP/s BF16)
    assert mfu(1334e12, flops_per_token=1.0, accelerators=["H100", "P800"], precision="bf16") == pytest.approx(1.0)
    high, mean = expert_load_stats(torch.tensor([[4, 0, 2, 2], [2, 2, 2, 2]]))
    assert high == [4.0, 2.0] and mean == [2.0, 2.0]


def test_sample_ids_hash_is_order_sensitive() -> None:
    assert sample_ids_hash([1, 2, 3]) == sample_ids_hash((1, 2, 3)) != sample_ids_hash([3, 2, 1])


def test_metrics_parquet_round_trip(tmp_path) -> None:
    uri = str(tmp_path / "metrics")
    rows = [{k: None for k in METRIC_KEYS} | {"step": s, "rank": r, "loss": 1.0 / s, "step_time_s_per_rank": [0.1, 0.2],
             "expert_load_max": [3.0], "expert_load_mean": [2.0], "custom": 7}
            for s in (1, 2, 3) for r in (0, 1)]
    writers = [MetricsWriter(uri, rank=r, flush_every=2) for r in (0, 1)]
    for row in rows:
        writers[row["rank"]].write(row)
    for w in writers:
        w.close()
    table = read_metrics(uri)
    assert table.num_rows == 6
    assert table.column("step").to_pylist() == [1, 1, 2, 2, 3, 3]
    assert table.column("step_time_s_per_rank").to_pylist()[0] == [0.1, 0.2]
    assert table.column("custom").to_pylist() == [7] * 6
    again = MetricsWriter(uri, rank=0)  # a restarted rank continues the numbering, never overwrites
    again.write(rows[0])
    again.close()
    assert read_metrics(uri).num_rows == 7


def test_jobs_modules_import_without_ray() -> None:
    code = ("import sys, rayfleet.jobs.spec, rayfleet.jobs.data, rayfleet.jobs.train_metrics, rayfleet.jobs.planning, "
            "rayfleet.jobs.optim, rayfleet.jobs.train_state, rayfleet.jobs.loop, rayfleet.jobs.local_processes; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
