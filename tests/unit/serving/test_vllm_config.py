"""``engine: vllm`` specs -> Ray Serve LLM arguments (``rayfleet.serving.vllm.config``), without
Ray or vLLM. The live apps these arguments build are tested in tests/vllm."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.serving.spec import ServeSpec, load_serve_spec
from rayfleet.serving.deployer import pool_deployment_name
from rayfleet.serving.deploy.pool_scaling import HARD_MAX_REPLICAS
from rayfleet.serving.vllm.config import CPU_ENGINE_SHARE, llm_config_fields, llm_deployment_name, vllm_app_args


def _spec(**fields) -> ServeSpec:
    base = {"engine": {"kind": "vllm", "block_size": 32}, "model": {"hf": "/models/tiny-moe"}, "vllm": {"device": "cpu"}}
    for key, value in fields.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) and isinstance(value, dict) else value
    return ServeSpec.parse(base)


def test_engine_shorthand_and_default_builtin():
    assert ServeSpec.parse({}).engine.kind == "builtin"
    assert _spec().engine.kind == "vllm"
    assert _spec(engine={"kind": "vllm", "block_size": 32}).engine.block_size == 32
    assert _spec().model.served_name == "tiny-moe" and _spec().model.preset is None


@pytest.mark.parametrize("fields, field_name", [
    ({"engine": "vllm", "model": {"preset": "tiny"}}, "model.hf"),            # vLLM needs an HF model
    # builtin serves an HF model as its config.json says: a preset's overrides have no meaning there
    ({"model": {"hf": "/m", "overrides": {"num_layers": 2}}}, "model.overrides"),
    ({"engine": "sglang", "model": {"hf": "/m"}}, "engine.kind"),
    ({"engine": "vllm", "model": {"hf": "/m"}, "vllm": {"kv_connector": "shared_storage"}}, "vllm.kv_storage_path"),
    ({"engine": "vllm", "model": {"hf": "/m", "preset": "tiny"}}, "model"),
    # vLLM reads VLLM_CPU_KVCACHE_SPACE as an int: 0.5 failed every replica at engine start.
    ({"engine": "vllm", "model": {"hf": "/m"}, "vllm": {"kv_cache_gib": 0.5}}, "vllm.kv_cache_gib"),
])
def test_bad_specs_name_the_field(fields, field_name):
    with pytest.raises(SpecError) as err:
        ServeSpec.parse(fields)
    assert err.value.field == field_name or str(err.value).startswith(field_name), str(err.value)
    assert "Fix:" in str(err.value)


def test_colocated_cpu_pool_maps_to_build_openai_app():
    spec = _spec(colocated={"replicas": 2, "accelerators_per_replica": 0},
                 engine={"block_size": 32, "max_model_len": 512, "max_num_seqs": 4})
    built = vllm_app_args(spec)
    assert built.builder == "build_openai_app"
    (cfg,) = built.args["llm_configs"]
    assert cfg["model_loading_config"] == {"model_id": "tiny-moe", "model_source": "/models/tiny-moe"}
    assert cfg["accelerator_config"] == {"kind": "cpu"}
    assert cfg["placement_group_config"] == {"bundles": [{"CPU": CPU_ENGINE_SHARE}], "strategy": "PACK"}
    assert cfg["deployment_config"]["autoscaling_config"]["initial_replicas"] == 2
    assert cfg["deployment_config"]["ray_actor_options"] == {"num_cpus": 0}
    # a scale-down drains like the built-in engine's pools: checked every 0.5 s, not Serve's 2 s
    assert cfg["deployment_config"]["graceful_shutdown_wait_loop_s"] == 0.5
    assert cfg["deployment_config"]["graceful_shutdown_timeout_s"] == 20
    kw = cfg["engine_kwargs"]
    assert (kw["block_size"], kw["max_model_len"], kw["max_num_seqs"], kw["enforce_eager"]) == (32, 512, 4, True)
    assert "kv_transfer_config" not in kw and "gpu_memory_utilization" not in kw
    assert cfg["runtime_env"]["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                              "OMP_NUM_THREADS": "1"}
    assert built.args["ingress_deployment_config"]["ray_actor_options"] == {"num_cpus": 0}


def test_both_builders_put_serve_llms_ingress_behind_rayfleets_api_keys_without_a_key_in_the_config(monkeypatch):
    """The ingress class Serve LLM loads is ``vllm.ingress.RayfleetOpenAiIngress`` (checked live
    in tests/vllm); the config names where the keys are, never a key (configs get logged)."""
    monkeypatch.setenv("RAYFLEET_API_KEY", "rf-secret-value")
    for spec in (_spec(), _spec(mode="disaggregated"), _spec(http={"auth": "disabled"})):
        cls = vllm_app_args(spec).args["ingress_cls_config"]
        assert cls["ingress_cls"] == "rayfleet.serving.vllm.ingress.RayfleetOpenAiIngress"
        assert cls["ingress_extra_kwargs"]["rayfleet_auth"]["auth"] == spec.http.auth
        assert "rf-secret-value" not in repr(vllm_app_args(spec).args)
    assert (Path(__file__).resolve().parents[3] / "rayfleet/serving/vllm/ingress.py").read_text().count("class RayfleetOpenAiIngress(OpenAiIngress)") == 1


def test_pools_autoscale_within_the_shared_autoscalers_bounds():
    """Like the built-in engine's pools: Serve's rule clamped by ``bounded_pool_policy`` to the
    bounds in Ray's KV (``deploy`` writes replicas..max_replicas, the autoscaler moves them), so
    the Serve config's own maximum is only the hard ceiling."""
    for pool in ({"replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}, {"replicas": 2}):
        auto = llm_config_fields(_spec(colocated=pool), "colocated")["deployment_config"]
        assert "num_replicas" not in auto  # Serve refuses both
        auto = auto["autoscaling_config"]
        assert (auto["min_replicas"], auto["initial_replicas"]) == (pool["replicas"], pool["replicas"])
        assert auto["max_replicas"] == HARD_MAX_REPLICAS
        assert auto["target_ongoing_requests"] == pool.get("target_ongoing_requests", 4.0)
        assert auto["policy"] == {"policy_function": "rayfleet.serving.deploy.pool_scaling:bounded_pool_policy"}


def test_pool_deployment_names_are_serve_llms():
    """The bounds' key: Serve LLM names a pool deployment after the model id (``/`` -> ``--``,
    ``.`` -> ``_``), prefixed by the PD role or the server class (checked live in tests/vllm)."""
    pd = _spec(mode="disaggregated", model={"hf": "/m", "name": "org/tiny.moe"})
    assert llm_deployment_name(pd, "prefill") == "Prefill:org--tiny_moe"
    assert pool_deployment_name(pd, "decode") == "Decode:org--tiny_moe"
    assert llm_deployment_name(_spec(), "colocated") == "RayfleetLLMServer:tiny-moe"  # rayfleet's router
    assert llm_deployment_name(_spec(vllm={"request_router": "power_of_two"}), "colocated") == "LLMServer:tiny-moe"
    assert pool_deployment_name(ServeSpec.parse({"mode": "disaggregated"}), "decode") == "decode"  # built-in
    with pytest.raises(SpecError, match="autoscale.role"):
        llm_deployment_name(pd, "colocated")


def test_disaggregated_nixl_on_cpu_keeps_kv_in_host_memory():
    built = vllm_app_args(_spec(mode="disaggregated", prefill={"replicas": 2}))
    assert built.builder == "build_pd_openai_app"
    prefill, decode = built.args["prefill_config"], built.args["decode_config"]
    for cfg in (prefill, decode):
        assert cfg["engine_kwargs"]["kv_transfer_config"] == {
            "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    assert [c["deployment_config"]["autoscaling_config"]["min_replicas"] for c in (prefill, decode)] == [2, 1]


def test_shared_storage_connector_and_gpu_nixl():
    storage = _spec(mode="disaggregated", vllm={"kv_connector": "shared_storage", "kv_storage_path": "/shared/kv"})
    kv = vllm_app_args(storage).args["decode_config"]["engine_kwargs"]["kv_transfer_config"]
    assert kv == {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"shared_storage_path": "/shared/kv"}}
    gpu = _spec(mode="disaggregated", vllm={"device": "gpu"})
    assert vllm_app_args(gpu).args["prefill_config"]["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] == "cuda"


def test_gpu_replica_is_tensor_parallel_on_one_node_of_the_labelled_type():
    spec = _spec(vllm={"device": "gpu"}, model={"hf": "/m", "dtype": "bfloat16"},
                 colocated={"accelerators_per_replica": 4, "accelerator_type": "h100", "num_cpus": 2})
    cfg = llm_config_fields(spec, "colocated")
    assert cfg["placement_group_config"] == {
        "bundles": [{"GPU": 1.0, "CPU": 2}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}], "strategy": "STRICT_PACK"}
    # One selector per bundle, with the catalogue's spelling of the type.
    assert cfg["deployment_config"]["placement_group_bundle_label_selector"] == [
        {"rayfleet.io/accelerator-type": "H100"}] * 4
    kw = cfg["engine_kwargs"]
    assert kw["tensor_parallel_size"] == 4 and kw["enforce_eager"] is False and kw["dtype"] == "bfloat16"
    assert kw["gpu_memory_utilization"] == 0.9 and cfg["accelerator_config"] == {"kind": "gpu"}
    assert cfg["runtime_env"]["env_vars"] == {}


def test_cpu_engine_on_a_fake_accelerator_fleet_reserves_the_catalogue_resource():
    from rayfleet.platform.catalogue import get_accelerator

    xpu = get_accelerator("P800")
    cfg = llm_config_fields(_spec(colocated={"accelerators_per_replica": 1, "accelerator_type": "P800"}), "colocated")
    assert cfg["placement_group_config"]["bundles"] == [{xpu.ray_resource: 1.0}]
    assert cfg["deployment_config"]["placement_group_bundle_label_selector"] == [
        {"rayfleet.io/accelerator-type": xpu.name}]
    assert cfg["engine_kwargs"]["tensor_parallel_size"] == 1  # vllm-cpu runs one engine process


def test_unknown_accelerator_type_is_a_clear_error():
    with pytest.raises(RayfleetError) as err:  # at parse time or when placing, depending on PoolSpec
        llm_config_fields(_spec(colocated={"accelerator_type": "Z9000"}), "colocated")
    assert "Z9000" in str(err.value) and "Fix:" in str(err.value)


def test_user_engine_kwargs_win_and_env_is_added():
    spec = _spec(vllm={"engine_kwargs": {"enforce_eager": False, "seed": 7}, "env": {"VLLM_LOGGING_LEVEL": "DEBUG"},
                       "kv_cache_gib": 2})
    cfg = llm_config_fields(spec, "colocated")
    assert cfg["engine_kwargs"]["enforce_eager"] is False and cfg["engine_kwargs"]["seed"] == 7
    assert cfg["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert cfg["runtime_env"]["env_vars"]["VLLM_LOGGING_LEVEL"] == "DEBUG"


@pytest.mark.parametrize("router, expected", [
    ("prefix_cache_affinity", {"request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter"}),
    ("power_of_two", None),
])
def test_request_router_choice(router, expected):
    cfg = llm_config_fields(_spec(vllm={"request_router": router}), "colocated")
    assert cfg["deployment_config"].get("request_router_config") == expected
    assert "server_cls" not in cfg  # Serve LLM's own LLMServer


def test_rayfleet_router_is_the_colocated_default_with_its_stats_publishing_server():
    spec = _spec(router={"policy": "prefix_aware", "load_weight": 0.25})
    cfg = llm_config_fields(spec, "colocated")
    assert cfg["server_cls"] == "rayfleet.serving.vllm.server.RayfleetLLMServer"
    assert cfg["deployment_config"]["request_router_config"] == {
        "request_router_class": "rayfleet.serving.vllm.routing.VLLMPrefixLoadRequestRouter",
        "request_router_kwargs": {"role": "colocated", "mode": "prefix_aware", "load_weight": 0.25,
                                  "cost": "prefix_load", "tokens_per_block": 32, "block_chars": 32 * 4,
                                  # KV events on: the router hashes prompt tokens as the replicas hash vLLM's blocks
                                  "token_blocks": {"tokenizer": spec.model.hf, "model_id": spec.model.served_name,
                                                   "block_size": 32}},
        "request_routing_stats_period_s": 1.0}
    # vLLM pools keep the block-unit cost unless the spec names one (vllm_router_cost says why)
    chosen = llm_config_fields(_spec(router={"cost": "predicted_ttft"}), "colocated")
    assert chosen["deployment_config"]["request_router_config"]["request_router_kwargs"]["cost"] == "predicted_ttft"
    pd = vllm_app_args(_spec(mode="disaggregated")).args
    assert "request_router_config" not in pd["prefill_config"]["deployment_config"]  # Serve's default
    with pytest.raises(SpecError, match="vllm.request_router"):
        _spec(mode="disaggregated", vllm={"request_router": "rayfleet"})


@pytest.mark.parametrize("source, expected", [
    ("/models/x", "/models/x"), ("file:///models/x", "/models/x"), ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B"),
    ("s3://bucket/models/x", {"bucket_uri": "s3://bucket/models/x"}),
])
def test_model_sources(source, expected):
    cfg = llm_config_fields(_spec(model={"hf": source}), "colocated")
    assert cfg["model_loading_config"]["model_source"] == expected


def test_cpu_block_size_must_suit_vllms_cpu_attention():
    with pytest.raises(SpecError, match="engine.block_size") as err:
        llm_config_fields(_spec(engine={"block_size": 16}), "colocated")
    assert "32" in str(err.value)
    gpu = _spec(engine={"block_size": 16}, vllm={"device": "gpu"})
    assert llm_config_fields(gpu, "colocated")["engine_kwargs"]["block_size"] == 16


def test_prefix_affinity_in_pd_needs_a_cpu_for_its_tree_actor():
    """Regression: the decode replica's PrefixCacheAffinityRouter could not start its
    PrefixTreeActor inside a [{'GPU': 1}] placement group and every PD request hung."""
    with pytest.raises(SpecError, match="vllm.request_router") as err:
        vllm_app_args(_spec(mode="disaggregated", vllm={"request_router": "prefix_cache_affinity"}))
    assert "decode.num_cpus" in str(err.value)
    ok = vllm_app_args(_spec(mode="disaggregated", vllm={"request_router": "prefix_cache_affinity"},
                             decode={"num_cpus": 1}))
    assert ok.args["decode_config"]["placement_group_config"]["bundles"][0]["CPU"] == 1


def test_model_source_errors():
    with pytest.raises(SpecError, match="model.hf"):
        llm_config_fields(_spec(model={"hf": "ftp://host/x"}), "colocated")
    with pytest.raises(SpecError, match="model.dtype"):
        llm_config_fields(_spec(model={"hf": "/m", "dtype": "float64"}), "colocated")


def test_builtin_spec_is_refused_by_the_vllm_builder():
    with pytest.raises(SpecError, match="engine.kind"):
        vllm_app_args(ServeSpec.parse({}))


def test_examples_parse_and_round_trip(tmp_path):
    from pathlib import Path

    examples = sorted(Path(__file__).resolve().parents[3].joinpath("examples", "serve").glob("vllm-*.yaml"))
    assert examples, "examples/serve/vllm-*.yaml"
    for path in examples:
        spec = load_serve_spec(path)
        assert spec.engine.kind == "vllm"
        vllm_app_args(spec)
        # The dump is what `serve deploy` hands app_builder: it must parse back to the same spec.
        again = tmp_path / path.name
        again.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
        assert load_serve_spec(again) == spec


def test_node_initialization_is_skipped_only_for_a_local_directory_on_a_one_node_group(tmp_path):
    """Serve LLM's per-node model "download" (a task process per engine start) is skipped when it
    would download nothing: the model is a directory here and the replica's group is on this node."""
    from rayfleet.serving.vllm.config import NODE_INIT_CALLBACK
    from rayfleet.serving.vllm.node_init import CALLBACK_CLASS, LocalModelCallback, skips_node_init

    cfg = llm_config_fields(_spec(), "colocated")
    assert cfg["callback_config"] == {"callback_class": NODE_INIT_CALLBACK} and NODE_INIT_CALLBACK == CALLBACK_CLASS
    assert LocalModelCallback.__name__ == CALLBACK_CLASS.rsplit(".", 1)[1]
    here = str(tmp_path)
    assert skips_node_init(here, ["n1", "n1"], "n1")
    assert not skips_node_init(here, ["n1", "n2"], "n1")  # a group across nodes: each must be initialized
    assert not skips_node_init(here, ["n2"], "n1")
    assert not skips_node_init(here, [], "n1")
    assert not skips_node_init("Qwen/Qwen3-0.6B", ["n1"], "n1")  # a hub id: downloaded
    assert not skips_node_init("s3://bucket/model", ["n1"], "n1")
    assert not skips_node_init(str(tmp_path / "absent"), ["n1"], "n1")


def test_a_cpu_engine_runs_one_thread_per_core_its_bundle_reserves_unless_vllm_env_says():
    def threads(**fields) -> str:
        return llm_config_fields(_spec(**fields), "colocated")["runtime_env"]["env_vars"]["OMP_NUM_THREADS"]

    assert threads() == "1"  # half a core (CPU_ENGINE_SHARE) or none: one thread
    assert threads(colocated={"num_cpus": 0.5}) == "1"
    assert threads(colocated={"num_cpus": 8}) == "8"
    assert threads(colocated={"num_cpus": 8}, vllm={"env": {"OMP_NUM_THREADS": "4"}}) == "4"
