"""The Serve deployments in ``_local_testing_mode`` (in-process, no Ray cluster): pool
deployments driven through ``PoolClient``s give a single engine's tokens in both modes, with the
P/D pairing (the KV lease released on the prefill replica that granted it); pinned calls refuse
a replica they do not name; pool options reserve the catalogue's accelerator resource."""

from __future__ import annotations

import pytest
from ray import serve

from rayfleet.serving.deploy.deployments import EngineReplica, pool_deployment_options, replica_options
from rayfleet.serving.openai_api.serve_app import build_app
from rayfleet.serving.deploy.inference_service import InferenceService
from rayfleet.serving.deploy.pool_client import FailedReplicas, PoolClient, PoolRouter
from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.errors import ReplicaUnavailableError
from rayfleet.serving.routing.router import RouteHint
from rayfleet.serving.spec import PoolSpec, ServeSpec

MODEL = {"preset": "tiny", "seed": 4, "dtype": "float64", "overrides": {"max_seq_len": 128, "init_std": 0.1}}
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 1, 2]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class ServiceProbe:
    """Test-side ingress stand-in: an InferenceService over pool clients of the bound pools."""

    def __init__(self, pools, mode: str) -> None:
        failed = FailedReplicas()
        clients = {role: PoolClient(role, h, block_size=4, model_id="tiny", failed=failed) for role, h in pools.items()}
        self.clients = clients
        self.service = InferenceService(router=PoolRouter(clients, mode=mode, max_prefill_retries=1), mode=mode,
                                        clients=clients)

    async def complete(self, prompt: list[int]) -> list[int]:
        tokens = []
        async for delta in self.service.stream(prompt, GREEDY):
            tokens += delta.token_ids
        return tokens

    async def usage(self) -> dict:
        return {n: u.__dict__ for n, u in (await self.service.block_usage()).items()}

    async def leases_remembered(self) -> int:
        return sum(len(c.handoff_to_replica) for c in self.clients.values())

    async def chat_ids(self, messages: list[dict]) -> tuple[str, list[int]]:
        """What the ingress's OpenAI app gets: the tokenizer a replica hands over, and a chat's ids."""
        from rayfleet.serving.openai_api.tokenization import served_tokenizer

        tok = served_tokenizer(await self.service.tokenizer())
        return type(tok).__name__, tok.encode_chat(messages)

    async def pinned_elsewhere(self) -> str:
        try:
            await self.clients[next(iter(self.clients))].call("block_usage", route=RouteHint(replica="gone"))
        except ReplicaUnavailableError as exc:
            return exc.replica
        return ""


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_serve_handles_path_matches_single_engine(mode):
    spec = ServeSpec.parse({"model": MODEL, "mode": mode, "engine": {"block_size": 4, "num_blocks": 48},
                            "kv_transfer": {"transport": "local"}})
    config = spec.engine_config(model_id="tiny")
    reference = [list(r.output_token_ids) for r in load_engine(
        preset_name="tiny", seed=4, checkpoint=None, dtype="float64", overrides=MODEL["overrides"],
        config=config).generate(PROMPTS, GREEDY)]
    model = {"checkpoint": None, **MODEL}
    pools = {role: serve.deployment(EngineReplica).options(name=role).bind(
        role=role, model=model, config=config, transport="local", lease_s=5) for role in spec.pools()}
    probe = serve.run(serve.deployment(ServiceProbe).bind(pools, mode), name=f"probe-{mode}",
                      _local_testing_mode=True)
    assert [probe.complete.remote(p).result() for p in PROMPTS] == reference
    usage = probe.usage.remote().result()
    assert {n.split("/")[0] for n in usage} == set(spec.pools())
    assert all(u["num_free_blocks"] == u["num_blocks"] and not u["num_requests"] and not u["num_leases"]
               for u in usage.values())
    assert probe.leases_remembered.remote().result() == 0  # every prefill lease released where granted
    assert probe.pinned_elsewhere.remote().result() == "gone"  # the replica refused a pin to another


def test_hf_model_pool_hands_its_tokenizer_to_the_ingress(tmp_path):
    """``model: {hf: DIR}`` on the built-in engine: the pool deployment loads the HF model and the
    ingress side gets the model's tokenizer through the pool handle (the app's chat template)."""
    transformers = pytest.importorskip("transformers")
    from rayfleet.serving.deploy.deployments import bind_pool
    from rayfleet.serving.vllm.tiny_model import write_tiny_qwen3_moe

    hf_dir = write_tiny_qwen3_moe(tmp_path / "tiny-moe", num_layers=1, hidden_size=64, num_experts=4)
    spec = ServeSpec.parse({"model": {"hf": str(hf_dir)}, "colocated": {"accelerators_per_replica": 0},
                            "kv_transfer": {"transport": "local"}})
    probe = serve.run(serve.deployment(ServiceProbe).bind({"colocated": bind_pool(spec, "colocated")}, "colocated"),
                      name="probe-hf", _local_testing_mode=True)
    chat = [{"role": "user", "content": "write a loop"}]
    kind, ids = probe.chat_ids.remote(chat).result()
    expected = transformers.AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert kind == "HFServedTokenizer" and ids == list(expected)


def test_whole_app_builds_in_local_testing_mode():
    spec = ServeSpec.parse({"model": MODEL, "mode": "disaggregated", "prefill": {"replicas": 2},
                            "kv_transfer": {"transport": "local"}})
    handle = serve.run(build_app(spec), name="whole", _local_testing_mode=True)
    assert handle.deployment_name == "ingress"


def test_replica_options_reserve_the_catalogue_resource_of_any_accelerator():
    label = "rayfleet.io/accelerator-type"
    one = replica_options(PoolSpec(accelerators_per_replica=1, accelerator_type="H100", num_cpus=0.1))
    assert one["ray_actor_options"] == {"num_cpus": 0.1, "num_gpus": 1, "label_selector": {label: "H100"}}
    tp = replica_options(PoolSpec(accelerators_per_replica=4, accelerator_type="H100"))
    assert len(tp["placement_group_bundles"]) == 4 and tp["placement_group_strategy"] == "STRICT_PACK"
    assert tp["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 1}  # fits bundle 0
    assert tp["placement_group_bundle_label_selector"] == [{label: "H100"}] * 4
    xpu = replica_options(PoolSpec(accelerators_per_replica=2, accelerator_type="p800"))  # Kunlun: XPU, not GPU
    assert xpu["ray_actor_options"] == {"num_cpus": 0.0, "resources": {"XPU": 1}}
    assert xpu["placement_group_bundles"] == [{"XPU": 1.0}, {"XPU": 1.0}]
    assert xpu["placement_group_bundle_label_selector"] == [{label: "P800"}] * 2
    npu = replica_options(PoolSpec(accelerators_per_replica=1, accelerator_type="910B"))
    assert npu["ray_actor_options"]["resources"] == {"NPU": 1} and "num_gpus" not in npu["ray_actor_options"]
    cpu = replica_options(PoolSpec(accelerators_per_replica=0))
    assert "num_gpus" not in cpu["ray_actor_options"] and "resources" not in cpu["ray_actor_options"]


def test_a_pool_is_one_autoscaled_deployment_routed_by_the_prefix_load_router():
    from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter

    spec = ServeSpec.parse({"model": MODEL, "mode": "disaggregated", "prefill": {"replicas": 3, "max_replicas": 5},
                            "router": {"load_weight": 0.25}})
    options = pool_deployment_options(spec, "prefill")
    assert options["name"] == "prefill" and "num_replicas" not in options
    scaling = options["autoscaling_config"]
    assert scaling["min_replicas"] == 3 and scaling["initial_replicas"] == 3
    assert scaling["policy"]["policy_function"].endswith("pool_scaling:bounded_pool_policy")
    router = options["request_router_config"]
    assert router.request_router_class in (PrefixLoadRequestRouter,
                                           f"{PrefixLoadRequestRouter.__module__}.PrefixLoadRequestRouter")
    # the router's cost (issue 30: predicted TTFT by default) gets the engine's block and step token sizes
    assert router.request_router_kwargs == {"role": "prefill", "load_weight": 0.25, "mode": "prefix_aware",
                                            "cost": "predicted_ttft", "tokens_per_block": 16, "step_token_budget": 256}


def test_generated_serve_config_validates_and_its_builder_builds(capsys):
    from ray.serve.schema import ServeDeploySchema

    from rayfleet.cli import main
    from rayfleet.serving.openai_api.serve_app import app_builder, serve_config

    spec = ServeSpec.parse({"model": MODEL, "mode": "disaggregated", "http": {"port": 8123}})
    config = serve_config(spec)
    ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else \
        ServeDeploySchema.parse_obj(config)
    assert config["http_options"]["port"] == 8123
    assert app_builder(config["applications"][0]["args"]) is not None
    assert main(["serve", "examples/serve/colocated.yaml", "--serve-config"]) == 0
    assert "rayfleet.serving.openai_api.serve_app:app_builder" in capsys.readouterr().out


class _Replica:
    """The two attributes of Serve's ``RunningReplica`` the request router reads."""

    def __init__(self, uid: str, stats: dict) -> None:
        self.replica_id = type("Id", (), {"unique_id": uid})()
        self.routing_stats = stats


def test_request_router_ranks_published_state_and_never_leaves_a_request_waiting():
    import asyncio

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve.request_router import PendingRequest

    from rayfleet.serving.engine.block_hash import hash_full_blocks, root_block_hash
    from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter

    router = PrefixLoadRequestRouter(DeploymentID(name="prefill", app_name="unit"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(role="prefill", load_weight=0.5)
    assert PrefixLoadRequestRouter.for_deployment("unit", "prefill") is router
    hashes = tuple(hash_full_blocks(list(range(32)), block_size=4, root=root_block_hash(model_id="tiny")))
    base = {"num_total_blocks": 64, "num_free_blocks": 64, "num_active_blocks": 0, "num_queued_blocks": 0}
    a, b = _Replica("a", {"version": 1, **base}), _Replica("b", {"version": 1, **base, "block_hashes": hashes})

    def choose(hint):
        request = PendingRequest(args=[], kwargs={"route": hint}, metadata=None, future=None)
        return asyncio.run(router.choose_replicas([a, b], request))

    # b published the prefix; its tier repeats (best_attempts: 5), so a probe that misses busy b
    # does not send the call to a (Serve doubles the probe deadline per tier: 0.1 ... 1.0 s).
    assert router.best_attempts == 5
    assert choose(RouteHint(block_hashes=hashes, num_prompt_blocks=9)) == [[b]] * 5 + [[a]]
    assert choose(RouteHint(replica="a")) == [[a]] * 5
    assert choose(RouteHint(replica="gone")) == [[a, b]] and router.num_fallbacks == 1  # the replica refuses
    router.core.rank = lambda *_, **__: 1 / 0  # a bug in the policy must not hang the request in Serve's loop
    assert choose(RouteHint()) == [[a, b]] and router.num_fallbacks == 2
