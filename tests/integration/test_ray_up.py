"""`ray up cluster.yaml` → labelled three-node fleet → `ray job submit` → `ray down cluster.yaml`.

The repository's cluster.yaml is brought up for real: Ray's on-premises provider SSHes to
127.0.0.1 (head), 127.0.0.2 and 127.0.0.3 (workers) on this machine. Runs alone (`make test`
gives it a session of its own, after the other integration tests): it owns the head's fixed ports
6379/8265, and its workers' servers, not on 127.0.0.1, listen on every interface.

Nothing left behind: the sshd is the test's own — `scripts/loopback_ssh.sh --private` writes its
config, host key, client key and authorized_keys under a temp dir (nothing in /etc/ssh or
~/.ssh), and the `loopback_ssh` fixture runs it in the foreground as its child, stopping it and
its sessions on every way out of the module (and, through PR_SET_PDEATHSIG, when pytest itself is
killed). The files `ray up` writes into the head's home (here: this machine's) are put back as
they were. tests/integration/conftest.py then checks that no process of the session remains.

Safety: `ray down` sends a hard-coded `ray stop` to the head, which would kill every Ray process
on the machine. The SSH key is bound to scripts/rayfleet_ssh_gate.sh, which turns it into
`rayfleet node stop`; the test proves that binding before it brings anything up.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from process_leaks import files_restored, stop_process_tree
from rayfleet.platform import labels as L
from rayfleet.platform.cluster_config import load_onprem_spec

# The subprocess timeouts bound each step; this is the backstop (apt-get may be slow in CI).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "cluster.yaml"
BIN_DIR = Path(sys.executable).parent
SPEC = load_onprem_spec(CLUSTER_YAML)
ADDRESSES = [SPEC.head.address, *(n.address for n in SPEC.nodes if n.topology.role != "head")]
# What `ray up` writes on the head outside its temp dir: the file mounts, the bootstrap config and
# key in root's home, and the local provider's cluster state.
HEAD_FILES = [Path(p).expanduser() for p in ("~/ray_bootstrap_config.yaml", "~/ray_bootstrap_key.pem",
                                             "~/rayfleet_cluster.yaml")] + [
    Path(f"/tmp/cluster-{SPEC.cluster_name}.{ext}") for ext in ("state", "lock")]


def _env() -> dict[str, str]:
    return dict(os.environ, RAY_UP_enable_autoscaler_v2="0", RAY_AUTH_MODE="token",
                PATH=os.pathsep.join([str(BIN_DIR), os.environ.get("PATH", "")]))


def _run(args: list[str], *, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _processes() -> dict[int, tuple[int, str]]:
    """Live processes: pid -> (session id, command line)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[3]), cmdline)
    return out


def _cluster_processes() -> dict[int, str]:
    """Processes of this cluster: those naming its private temp dir, and their whole sessions."""
    marker = SPEC.temp_dir or f"/tmp/rayfleet-{SPEC.cluster_name}"
    procs = _processes()
    sessions = {sid for pid, (sid, cmd) in procs.items() if marker in cmd and pid != os.getpid()}
    return {pid: cmd[:160] for pid, (sid, cmd) in procs.items() if sid in sessions}


def _ssh_probe(key: Path, address: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR",
         "-o", "ConnectTimeout=5", f"root@{address}", command],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when pytest dies (Linux PR_SET_PDEATHSIG), so even a
    killed test run takes its sshd with it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 == PR_SET_PDEATHSIG


@pytest.fixture(scope="module")
def loopback_ssh(tmp_path_factory) -> Iterator[Path]:
    """A private sshd on the three loopback addresses for this module; yields the cluster YAML to
    use (the repository's, with the private key)."""
    ssh_dir = tmp_path_factory.mktemp("loopback-ssh")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "loopback_ssh.sh"), "--private", str(ssh_dir), str(BIN_DIR)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 3:
        pytest.skip(f"openssh-server/rsync cannot be installed here: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"scripts/loopback_ssh.sh --private failed:\n{proc.stdout}\n{proc.stderr}"
    busy = [a for a in ADDRESSES if _port_open(a, 22)]
    assert not busy, (f"port 22 is taken on {busy}: another sshd runs there (`ss -ltnp 'sport = :22'`); "
                      "a leftover of an older run of this test listens on 127.0.0.1-3 (stop it by its pid)")
    key = ssh_dir / "cluster_ed25519"
    log = (ssh_dir / "sshd.log").open("w")
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(ssh_dir / "sshd_config")],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 30
        while not all(_ssh_probe(key, a, "true").returncode == 0 for a in ADDRESSES):
            assert sshd.poll() is None, f"sshd exited {sshd.returncode}:\n{(ssh_dir / 'sshd.log').read_text()}"
            assert time.monotonic() < deadline, f"no key login within 30 s:\n{(ssh_dir / 'sshd.log').read_text()}"
            time.sleep(0.3)
        # Never let `ray down` reach the real `ray stop`: the key must go through the gate.
        probe = _ssh_probe(key, SPEC.head.address, "bash --login -c -i 'source ~/.bashrc; type ray'")
        assert "ray is a function" in probe.stdout, (
            f"over the cluster key, `ray` is not rayfleet's gate function, so `ray down` would kill every "
            f"Ray process on this machine:\n{probe.stdout}\n{probe.stderr}")
        config = yaml.safe_load(CLUSTER_YAML.read_text())
        config["auth"]["ssh_private_key"] = str(key)
        config["file_mounts"] = {dst: str((REPO / src).resolve()) if src.startswith("./") else src
                                 for dst, src in config["file_mounts"].items()}
        cluster_yaml = ssh_dir / "cluster.yaml"
        cluster_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
        with files_restored(HEAD_FILES):
            yield cluster_yaml
    finally:
        stop_process_tree(sshd)
        log.close()
        if (ssh_dir / "created_run_sshd").exists():
            try:
                Path("/run/sshd").rmdir()
            except OSError:
                pass  # another sshd put something there since: it is in use
    assert not any(_port_open(a, 22) for a in ADDRESSES), "the test's sshd still listens on port 22"


NODES_PROBE = """
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + float(sys.argv[2])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= int(sys.argv[3]) or time.monotonic() > deadline:
        break
    time.sleep(1)
print("NODES=" + json.dumps([{"labels": n["Labels"], "resources": n["Resources"], "ip": n["NodeManagerAddress"]}
                  for n in alive]))
"""


def test_ray_up_labels_job_submit_and_ray_down(loopback_ssh: Path) -> None:
    from rayfleet.platform.launcher import ensure_auth_token

    ensure_auth_token()  # cluster.yaml ships ~/.ray/auth_token to every node
    for port in (SPEC.head_port, SPEC.dashboard_port):
        assert not _port_open(SPEC.head.address, port), (
            f"port {port} is already in use on {SPEC.head.address}: another cluster runs here. "
            "Run the integration tests alone (`pytest tests/integration`)")
    assert not _cluster_processes(), "a previous `ray up cluster.yaml` is still running"

    timings: dict[str, float] = {}
    start = time.monotonic()
    try:
        _run(["ray", "up", "-y", str(loopback_ssh)], timeout=180)
        timings["ray up"] = time.monotonic() - start

        # Workers are started by the head's autoscaler after `ray up` returns.
        t = time.monotonic()
        # A ceiling, not a timing bet: the head's autoscaler starts the workers over SSH (its 5 s
        # update loop, then `ray start` on each): 14 s alone on 2 cores. (Beside another
        # integration test one fresh-clone run saw only the head after 120 s: it runs alone.)
        probe = _run([sys.executable, "-c", NODES_PROBE, SPEC.head_address, "300", str(len(SPEC.nodes))],
                     timeout=340)
        timings["workers joined"] = time.monotonic() - t
        lines = [line for line in probe.stdout.splitlines() if line.startswith("NODES=")]
        assert lines, probe.stdout[-3000:] + probe.stderr[-3000:]
        nodes = json.loads(lines[-1][len("NODES="):])
        by_name = {n["labels"].get(L.NODE): n for n in nodes}
        assert sorted(by_name) == sorted(n.topology.name for n in SPEC.nodes), nodes
        for expected in SPEC.nodes:
            seen = by_name[expected.topology.name]
            for key, value in expected.topology.to_labels().items():
                assert seen["labels"].get(key) == value, (expected.topology.name, key, seen["labels"])
            if expected.topology.role != "head":  # Ray replaces a head's 127.0.0.1 by the host's IP
                assert seen["ip"] == expected.address
            count = expected.topology.num_accelerators
            assert seen["resources"].get("GPU") == count
            for i in range(count):
                assert seen["resources"].get(L.slot_resource(i)) == 1
            assert L.slot_resource(count) not in seen["resources"]

        t = time.monotonic()
        job = _run(["ray", "job", "submit", "--address", SPEC.dashboard_url, "--",
                    "python", "-m", "rayfleet", "status"], timeout=120)
        timings["job submit"] = time.monotonic() - t
        assert "succeeded" in job.stdout + job.stderr
        for expected in SPEC.nodes:
            assert expected.topology.name in job.stdout, job.stdout
        assert len(_cluster_processes()) > 3
    finally:
        t = time.monotonic()
        down = _run(["ray", "down", "-y", str(loopback_ssh)], timeout=120, check=False)
        timings["ray down"] = time.monotonic() - t
        leftovers = _cluster_processes()
        if leftovers:  # clean up for the next run, then fail below
            _run([str(BIN_DIR / "rayfleet"), "node", "stop", "--cluster", SPEC.cluster_name, "--force"],
                 timeout=60, check=False)
        print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert "rayfleet node stop: stopped" in down.stdout + down.stderr, down.stdout[-3000:]
    assert not leftovers, leftovers
    assert not _port_open(SPEC.head.address, SPEC.head_port)
