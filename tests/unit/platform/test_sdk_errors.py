"""Connecting where no cluster runs fails fast with the value and the fix (and starts no Ray)."""

import time

import pytest

import rayfleet
from rayfleet.errors import FleetNotFoundError


def test_connect_without_any_fleet(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(FleetNotFoundError, match="rayfleet up"):
        rayfleet.connect()


def test_connect_to_a_dead_address_fails_fast():
    start = time.monotonic()
    with pytest.raises(FleetNotFoundError, match="'127.0.0.1:1'.*Fix"):
        rayfleet.connect("127.0.0.1:1")
    assert time.monotonic() - start < 10


def test_connect_to_a_malformed_address():
    with pytest.raises(FleetNotFoundError, match="host:port"):
        rayfleet.connect("not-an-address")


def test_cli_reports_user_errors_in_one_line(capsys):
    from rayfleet.cli import main

    assert main(["up", "--nodes", "-2"]) == 2
    err = capsys.readouterr().err
    assert "nodes=-2" in err and "Fix" in err
    assert main(["up", "--accelerator", "Z9000", "--nodes", "1"]) == 2
    assert "'Z9000'" in capsys.readouterr().err
