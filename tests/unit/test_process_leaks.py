"""The suite-end leak check (tests/process_leaks.py) finds a marked process and its listening
port, ignores processes without the marker and zombies, and clears once the process is gone; the
helpers the `ray up` test cleans up with stop a whole process tree and put files back."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from process_leaks import (MARKER_VAR, describe, files_restored, leftovers, snapshot, stop_process_tree,
                           wait_for_no_leftovers)

LISTENER = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.fixture
def marker(monkeypatch) -> str:
    value = f"unit-{os.getpid()}"
    monkeypatch.setenv(MARKER_VAR, value)
    return value


def test_a_marked_listener_is_found_with_its_port_until_it_is_gone(marker):
    before = snapshot()
    marked = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    other_env = {k: v for k, v in os.environ.items() if k != MARKER_VAR}
    unmarked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=other_env)
    try:
        port = int(marked.stdout.readline())
        found = leftovers(before, marker)
        assert [p.pid for p in found] == [marked.pid]  # not the unmarked one, not this process
        assert found[0].listening == (f"127.0.0.1:{port}",)
        assert f"listening on 127.0.0.1:{port}" in describe(found)
        assert leftovers(snapshot(), marker) == []  # the snapshot's processes are never leftovers
    finally:
        for proc in (marked, unmarked):
            proc.kill()
    marked.wait()
    unmarked.wait()
    assert wait_for_no_leftovers(before, marker, grace_s=5, poll_s=0.1) == []


def test_zombies_are_not_leftovers(marker):
    before = snapshot()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert leftovers(before, marker) == []
    finally:
        child.wait()


def test_stop_process_tree_takes_the_children_too_and_reaps():
    # A parent that ignores SIGTERM (as a busy daemon may) and a child of its own.
    parent = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & wait"])
    try:
        for _ in range(50):
            children = psutil.Process(parent.pid).children(recursive=True)
            if children:
                break
            time.sleep(0.1)
        assert children, "the child did not start"
    finally:
        stop_process_tree(parent, timeout_s=2)
    assert parent.returncode is not None  # reaped: no zombie left for init
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def test_files_restored_puts_back_bytes_mode_and_times_and_removes_new_files(tmp_path):
    kept, created = tmp_path / "kept", tmp_path / "created"
    kept.write_text("original")
    kept.chmod(0o600)
    os.utime(kept, ns=(1_000_000_000, 2_000_000_000))
    with files_restored([kept, created]):
        kept.write_text("overwritten by ray up")
        kept.chmod(0o644)
        created.write_text("new")
    assert kept.read_text() == "original" and kept.stat().st_mode & 0o777 == 0o600
    assert kept.stat().st_mtime_ns == 2_000_000_000 and not created.exists()
