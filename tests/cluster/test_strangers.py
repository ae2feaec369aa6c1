"""A fleet closed to strangers, on the shared local fleet (issue 33, item 3; docs/security.md).

Checks:
- every port a fleet process listens on (GCS, raylets, object managers, core workers, agents,
  dashboard, Serve's proxy) is bound to loopback, and from the machine's own network address each
  one refuses the connection while the same port answers on 127.0.0.1; the one listener Ray 2.60
  cannot bind (a Serve replica's inter-deployment gRPC server, on all interfaces) refuses a call
  without the token or with a wrong one from the network address, and takes one with the token;
- a second client on this machine without the token (a clean environment, ``HOME`` in a temp dir:
  no ``RAY_AUTH_TOKEN*``, no ``~/.ray/auth_token``) is refused job submission (``401``; the job SDK
  raises), dashboard and job API reads (``401``; ``403`` with a wrong token) and the GCS
  (``ray.init`` fails with Ray's authentication error), while the same script given the fleet's
  token gets through — so a fleet that let strangers in would fail here;
- Serve's HTTP port answers ``401`` without an API key and ``200`` with one; ``/health`` and the
  dashboard's health checks are open by design.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import psutil
import pytest
import requests

pytestmark = pytest.mark.cluster

# Run by a second client: each probe's outcome as JSON on the last line of stdout.
PROBE = textwrap.dedent('''
    import json, os, sys, urllib.request, urllib.error
    dashboard, gcs = sys.argv[1], sys.argv[2]
    out = {"token_env": sorted(k for k in os.environ if k.startswith("RAY_AUTH_TOKEN")),
           "token_file": os.path.exists(os.path.expanduser("~/.ray/auth_token"))}
    token = open(os.environ["RAY_AUTH_TOKEN_PATH"]).read().strip() if "RAY_AUTH_TOKEN_PATH" in os.environ else None

    def status(method, path, headers=None, body=None):
        req = urllib.request.Request(dashboard + path, method=method, headers=headers or {},
                                     data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    bearer = {"Authorization": "Bearer " + token} if token else {}
    submit = {"entrypoint": "echo stranger-was-here"} if token is None else {}  # insiders send a bad body: 400
    out["http"] = {m + " " + p: status(m, p, bearer, b) for m, p, b in [
        ("GET", "/api/cluster_status", None), ("GET", "/nodes?view=summary", None),
        ("GET", "/api/jobs/", None), ("POST", "/api/jobs/", submit), ("GET", "/api/gcs_healthz", None)]}
    out["wrong_token"] = status("GET", "/api/jobs/", {"Authorization": "Bearer not-the-token"})
    from ray.job_submission import JobSubmissionClient
    try:
        client = JobSubmissionClient(dashboard)
        out["job_sdk"] = "ok: %d jobs" % len(client.list_jobs()) if token else "submitted " + client.submit_job(
            entrypoint="echo stranger-was-here")
    except Exception as exc:
        out["job_sdk"] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
    print(json.dumps(out), flush=True)  # the GCS probe below may hang in a broken fleet: report first
    import ray
    try:
        ray.init(address=gcs, log_to_driver=False, logging_level="ERROR")
        out["gcs"] = "ok: %d nodes" % len(ray.nodes())
    except Exception as exc:  # Ray 2.60 wraps the GCS's refusal in a ConnectionError; the cause names it
        out["gcs"] = "%s: %s | cause: %s" % (type(exc).__name__, exc, exc.__cause__)
    print(json.dumps(out), flush=True)
''')


def _run_probe(local_fleet, tmp_path, *, token_path: str | None) -> dict:
    home = tmp_path / ("insider" if token_path else "stranger")
    home.mkdir()
    # A clean environment: nothing of this session's (RAY_ADDRESS, RAY_AUTH_*, RAYFLEET_HOME), HOME
    # where no token file is. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray dial 127.0.0.1 as given
    # (else it dials the machine's address, where nothing listens, and retries for minutes).
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    if token_path:
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}
    else:  # refused at every try: Ray's GCS connect window (20 one-second tries) cut to 3
        env["RAY_gcs_server_port_wait_time_s"] = "3"
    proc = subprocess.run([sys.executable, "-c", PROBE, local_fleet.dashboard_url, local_fleet.address],
                          env=env, cwd=home, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the probe printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_a_client_without_the_token_is_refused_and_one_with_it_is_not(local_fleet, tmp_path):
    from rayfleet.platform.launcher import ensure_auth_token

    stranger = _run_probe(local_fleet, tmp_path, token_path=None)
    assert stranger["token_env"] == [] and not stranger["token_file"], stranger  # it really has no token
    assert stranger["http"] == {"GET /api/cluster_status": 401, "GET /nodes?view=summary": 401,
                                "GET /api/jobs/": 401, "POST /api/jobs/": 401,
                                "GET /api/gcs_healthz": 200}, stranger  # open by design
    assert stranger["wrong_token"] == 403, stranger
    assert stranger["job_sdk"].startswith("AuthenticationError"), stranger
    # The GCS answers "Unauthenticated: ... InvalidAuthToken" to every try (3 of them, see _run_probe)
    assert stranger.get("gcs", "").startswith("ConnectionError") and "InvalidAuthToken" in stranger["gcs"], stranger
    assert not any(j.entrypoint == "echo stranger-was-here" for j in _jobs(local_fleet))

    insider = _run_probe(local_fleet, tmp_path, token_path=str(ensure_auth_token()))
    assert insider["http"] == {"GET /api/cluster_status": 200, "GET /nodes?view=summary": 200,
                               "GET /api/jobs/": 200, "POST /api/jobs/": 400, "GET /api/gcs_healthz": 200}, insider
    assert insider["job_sdk"].startswith("ok"), insider
    assert insider["gcs"] == f"ok: {len(__import__('ray').nodes())} nodes", insider


def _jobs(local_fleet) -> list:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(local_fleet.dashboard_url).list_jobs()


@pytest.fixture(scope="module")
def keyed_app(local_fleet, tmp_path_factory):
    """A one-replica app of the tiny model with API keys on (the default), its key in a file."""
    from ray import serve

    from rayfleet.serving.deployer import deploy

    key_file = tmp_path_factory.mktemp("api-keys") / "strangers.key"
    key_file.write_text("rf-test-" + os.urandom(12).hex() + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = deploy({"name": "test-strangers", "model": {"preset": "tiny", "seed": 5, "overrides": {"max_seq_len": 1024}},
                  "engine": {"block_size": 8, "num_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 128},
                  "colocated": {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"},
                  "http": {"port": port, "route_prefix": "/strangers", "api_keys": {"env": [], "file": str(key_file)}}})
    try:
        yield app
    finally:
        app.shutdown()
        serve.shutdown()


def test_serve_wants_an_api_key_but_health_is_open(keyed_app):
    assert keyed_app.api_key and keyed_app.url.startswith("http://127.0.0.1:")
    models = keyed_app.url + "/v1/models"
    assert requests.get(models, timeout=30).status_code == 401
    assert requests.get(models, headers={"Authorization": "Bearer not-the-key"}, timeout=30).status_code == 401
    assert requests.get(keyed_app.url + "/metrics", timeout=30).status_code == 401
    assert requests.get(models, headers={"Authorization": f"Bearer {keyed_app.api_key}"}, timeout=30).status_code == 200
    assert requests.get(keyed_app.url + "/health", timeout=30).status_code == 200  # open by design


def _listeners(local_fleet) -> dict[int, tuple[str, str]]:
    """port -> (bound address, process name) of every listening socket of the fleet's processes."""
    from rayfleet.platform.launcher import live_pids_where

    found = {}
    for pid in {p for node in local_fleet.fleet.nodes for p in live_pids_where(sid=node.pgid)}:
        try:
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found[conn.laddr.port] = (conn.laddr.ip, proc.name())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def _network_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def _grpc_call(host: str, port: int, *, token: str | None) -> "grpc.StatusCode":
    """The status of one call to a Serve replica's gRPC service (an empty, invalid request)."""
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", timeout=15, metadata=[("authorization", f"Bearer {token}")] if token else None)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_every_fleet_port_is_on_loopback_and_refused_from_the_network_address(local_fleet, keyed_app):
    from rayfleet.platform.launcher import ensure_auth_token

    listeners = _listeners(local_fleet)
    gcs_port = int(local_fleet.address.rsplit(":", 1)[1])
    dashboard_port = int(local_fleet.dashboard_url.rsplit(":", 1)[1])
    serve_port = int(keyed_app.url.split(":")[2].split("/")[0])
    names = {name for _, name in listeners.values()}
    assert {gcs_port, dashboard_port, serve_port} <= set(listeners), listeners
    assert {"gcs_server", "raylet"} <= names, names
    open_to_all = {port: seen for port, seen in listeners.items() if not _is_loopback(seen[0])}
    # Ray 2.60 binds a Serve replica's inter-deployment gRPC server to "[::]:0" with no setting
    # (serve/_private/replica.py); it checks the Ray token instead (below). Nothing else may be open.
    unbindable = {port for port, (_, name) in open_to_all.items() if name.startswith("ray::ServeReplica")}
    assert set(open_to_all) == unbindable, f"listening beyond loopback: {open_to_all}"

    address = _network_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    refused = {port: _refused(address, port) for port in set(listeners) - unbindable}
    assert all(refused.values()), {p: listeners[p] for p, r in refused.items() if not r}
    token = Path(ensure_auth_token()).read_text().strip()
    for port in unbindable:  # reachable from the network, so the token must refuse a stranger's call
        assert _grpc_call(address, port, token=None) == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_call(address, port, token="not-the-token") == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_call(address, port, token=token) != grpc.StatusCode.UNAUTHENTICATED  # the control
    for port in (gcs_port, dashboard_port, serve_port):  # the control: the same ports answer on loopback
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
