"""The Serve deployments in ``_local_testing_mode`` (in-process, no Ray cluster): engine
replicas, the router deployment and the Serve-handle clients give a single engine's tokens in
both modes; replica options reserve accelerators as the spec says."""

from __future__ import annotations

import pytest
from ray import serve

from rayfleet.serving.deploy.deployments import (EngineReplica, RouterDeployment, _RouterClient, build_app,
                                          replica_options)
from rayfleet.serving.engine.async_engine import load_engine
from rayfleet.serving.deploy.replica_client import ServeReplicaClient
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.deploy.inference_service import InferenceService
from rayfleet.serving.spec import PoolSpec, ServeSpec

MODEL = {"preset": "tiny", "seed": 4, "dtype": "float64", "overrides": {"max_seq_len": 128, "init_std": 0.1}}
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 1, 2]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class ServiceProbe:
    """Test-side ingress stand-in: an InferenceService over the Serve handles it is bound to."""

    def __init__(self, router, handles, mode: str) -> None:
        self.service = InferenceService(router=_RouterClient(router), mode=mode,
                                        clients={n: ServeReplicaClient(n, h) for n, h in handles.items()})

    async def complete(self, prompt: list[int]) -> list[int]:
        tokens = []
        async for delta in self.service.stream(prompt, GREEDY):
            tokens += delta.token_ids
        return tokens

    async def usage(self) -> dict:
        return {n: u.__dict__ for n, u in (await self.service.block_usage()).items()}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_serve_handles_path_matches_single_engine(mode):
    spec = ServeSpec.parse({"model": MODEL, "mode": mode, "engine": {"block_size": 4, "num_blocks": 48},
                            "kv_transfer": {"transport": "local"}})
    config = spec.engine_config()
    reference = [list(r.output_token_ids) for r in load_engine(
        preset_name="tiny", seed=4, checkpoint=None, dtype="float64", overrides=MODEL["overrides"],
        config=config).generate(PROMPTS, GREEDY)]
    model = {"checkpoint": None, **MODEL}
    handles = {n: serve.deployment(EngineReplica).options(name=n).bind(
        name=n, model=model, config=config, transport="local", lease_s=5)
        for names in spec.replica_names().values() for n in names}
    router = serve.deployment(RouterDeployment).options(name="router").bind(
        handles, roles=spec.replica_names(), mode="prefix_aware", load_weight=0.5, block_size=4,
        model_id=config.model_id, num_blocks=48, poll_interval_s=0.05)
    probe = serve.run(serve.deployment(ServiceProbe).bind(router, handles, mode), name=f"probe-{mode}",
                      _local_testing_mode=True)
    assert [probe.complete.remote(p).result() for p in PROMPTS] == reference
    usage = probe.usage.remote().result()
    assert set(usage) == set(handles)
    assert all(u["num_free_blocks"] == u["num_blocks"] and not u["num_requests"] for u in usage.values())


def test_whole_app_builds_in_local_testing_mode():
    spec = ServeSpec.parse({"model": MODEL, "mode": "disaggregated", "prefill": {"replicas": 2},
                            "kv_transfer": {"transport": "local"}})
    handle = serve.run(build_app(spec), name="whole", _local_testing_mode=True)
    assert handle.deployment_name == "ingress"


def test_replica_options_reserve_accelerators():
    one = replica_options(PoolSpec(accelerators_per_replica=1, accelerator_type="H100", num_cpus=0.1))
    assert one["ray_actor_options"] == {"num_cpus": 0.1, "num_gpus": 1,
                                        "label_selector": {"ray.io/accelerator-type": "H100"}}
    tp = replica_options(PoolSpec(accelerators_per_replica=4, accelerator_type="H100"))
    assert len(tp["placement_group_bundles"]) == 4 and tp["placement_group_strategy"] == "STRICT_PACK"
    assert tp["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 1}  # fits bundle 0
    assert tp["placement_group_bundle_label_selector"] == [{"ray.io/accelerator-type": "H100"}] * 4
    cpu = replica_options(PoolSpec(accelerators_per_replica=0))
    assert "num_gpus" not in cpu["ray_actor_options"]


def test_generated_serve_config_validates_and_its_builder_builds(capsys):
    from ray.serve.schema import ServeDeploySchema

    from rayfleet.cli import main
    from rayfleet.serving.deploy.deployments import app_builder, serve_config

    spec = ServeSpec.parse({"model": MODEL, "mode": "disaggregated", "http": {"port": 8123}})
    config = serve_config(spec)
    ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else \
        ServeDeploySchema.parse_obj(config)
    assert config["http_options"]["port"] == 8123
    assert app_builder(config["applications"][0]["args"]) is not None
    assert main(["serve", "examples/serve/colocated.yaml", "--serve-config"]) == 0
    assert "rayfleet.serving.deploy.deployments:app_builder" in capsys.readouterr().out
