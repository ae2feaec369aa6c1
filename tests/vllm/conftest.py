"""The vLLM tier: ``engine: vllm`` for real, on one small local fleet shared by the whole session.

Runs after the cluster tier (``make test``), with its own fleet: 2 nodes, one with 4 fake A100
and one with 4 fake H100 (so that placement by the accelerator-type label is observable), the
same launcher as ``rayfleet up``. The model is a tiny Qwen3-MoE written by ``transformers`` into
a temp dir (no download). Engine starts are the cost (1-3 min each on 2 busy cores), so the
tests share apps: a colocated pool (2 replicas) and then a prefill/decode app (1 + 1); the pool is
deleted before the PD app starts. The PD app (``pd_app``) is shared by test_pd and test_autoscale,
where the shared autoscaler lends it one more decode engine for a while (three engines at most).

vLLM must be importable on Linux x86_64 (``make vllm`` installs it): there, a missing vLLM fails
every test here instead of skipping them. Elsewhere (no wheel) they skip.
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from live_helpers import stdlib_json_tokens, wait_until  # noqa: F401 - wait_until: the tier's modules import it from here
import yaml

# The order the tests run in: the offline engine needs no fleet; the pool app is deleted before
# the PD app starts; the autoscaler test reuses the PD app (one app start less: 2-8 min here).
_ORDER = ("test_offline.py", "test_pool.py", "test_pd.py", "test_autoscale.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        return _ORDER.index(item.path.name) if item.path.name in _ORDER else len(_ORDER)

    items.sort(key=rank)


def vllm_expected_here() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.fixture(scope="session", autouse=True)
def _vllm_installed():
    if importlib.util.find_spec("vllm") is None:
        if vllm_expected_here():
            pytest.fail("vLLM is not installed, and this platform (Linux x86_64) has a wheel. Fix: `make vllm`")
        pytest.skip(f"no vLLM wheel for {sys.platform}/{platform.machine()}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rayfleet.serving.vllm.tiny_model import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("models") / "tiny-moe", seed=0, dtype="float32")


@dataclass
class VLLMFleet:
    fleet: object  # rayfleet.platform.launcher.LocalFleet
    sdk: object  # rayfleet.sdk.Fleet
    address: str
    dashboard_url: str
    node_of_type: dict  # accelerator type -> Ray node id
    results: dict  # greedy outputs shared between tests (the pool's become the PD test's oracle)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """The token dataset every training job of this tier reads (made once per session)."""
    return stdlib_json_tokens(tmp_path_factory)


# vLLM's gauges reach the autoscaler through Ray's metrics agent, exported every
# ``metrics_report_interval_ms`` (10 s by default): the lend test waited that long to see the
# burst, the lent engine's tokens and the burst's end. 2 s cuts those lags (Ray's floor is 1 s);
# the test's TTFT window still spans several exports.
METRICS_EXPORT_S = 2.0
FAST_METRICS_EXPORT = {"metrics_report_interval_ms": int(METRICS_EXPORT_S * 1000)}


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory):
    import ray

    from rayfleet.platform import labels as L
    from rayfleet.platform.launcher import LocalFleet
    from rayfleet.platform.topology import build_topology
    from rayfleet.sdk import connect

    topology = build_topology(num_nodes=2, accelerator="A100:1,H100:1", accelerators_per_node=4)
    for attempt in range(3):
        # Ray gives a joining raylet 30 s (hard-coded) to register; on a loaded 2-core machine the
        # second node sometimes needs longer. LocalFleet.up tears down what it started on failure.
        try:
            fleet = LocalFleet.up(topology, home=tmp_path_factory.mktemp("rayfleet-home"),
                                  system_config=FAST_METRICS_EXPORT)
            break
        except Exception as exc:  # noqa: BLE001 - retried, then re-raised
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    try:
        sdk = connect(fleet.address)
        wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, timeout_s=120, what="both nodes")
        node_of_type = {n["Labels"][L.ACCELERATOR_TYPE]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        yield VLLMFleet(fleet=fleet, sdk=sdk, address=fleet.address, dashboard_url=fleet.dashboard_url,
                        node_of_type=node_of_type, results={})
    finally:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 - the fleet goes down next anyway
            pass
        if ray.is_initialized():
            ray.shutdown()
        fleet.down()


def replica_ids(dashboard_url: str, app: str, deployment_prefix: str = "") -> set[str]:
    """Serve's unique ids of ``app``'s live replicas whose deployment starts with
    ``deployment_prefix``: the ``ReplicaId`` label of vLLM's metrics (actor names are
    ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    from ray.util.state import list_actors

    out = set()
    for actor in list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000):
        parts = (actor.name or "").removeprefix("SERVE_REPLICA::").split("#")
        if len(parts) == 3 and parts[0] == app and parts[1].startswith(deployment_prefix):
            out.add(parts[2])
    return out


def long_prompt(seed: int, num_words: int = 120) -> str:
    """A prompt of several KV blocks (the tiny tokenizer makes about one token per word)."""
    words = ("the fleet serves mixture of experts models on shared accelerators while training jobs lend "
             "and take back replicas prefill computes the prompt cache and decode streams tokens").split()
    return " ".join(words[(seed * 5 + i * 3) % len(words)] for i in range(num_words))


PD_APP, PD_MODEL, PD_BLOCK = "vllm-pd", "tiny-moe", 32
API_KEY = "rf-vllm-tier-key"  # the apps read it from a key file (``http.api_keys.file``), as users would


def key_file(directory) -> str:
    """A key file holding ``API_KEY`` (mode 0600) in ``directory``; its path for the spec."""
    path = directory / "api.key"
    path.write_text(f"# rayfleet API keys, one per line\n{API_KEY}\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="session")
def pd_app(vllm_fleet, tiny_model_dir, tmp_path_factory):
    """The prefill/decode app on the H100 node (1 + 1 engines, KV over NIXL), started by
    ``rayfleet serve --detach``; yields (OpenAI base URL, ``ServeSpec``)."""
    from ray import serve

    from rayfleet.serving.spec import ServeSpec

    spec = {"name": PD_APP, "model": {"hf": str(tiny_model_dir), "name": PD_MODEL, "dtype": "float32"},
            "engine": {"kind": "vllm", "block_size": PD_BLOCK, "max_model_len": 512, "max_num_seqs": 8,
                       "max_num_batched_tokens": 512},
            "mode": "disaggregated",
            "prefill": {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"},
            "decode": {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"},
            "vllm": {"device": "cpu", "kv_connector": "nixl", "kv_cache_gib": 1},
            "http": {"route_prefix": "/pd", "api_keys": {"file": key_file(tmp_path_factory.mktemp("pd-key"))}}}
    path = tmp_path_factory.mktemp("pd") / "pd.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "rayfleet", "serve", str(path), "--address", vllm_fleet.address,
                           "--detach", "--timeout", "900"], capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    url = next(line.split("OpenAI base URL:")[1].split()[0] for line in proc.stdout.splitlines()
               if "OpenAI base URL:" in line)
    assert url.endswith("/pd/v1"), url
    yield url, ServeSpec.parse(spec)
    serve.delete(PD_APP, _blocking=True)
