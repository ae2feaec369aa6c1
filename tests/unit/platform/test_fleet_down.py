"""``LocalFleet.down`` on real process groups (no Ray): the workers first, then the head, whose
processes may ignore SIGTERM (a local fleet's GCS was seen to for 11 minutes): it is killed after
``head_grace_s``, not after the workers' grace."""

from __future__ import annotations

import subprocess
import sys
import time

from rayfleet.platform.launcher import LaunchedNode, LocalFleet, _group_alive

DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
POLITE = "import time; print('up', flush=True); time.sleep(120)"


def _group(code: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "up"  # its SIGTERM handler is in place
    return proc.pid


def test_down_stops_the_workers_then_kills_a_deaf_head_after_its_short_grace(tmp_path):
    head, worker = _group(DEAF), _group(POLITE)
    fleet = LocalFleet(address="127.0.0.1:1", dashboard_url="", home=str(tmp_path), temp_dir=str(tmp_path / "ray"),
                       topology_nodes=[], nodes=[LaunchedNode(name="n0000", pgid=head, log_path=""),
                                                 LaunchedNode(name="n0001", pgid=worker, log_path="")])
    started = time.monotonic()
    fleet.down(grace_s=30.0, head_grace_s=1.0)
    took = time.monotonic() - started
    assert not _group_alive(head) and not _group_alive(worker)
    # the worker left on SIGTERM at once (not after its 30 s grace); the deaf head was killed after 1 s
    assert 0.9 <= took < 10.0, took
