"""``rayfleet plan``: registers on an argparse parser and prints plans and a layout table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.cli import register

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
