"""Which processes and listening ports a test session started and left running.

A session sets ``RAYFLEET_PROCESS_MARKER`` to a value of its own in its environment
(:func:`mark_session`). Every process it starts inherits it — subprocesses, Ray's daemons started
by ``ray start`` or ``ray.init``, the workers and job drivers they spawn, and sessions of the
loopback sshd, which passes it on with ``SetEnv`` (scripts/loopback_ssh.sh). At the end,
:func:`leftovers` lists live processes that carry the marker and did not exist in the snapshot
taken at the start, with the ports they listen on.

Why a marker rather than the process tree: ``ray start`` and sshd daemonize, so their processes
are re-parented away from the session at once; and a process-name or time filter would also
catch what other people run on a shared machine at the same time. Zombies are not counted: they
run nothing and hold no port (on a machine whose init does not reap, an orphan's zombie stays
until reboot whatever the test does).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

__all__ = ["MARKER_VAR", "ProcessSnapshot", "Leftover", "mark_session", "snapshot", "leftovers",
           "wait_for_no_leftovers", "describe", "stop_process_tree", "files_restored"]

MARKER_VAR = "RAYFLEET_PROCESS_MARKER"


@dataclass(frozen=True)
class ProcessSnapshot:
    """Processes alive at a moment, as (pid, create time) pairs (a pid alone may be reused)."""

    processes: frozenset[tuple[int, float]]


@dataclass(frozen=True)
class Leftover:
    pid: int
    name: str
    cmdline: str
    listening: tuple[str, ...]  # "host:port" of its listening TCP/UDP sockets


def mark_session() -> str:
    """Put a new marker in this process's environment (inherited by all it starts); returns it."""
    marker = f"rayfleet-session-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.environ[MARKER_VAR] = marker
    return marker


def snapshot() -> ProcessSnapshot:
    out = set()
    for proc in psutil.process_iter(["create_time"]):
        out.add((proc.pid, proc.info["create_time"]))
    return ProcessSnapshot(frozenset(out))


def _listening_by_pid() -> dict[int, list[str]]:
    by_pid: dict[int, list[str]] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid is None or not conn.laddr:
            continue
        if conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr):  # 2: SOCK_DGRAM
            by_pid.setdefault(conn.pid, []).append(f"{conn.laddr.ip}:{conn.laddr.port}")
    return by_pid


def leftovers(before: ProcessSnapshot, marker: str) -> list[Leftover]:
    """Live, non-zombie processes carrying ``marker`` that ``before`` did not hold (this process excluded)."""
    found: list[Leftover] = []
    ports = _listening_by_pid()
    for proc in psutil.process_iter(["create_time", "name", "cmdline", "status"]):
        if proc.pid == os.getpid() or (proc.pid, proc.info["create_time"]) in before.processes:
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(MARKER_VAR) != marker:
                continue
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        found.append(Leftover(pid=proc.pid, name=proc.info["name"] or "",
                              cmdline=" ".join(proc.info["cmdline"] or [])[:200],
                              listening=tuple(sorted(ports.get(proc.pid, [])))))
    return found


def wait_for_no_leftovers(before: ProcessSnapshot, marker: str, *, grace_s: float = 60.0,
                          poll_s: float = 1.0) -> list[Leftover]:
    """:func:`leftovers`, polled for up to ``grace_s`` while some remain (Ray workers notice their
    raylet's end within seconds, SSH control masters persist a few seconds); returns the last list."""
    deadline = time.monotonic() + grace_s
    while True:
        found = leftovers(before, marker)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)


def describe(found: list[Leftover]) -> str:
    return "\n".join(f"  pid {p.pid} {p.name}: {p.cmdline}" + (f" (listening on {', '.join(p.listening)})"
                                                                 if p.listening else "") for p in found)


# -- helpers for tests that start daemons or write outside their temp dirs ----------------------------
def stop_process_tree(proc: subprocess.Popen, *, timeout_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and its descendants (sshd's per-connection processes), SIGKILL what is
    left after ``timeout_s``, and reap ``proc``."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in (*tree, proc):
        try:
            p.terminate()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)  # gone (or a zombie of an orphan: nothing runs)


@contextmanager
def files_restored(paths: list[Path]) -> Iterator[None]:
    """Put each of ``paths`` back as it was on leaving: the same bytes, mode and times, or absent."""
    saved = {p: (p.read_bytes(), p.stat()) if p.is_file() else None for p in paths}
    try:
        yield
    finally:
        for path, was in saved.items():
            if was is None:
                path.unlink(missing_ok=True)
            else:
                data, st = was
                path.write_bytes(data)
                path.chmod(st.st_mode & 0o7777)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
