"""``rayfleet job ...`` and ``rayfleet --version``: argument parsing and the errors that need no
cluster (an unreachable job API address fails fast with the fix)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rayfleet import __version__
from rayfleet.cli import build_parser, main


def test_version_prints_the_package_version():
    out = subprocess.run([sys.executable, "-m", "rayfleet", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"rayfleet {__version__}"


@pytest.mark.parametrize("argv, expected", [
    (["job", "list"], {"job_command": "list", "json": False, "kind": None, "address": None}),
    (["job", "list", "--json", "--kind", "train"], {"json": True, "kind": "train"}),
    (["job", "status", "J1", "--json"], {"job_command": "status", "job": "J1", "json": True}),
    (["job", "logs", "J1", "-f", "--json"], {"job_command": "logs", "follow": True, "json": True}),
    (["job", "stop", "J1", "--wait", "5"], {"job_command": "stop", "wait": 5.0}),
    (["job", "resume", "J1", "--follow", "--address", "http://10.0.0.1:8265"],
     {"job_command": "resume", "follow": True, "address": "http://10.0.0.1:8265"}),
    (["topology", "--json"], {"json": True}),
    (["node", "list", "--json"], {"json": True}),
    (["queue", "show", "research", "--json"], {"json": True}),
])
def test_job_and_read_commands_parse(argv, expected):
    args = build_parser(argv[0]).parse_args(argv)
    for key, value in expected.items():
        assert getattr(args, key) == value, key


@pytest.mark.parametrize("argv", [["job", "status"], ["job", "stop", "J1", "--wait", "soon"], ["job", "bogus"],
                                  ["job", "stop", "J1", "--json"], ["job", "list", "--kind", "serve"]])
def test_bad_job_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser(argv[0]).parse_args(argv)
    assert exc.value.code == 2


def test_unreachable_job_api_fails_with_the_address(capsys):
    # A closed port on loopback: the job API client's connection error becomes one line naming it.
    code = main(["job", "list", "--address", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and "127.0.0.1:9" in err and "Fix:" in err


def test_plan_json_lists_the_ranked_plans_best_first(capsys):
    assert main(["plan", "mixtral-8x7b", "--fleet", "H100:64", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranked"]] == [1, 2, 3] and out["fleet"] == "64 x H100"
    assert all(r["fields"]["tp"] * r["fields"]["pp"] * r["fields"]["dp"] * r["fields"]["cp"] <= 64 for r in out["ranked"])
    assert out["ranked"][0]["step_time_s"] > 0 and set(out) == {"fleet", "num_shapes", "ranked", "rejected", "job_size"}


def test_plan_json_of_a_plan_that_does_not_fit_names_why(capsys):
    assert main(["plan", "mixtral-8x7b", "--fleet", "H100:8", "--plan", "tp=1,ep=1,zero=0", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)  # only JSON: the notes of the table form are left out
    assert out["ranked"] == [] and "memory" in out["rejected"][0]["reason"]


def test_node_list_json_is_a_list(capsys):
    assert main(["node", "list", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)
