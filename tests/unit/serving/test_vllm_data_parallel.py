"""A wide-EP vLLM pool (``data_parallel_size`` > 1) -> Ray Serve LLM's data-parallel deployment
(``serving.vllm.config`` / ``data_parallel``), without Ray or vLLM. What Ray's builder and Serve
make of these arguments (the gang placement group on labelled nodes) is tested in
tests/cluster/test_vllm_dp_gang.py."""

from __future__ import annotations

import json

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.deploy.pool_scaling import HARD_MAX_REPLICAS
from rayfleet.serving.pool_parallelism import MAX_SERVE_REPLICAS
from rayfleet.serving.spec import ServeSpec
from rayfleet.serving.vllm.config import llm_config_fields, llm_deployment_name, vllm_app_args

LABEL = "rayfleet.io/accelerator-type"


def _spec(pool: dict, **fields) -> ServeSpec:
    base = {"engine": {"kind": "vllm", "block_size": 32}, "model": {"hf": "/models/moe", "name": "org/moe-a3b"},
            "vllm": {"device": "gpu"}, "colocated": pool}
    return ServeSpec.parse({**base, **fields})


WIDE = {"accelerator_type": "H100", "data_parallel_size": 4, "accelerators_per_replica": 8,
        "enable_expert_parallel": True, "replicas": 2, "max_replicas": 3}


def test_gpu_dp_pool_is_one_rank_per_serve_replica_with_labels_on_every_bundle():
    spec = _spec(WIDE)
    cfg = llm_config_fields(spec, "colocated")
    # One rank: TP 2 (8 accelerators / 4 ranks); Serve repeats these bundles for each of the 4 ranks.
    assert cfg["placement_group_config"]["bundles"] == [{"GPU": 1.0}, {"GPU": 1.0}]
    assert cfg["deployment_config"]["placement_group_bundle_label_selector"] == [{LABEL: "H100"}] * 2
    kw = cfg["engine_kwargs"]
    assert (kw["data_parallel_size"], kw["tensor_parallel_size"], kw["enable_expert_parallel"]) == (4, 2, True)
    assert "enable_eplb" not in kw and "data_parallel_rank" not in kw  # DPServer sets each rank's
    # The gang's accelerators are the pool's: a rank's share times the ranks (broken: 8 per rank).
    per_rank = sum(b.get("GPU", 0) for b in cfg["placement_group_config"]["bundles"])
    assert per_rank * spec.colocated.data_parallel_size == spec.colocated.accelerators_per_replica
    # Serve autoscaling counts gangs here; Ray's DPServer multiplies by data_parallel_size.
    assert cfg["deployment_config"]["autoscaling_config"]["min_replicas"] == 2
    assert spec.colocated.serve_replica_bounds() == (8, 12)  # what deploy writes to pool_scaling's KV


def test_dp_pool_under_rayfleets_router_runs_the_dp_server_that_publishes_its_stats():
    built = vllm_app_args(_spec(WIDE))
    assert built.builder == "build_openai_app"  # builds LLMConfig.server_cls's deployment
    (cfg,) = built.args["llm_configs"]
    assert cfg["server_cls"] == "rayfleet.serving.vllm.dp_server.RayfleetDPServer"
    assert cfg["deployment_config"]["request_router_config"]["request_router_class"].endswith("VLLMPrefixLoadRequestRouter")
    assert built.args["ingress_cls_config"]["ingress_cls"] == "rayfleet.serving.vllm.ingress.RayfleetOpenAiIngress"
    assert llm_deployment_name(_spec(WIDE), "colocated") == "RayfleetDPServer:org--moe-a3b"


def test_dp_pool_under_serves_routers_is_build_dp_openai_app_behind_rayfleets_api_keys():
    spec = _spec(WIDE, vllm={"device": "gpu", "request_router": "power_of_two"})
    built = vllm_app_args(spec)
    assert built.builder == "build_dp_openai_app"
    assert set(built.args) == {"llm_config", "ingress_deployment_config", "ingress_cls_config"}
    assert "server_cls" not in built.args["llm_config"]
    assert built.args["ingress_cls_config"]["ingress_cls"] == "rayfleet.serving.vllm.ingress.RayfleetOpenAiIngress"
    assert llm_deployment_name(spec, "colocated") == "DPServer:org--moe-a3b"


def test_cpu_dp_pool_on_a_fake_accelerator_fleet_reserves_one_accelerator_per_rank():
    spec = _spec({"accelerator_type": "H100", "data_parallel_size": 2, "accelerators_per_replica": 2,
                  "enable_expert_parallel": True}, vllm={"device": "cpu"})
    cfg = llm_config_fields(spec, "colocated")
    assert cfg["placement_group_config"] == {"bundles": [{"GPU": 1.0}], "strategy": "PACK"}
    assert cfg["deployment_config"]["placement_group_bundle_label_selector"] == [{LABEL: "H100"}]
    assert cfg["engine_kwargs"]["tensor_parallel_size"] == 1 and cfg["engine_kwargs"]["data_parallel_size"] == 2


def test_disaggregated_decode_pool_can_be_data_parallel():
    """Serve LLM's PD builder switches a side with ``data_parallel_size`` > 1 to its DP servers."""
    spec = _spec({}, mode="disaggregated", decode={"accelerator_type": "H100", "data_parallel_size": 2,
                                                   "accelerators_per_replica": 2, "enable_expert_parallel": True})
    built = vllm_app_args(spec)
    assert built.builder == "build_pd_openai_app"
    assert built.args["decode_config"]["engine_kwargs"]["data_parallel_size"] == 2
    assert "data_parallel_size" not in built.args["prefill_config"]["engine_kwargs"]
    assert llm_deployment_name(spec, "decode") == "Decode:org--moe-a3b"


def test_plain_pools_are_unchanged():
    built = vllm_app_args(_spec({"accelerator_type": "H100"}))
    assert built.builder == "build_openai_app"
    assert "data_parallel_size" not in built.args["llm_configs"][0]["engine_kwargs"]
    assert built.args["llm_configs"][0]["server_cls"] == "rayfleet.serving.vllm.server.RayfleetLLMServer"


@pytest.mark.parametrize("pool, fields, field_name, fix", [
    ({"data_parallel_size": 2, "accelerators_per_replica": 2}, {"engine": "builtin", "model": {"preset": "tiny"}},
     "colocated.data_parallel_size", "engine: vllm"),
    ({"data_parallel_size": 4, "accelerators_per_replica": 6}, {}, "colocated.accelerators_per_replica", "8"),
    ({"data_parallel_size": 2}, {}, "colocated.accelerators_per_replica", "2 (1 per rank)"),
    ({"enable_expert_parallel": True}, {}, "colocated.enable_expert_parallel", "data_parallel_size: 2"),
    ({"data_parallel_size": 2, "accelerators_per_replica": 2, "enable_eplb": True}, {}, "colocated.enable_eplb",
     "enable_expert_parallel: true"),
    ({"data_parallel_size": 2, "accelerators_per_replica": 2, "enable_expert_parallel": True, "enable_eplb": True},
     {"vllm": {"device": "cpu"}}, "colocated.enable_eplb", "enable_eplb: false"),
    ({"data_parallel_size": 16, "accelerators_per_replica": 16, "replicas": 2, "max_replicas": 5}, {},
     "colocated.max_replicas", "<= 64"),
])
def test_bad_wide_ep_settings_name_field_value_and_fix(pool, fields, field_name, fix):
    with pytest.raises(SpecError) as err:
        _spec(pool, **fields)
    assert err.value.field == field_name, str(err.value)
    assert "Fix:" in str(err.value) and fix in str(err.value).split("Fix:")[1], str(err.value)


def test_dp_over_a_dense_model_is_refused_when_its_config_is_read(tmp_path):
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    dense.mkdir(), moe.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 128}))
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    pool = {"data_parallel_size": 2, "accelerators_per_replica": 2, "enable_expert_parallel": True}
    with pytest.raises(SpecError) as err:
        vllm_app_args(_spec(pool, model={"hf": str(dense)}))
    assert err.value.field == "colocated.data_parallel_size" and "dense" in str(err.value)
    assert vllm_app_args(_spec(pool, model={"hf": str(moe)})).args["llm_configs"][0]["engine_kwargs"]["data_parallel_size"] == 2
    # a dense model with no DP is served as before
    assert vllm_app_args(_spec({}, model={"hf": str(dense)})).builder == "build_openai_app"


def test_spec_limit_is_pool_scalings_ceiling():
    assert MAX_SERVE_REPLICAS == HARD_MAX_REPLICAS


def test_dp_spec_round_trips_through_its_dump():
    spec = _spec(WIDE)
    assert ServeSpec.parse(spec.model_dump(mode="json")) == spec
