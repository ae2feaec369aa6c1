"""``rayfleet plan``: registers on an argparse parser and prints plans and a layout table."""

from __future__ import annotations

import argparse
from itertools import takewhile
from pathlib import Path

import pytest

from rayfleet.cli.plan import register
from rayfleet.errors import SpecError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "models"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rayfleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_prints_ranked_table_and_layout(capsys) -> None:
    code = _run(["plan", str(EXAMPLES / "small-moe.yaml"), "--nodes", "4", "--accelerator", "H100",
                 "--accelerators-per-node", "8", "--racks", "2", "--top", "3", "--layout"])
    out = capsys.readouterr().out
    assert code == 0
    assert "bottleneck" in out and "step s" in out and "mem GiB" in out
    assert "job size:" in out and "layout of plan 1" in out and "n0003" in out and "r0:s0" in out


def test_plan_with_fleet_string_and_preset(capsys) -> None:
    assert _run(["plan", "mixtral-8x7b", "--fleet", "H100:64", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "mixtral-8x7b" in out and "infeasible" in out


def test_no_feasible_plan_returns_1(capsys) -> None:
    assert _run(["plan", "deepseek-v3", "--fleet", "H100:8"]) == 1
    assert "no feasible plan" in capsys.readouterr().out


def test_bad_fleet_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="multiple of 8"):
        _run(["plan", "mixtral-8x7b", "--fleet", "H100:12"])


def _column(out: str, name: str) -> list[str]:
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#  accel"))
    # by character offset: the table is fixed-width, and headers such as "mem GiB" hold a space
    start = f" {lines[header]} ".index(f" {name} ")
    rows = takewhile(lambda line: line[:1].isdigit() and len(line) > start, lines[header + 2:])
    return [line[start:].split()[0] for line in rows]


def test_bf16_moments_and_fp8_activations_are_opt_in(capsys) -> None:
    """DeepSeek-V3 on 256 H100 is memory-bound: BF16 moments reach the top 3 once allowed (since
    the MTP module is priced, 0.1% behind an FP32-moment plan at the top), never before; the table
    shows the moment and activation dtypes of every plan."""
    assert _run(["plan", "deepseek-v3", "--fleet", "H100:256", "--exact", "256", "--top", "3"]) == 0
    plain = capsys.readouterr().out
    assert set(_column(plain, "adam")) == {"fp32"} and set(_column(plain, "acts")) == {"bf16"}
    assert _run(["plan", "deepseek-v3", "--fleet", "H100:256", "--exact", "256", "--top", "3",
                 "--fp8-activations", "--bf16-moments"]) == 0
    opened = capsys.readouterr().out
    assert "bf16" in _column(opened, "adam"), opened


def test_dualpipe_is_opt_in_and_shown(capsys) -> None:
    """Megatron-Core has no DualPipe schedule: the planner offers it only with --dualpipe."""
    argv = ["plan", "deepseek-v3", "--fleet", "H100:256", "--exact", "256", "--top", "3"]
    assert _run(argv) == 0
    assert "DualPipe" not in capsys.readouterr().out
    assert _run(argv + ["--dualpipe"]) == 0
    assert "PP8+DualPipe" in capsys.readouterr().out


def test_exact_size_without_any_shape_explains_every_dead_end(capsys) -> None:
    """Regression: --exact 10000 printed '0 shapes considered' and no reason. 10,000 = 2^4 * 5^4
    and DeepSeek-V3's batch of 8192 sequences allows only power-of-two DP, so PP would need the
    factor 625 > 61 layers: every shape is ruled out by the batch or the layer count, and the
    nearest sizes that have a shape are offered."""
    assert _run(["plan", "deepseek-v3", "--fleet", "H100:10000", "--exact", "10000"]) == 1
    out = capsys.readouterr().out
    assert "0 shapes considered" not in out
    assert "x batch" in out and "x layers" in out and "9,984 or 10,240" in out


@pytest.mark.parametrize("size", [10_000, 100_000])
def test_search_api_returns_the_reasons_at_large_exact_sizes(size: int) -> None:
    from rayfleet.placement.fleet_capacity import fleet_capacity_of
    from rayfleet.placement.model_spec import preset
    from rayfleet.placement.planner import search_plans
    from rayfleet.placement.search_space import JobGoal

    result = search_plans(preset("deepseek-v3"), fleet_capacity_of(f"H100:{size}"), goal=JobGoal.exactly(size))
    assert not result.ranked and result.rejected and result.num_shapes == len(result.rejected)
    assert all(r.reason.split(":")[0] in ("batch", "layers", "size", "experts") and "Fix:" in r.reason
               for r in result.rejected)


def test_given_plan_is_priced_with_the_search_table(capsys) -> None:
    argv = ["plan", "deepseek-v3", "--fleet", "H100:2048", "--plan",
            "tp=1,pp=16,ep=64,recompute=selective,adam=bf16,acts=fp8"]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "given plan TP1 PP16 DP128" in out and _column(out, "PPxVP") == ["PP16"] and _column(out, "EP") == ["EP64"]
    # the same plan without recompute does not fit: the reason and the price are both shown
    assert _run(argv[:-1] + ["tp=1,pp=16,ep=64,adam=bf16,acts=fp8"]) == 1
    out = capsys.readouterr().out
    assert "memory: needs" in out and "priced anyway" in out


@pytest.mark.parametrize("text, message", [("tp=1,pq=16", "pq=16"), ("tp=two", "takes a number"),
                                           ("tp=3", "does not divide the fleet"), ("ep=7", "plan.ep")])
def test_given_plan_errors_name_the_field_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as err:
        _run(["plan", "deepseek-v3", "--fleet", "H100:2048", "--plan", text])
    assert "Fix:" in str(err.value)


def test_runs_column_marks_what_rayfleet_train_cannot_run(capsys) -> None:
    """Issue 28: the table says which plans `rayfleet train` runs, and --runnable ranks only those.
    llama3-8b's CP plans and Mixtral-8x7B's expert-TP plans on 1,024 H100s (refused until issue 28
    items 2 and 3) run; DeepSeek-V3 with FP8 activation caching and BF16 Adam moments offered
    ranks plans the trainer refuses (neither is implemented), and --runnable leaves them out."""
    assert _run(["plan", str(EXAMPLES / "llama3-8b.yaml"), "--fleet", "H100:1024"]) == 0
    out = capsys.readouterr().out
    assert set(_column(out, "runs")) == {"yes"} and set(_column(out, "CP")) != {"CP1"}
    assert _run(["plan", str(EXAMPLES / "mixtral-8x7b.yaml"), "--fleet", "H100:1024", "--min-scaling-efficiency",
                 "0.1"]) == 0
    out = capsys.readouterr().out
    assert set(_column(out, "runs")) == {"yes"} and set(_column(out, "ETP")) != {"ETP1"}
    argv = ["plan", "deepseek-v3", "--fleet", "H100:1024", "--min-scaling-efficiency", "0.1", "--fp8-activations",
            "--bf16-moments"]
    assert _run(argv) == 0
    runs = _column(capsys.readouterr().out, "runs")
    assert any(r.startswith("no:") and "acts:fp8" in r for r in runs), runs
    assert _run(argv + ["--runnable"]) == 0
    out = capsys.readouterr().out
    assert set(_column(out, "runs")) == {"yes"} and set(_column(out, "acts")) == {"bf16"}
    assert set(_column(out, "adam")) == {"fp32"}


def test_given_plan_shows_whether_the_trainer_runs_it(capsys) -> None:
    assert _run(["plan", "deepseek-v3", "--fleet", "H100:2048", "--plan",
                 "tp=1,pp=16,ep=64,recompute=selective,adam=bf16,acts=fp8"]) == 0
    assert _column(capsys.readouterr().out, "runs") == ["no:acts:fp8,adam:bf16"]
