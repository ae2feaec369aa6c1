"""``rayfleet queue`` argument parsing and spec validation (no Ray), and the queue table."""

import pytest

from rayfleet.cli import build_parser, main
from rayfleet.errors import SpecError
from rayfleet.cli.queue import parse_counts, queue_spec_from_args, render_queues


def args(*argv):
    return build_parser().parse_args(["queue", *argv])


def test_create_arguments_become_a_queue():
    q = queue_spec_from_args(args("create", "research", "--parent", "training", "--quota", "H100=64,P800=8",
                                  "--borrow-limit", "H100=16", "--priority", "2"))
    assert (q.name, q.parent, dict(q.quota), dict(q.borrow_limit), q.priority) == (
        "research", "training", {"H100": 64, "P800": 8}, {"H100": 16}, 2)
    assert queue_spec_from_args(args("create", "root", "--quota", "H100=8")).borrow_limit is None  # unlimited


@pytest.mark.parametrize("argv, match", [
    (("create", "a", "--quota", "H100"), r"--quota='H100'.*not TYPE=COUNT.*Fix: write e.g."),
    (("create", "a", "--quota", "H100=x"), r"not TYPE=COUNT"),
    (("create", "a", "--quota", "Z9=4"), r"queue.quota.*unknown accelerator type 'Z9'"),
    (("create", "a", "--borrow-limit", "H100=-1"), r"queue.borrow_limit.*negative"),
    (("create", "Team A"), r"queue.name='Team A'.*Fix: use lower-case"),
])
def test_bad_arguments_name_the_flag_and_the_fix(argv, match):
    with pytest.raises(SpecError, match=match):
        queue_spec_from_args(args(*argv))


def test_cli_rejects_a_bad_spec_before_connecting(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["queue", "create", "a", "--quota", "H100=oops"]) == 2
    assert "not TYPE=COUNT" in capsys.readouterr().err


def test_parse_counts_none_and_empty():
    assert parse_counts("--quota", None) is None
    assert parse_counts("--quota", "") == {}


def test_render_queues_as_a_tree():
    text = render_queues([
        {"name": "root", "parent": None, "quota": {"H100": 16}, "borrow_limit": None, "priority": 0},
        {"name": "team", "parent": "root", "quota": {"H100": 8}, "borrow_limit": {"H100": 4}, "priority": 1},
    ])
    lines = text.splitlines()
    assert lines[2].startswith("root") and "unlimited" in lines[2]
    assert lines[3].startswith("  team") and "H100=4" in lines[3]


def test_apply_refuses_a_bad_file_before_connecting(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path))  # no fleet here: a connection attempt would fail differently
    bad = tmp_path / "queues.yaml"
    bad.write_text("queues:\n  - {name: team-a, quota: {NOPE: 1}}\n")
    assert main(["queue", "apply", str(bad)]) == 2
    assert "unknown accelerator type 'NOPE'" in capsys.readouterr().err
    assert main(["queue", "apply", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert args("apply", "q.yaml", "--json").json is True
