"""The command line answers `--help` and argument errors without importing torch or Ray.

Each check runs in a fresh interpreter (this test process has imported torch long ago) and
reads ``sys.modules`` at the end. The timings printed by the README (``rayfleet --help``
≈ 0.1 s, was 3.1 s) come from the same commands; here only the imports are asserted, since a
shared 2-core machine makes wall-clock bounds flaky.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rayfleet.cli import AREA_COMMANDS, build_parser

HEAVY = ("torch", "ray", "numpy", "pyarrow")

_PROBE = """
import json, runpy, sys
sys.argv = ["rayfleet", *json.loads(sys.argv[1])]
try:
    runpy.run_module("rayfleet", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def _run_cli(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("argv, code", [(("--help",), 0), ((), 2), (("no-such-command",), 2),
                                        (("up", "--nodes", "two"), 2), (("status", "--bogus"), 2)])
def test_top_level_help_and_argument_errors_import_nothing_heavy(argv, code):
    result = _run_cli(*argv)
    assert result == {"code": code, "heavy": []}


@pytest.mark.parametrize("command", sorted(AREA_COMMANDS))
def test_each_area_command_help_imports_neither_torch_nor_ray(command):
    result = _run_cli(command, "--help")
    assert result["code"] == 0
    assert not {"torch", "ray"} & set(result["heavy"]), (
        f"`rayfleet {command} --help` imports {result['heavy']}: move those imports of "
        f"{AREA_COMMANDS[command][0]} (or its package __init__) into the handlers")


def test_the_help_lines_listed_without_importing_match_the_areas_own():
    full = build_parser()  # imports every area's module
    subparsers = next(a for a in full._actions if a.dest == "command")
    helps = {action.dest: action.help for action in subparsers._choices_actions}
    for command, (_module, help_) in AREA_COMMANDS.items():
        assert helps[command] == help_, f"AREA_COMMANDS[{command!r}] differs from what its module registers"


def test_a_lazily_listed_command_still_parses_in_full():
    from rayfleet.cli.entry import _command_in

    assert _command_in(["--help"]) is None
    argv = ["plan", "mixtral-8x7b", "--fleet", "H100:64", "--top", "3"]
    args = build_parser(_command_in(argv)).parse_args(argv)
    assert (args.model, args.fleet, args.top) == ("mixtral-8x7b", "H100:64", 3) and callable(args.func)
