"""What the planner needs to know about a model: shapes, not code.

Design decisions:
- The planner never imports the PyTorch model (``rayfleet.models``); it reasons from shapes.
  ``ModelSpec`` is a frozen dataclass of the numbers that decide memory and FLOPs; the pydantic
  ``ModelSpecInput`` is the public edge (YAML, SDK) and converts to it once.
- Parameter inventory follows the shapes a Megatron/torchtitan-style MoE transformer uses:
  SwiGLU MLPs (three ``hidden x ffn`` matrices), GQA attention (``q``/``o`` of ``heads*head_dim``,
  ``k``/``v`` of ``kv_heads*head_dim``) or, when ``kv_lora_rank > 0``, DeepSeek's multi-head
  latent attention (MLA), two RMSNorms per layer, an untied embedding and output head.
- Layers ``[0, first_k_dense_layers)`` are dense, the rest MoE (DeepSeek's layout; Mixtral: 0).
Units: counts are elements (parameters), FLOPs are per token, sequence lengths in tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from rayfleet.errors import SpecError

__all__ = ["ModelSpec", "ModelSpecInput", "PRESETS", "preset", "load_model_spec", "Precision"]

Precision = Literal["bf16", "fp8"]
MoeRouting = Literal["forced_balance", "token_drop", "dropless"]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only (MoE) transformer and its training batch.

    Attributes:
        name: label used in reports.
        num_layers: transformer blocks.
        hidden_size: model width ``h``.
        ffn_hidden_size: intermediate size of a dense SwiGLU MLP.
        num_heads / num_kv_heads / head_dim: attention heads; ``head_dim`` defaults to
            ``hidden_size // num_heads``. With MLA, ``head_dim`` is the no-RoPE q/k dim and the
            value dim.
        vocab_size: embedding rows (also output-head rows; untied).
        num_experts: routed experts per MoE layer; 0 for a dense model.
        top_k: routed experts each token visits.
        num_shared_experts: always-on experts per MoE layer (DeepSeek).
        moe_ffn_hidden_size: intermediate size of one expert.
        first_k_dense_layers: leading layers that use a dense MLP even in an MoE model.
        num_expert_groups / expert_groups_per_token: group-limited routing (DeepSeek-V3: 256
            experts in 8 groups, each token routed within its best 4 groups, so that it reaches
            at most 4 nodes); ``expert_groups_per_token = 0`` means no limit.
        q_lora_rank / kv_lora_rank / rope_head_dim: MLA shapes; ``kv_lora_rank = 0`` means GQA.
        seq_len: tokens per sequence.
        global_batch_sequences: sequences per optimizer step (global batch).
        precision: "bf16" or "fp8" GEMMs (FP8 also halves some communication bytes).
        moe_routing / moe_capacity_factor: how the router places tokens (forced_balance, token_drop
            padded to capacity_factor x the balanced load, dropless): ``rayfleet.placement.moe_load``.
        mtp_depth: multi-token-prediction modules on the last stage (DeepSeek-V3: 1).
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0
    num_experts: int = 0
    top_k: int = 0
    num_shared_experts: int = 0
    moe_ffn_hidden_size: int = 0
    first_k_dense_layers: int = 0
    num_expert_groups: int = 1
    expert_groups_per_token: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    seq_len: int = 4096
    global_batch_sequences: int = 512
    precision: Precision = "bf16"
    moe_routing: MoeRouting = "forced_balance"
    moe_capacity_factor: float = 1.0
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_spec(self)

    # -- structure ------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def distinct_shards_per_token(self, num_shards: int) -> float:
        """Expected number of distinct shards a token's ``top_k`` experts fall in, when the
        experts are split into ``num_shards`` contiguous equal blocks (EP ranks or nodes) and
        routing is balanced (uniform): ``n * (1 - P(a given shard gets none))``. Group-limited
        routing caps it: a token reaches only the shards holding its chosen groups."""
        n = max(1, num_shards)
        if n == 1 or not self.is_moe:
            return float(min(n, 1))
        per = self.num_experts / n
        miss = math.comb(self.num_experts - round(per), self.top_k) / math.comb(self.num_experts, self.top_k) \
            if per < self.num_experts else 0.0
        hit = n * (1 - miss)
        g, groups = self.expert_groups_per_token, self.num_expert_groups
        if g and g < groups:
            if groups % n == 0:  # whole groups per shard: the shard is missed when none is chosen
                per_g = groups // n
                hit = min(hit, n * (1 - math.comb(groups - per_g, g) / math.comb(groups, g)))
            else:  # a group spans n / groups shards
                hit = min(hit, g * n / groups)
        return hit

    @property
    def global_batch_tokens(self) -> int:
        return self.seq_len * self.global_batch_sequences

    # -- parameter inventory (elements, unsharded) ----------------------------------------
    def attention_params(self) -> int:
        """Attention projection weights of one layer (excluding the layer's two RMSNorms)."""
        return self.attention_replicated_params() + self.attention_split_params()

    def attention_replicated_params(self) -> int:
        """Attention weights that tensor parallelism does not split (MLA down-projections)."""
        if not self.uses_mla:
            return 0
        h, qr, kvr, rope = self.hidden_size, self.q_lora_rank, self.kv_lora_rank, self.rope_head_dim
        q_down = h * qr + qr if qr else 0  # weight + its RMSNorm
        return q_down + h * (kvr + rope) + kvr

    def attention_split_params(self) -> int:
        """Attention weights split ``1/tp`` by tensor parallelism (column- or row-parallel)."""
        h, nh, hd = self.hidden_size, self.num_heads, self.head_dim
        if self.uses_mla:
            q_in = self.q_lora_rank or h
            q_up = q_in * nh * (hd + self.rope_head_dim)
            kv_up = self.kv_lora_rank * nh * (hd + hd)
            return q_up + kv_up + nh * hd * h
        return h * nh * hd * 2 + 2 * h * self.num_kv_heads * hd

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.ffn_hidden_size

    def expert_params(self) -> int:
        """One routed (or shared) expert."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """All parameters (embedding, head and final norm included)."""
        total = 2 * self.embedding_params() + self.hidden_size
        for layer in range(self.num_layers):
            total += self.attention_params() + self.norm_params_per_layer()
            if self.is_moe_layer(layer):
                total += (self.router_params() + (self.num_experts + self.num_shared_experts)
                          * self.expert_params())
            else:
                total += self.dense_mlp_params()
        return total

    def active_params(self) -> int:
        """Parameters one token touches (what ``6 * N`` FLOP estimates use)."""
        total = 2 * self.embedding_params() + self.hidden_size
        for layer in range(self.num_layers):
            total += self.attention_params() + self.norm_params_per_layer()
            if self.is_moe_layer(layer):
                total += self.router_params() + (self.top_k + self.num_shared_experts) * self.expert_params()
            else:
                total += self.dense_mlp_params()
        return total

    # -- FLOPs (forward, per token) -------------------------------------------------------
    def attention_core_flops_per_token(self) -> float:
        """QK^T and AV of one layer for one token, causal (half the square), forward."""
        qk_dim = self.head_dim + (self.rope_head_dim if self.uses_mla else 0)
        return 2.0 * self.seq_len * self.num_heads * (qk_dim + self.head_dim) * 0.5

    def layer_forward_flops_per_token(self, layer: int) -> float:
        """GEMM + attention FLOPs of one layer for one token, forward pass."""
        return _layer_flops(self, self.is_moe_layer(layer))

    def model_forward_flops_per_token(self) -> float:
        """All layers plus the output head, forward, per token."""
        return _model_flops(self)

    def _layer_flops_uncached(self, moe: bool) -> float:
        gemm = self.attention_params()
        if moe:
            gemm += self.router_params() + (self.top_k + self.num_shared_experts) * self.expert_params()
        else:
            gemm += self.dense_mlp_params()
        return 2.0 * gemm + self.attention_core_flops_per_token()

    def head_forward_flops_per_token(self) -> float:
        return 2.0 * self.embedding_params()


# The planner prices thousands of plans of one model: memoise its per-layer FLOPs (specs are
# frozen and hashable, so the cache can never go stale).
@lru_cache(maxsize=256)
def _layer_flops(spec: ModelSpec, moe: bool) -> float:
    return spec._layer_flops_uncached(moe)


@lru_cache(maxsize=256)
def _model_flops(spec: ModelSpec) -> float:
    layers = sum(_layer_flops(spec, spec.is_moe_layer(i)) for i in range(spec.num_layers))
    return layers + spec.head_forward_flops_per_token()


def _check_spec(spec: ModelSpec) -> None:
    positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size", "seq_len",
                "global_batch_sequences")
    for name in positive:
        if getattr(spec, name) < 1:
            raise SpecError(f"model.{name}", getattr(spec, name), "must be at least 1", f"set model.{name} >= 1")
    if spec.num_heads % spec.num_kv_heads:
        raise SpecError("model.num_kv_heads", spec.num_kv_heads, f"does not divide num_heads={spec.num_heads}",
                        "use a kv head count that divides the head count (GQA groups)")
    if spec.precision not in ("bf16", "fp8"):
        raise SpecError("model.precision", spec.precision, "unknown precision", "use 'bf16' or 'fp8'")
    if spec.moe_routing not in ("forced_balance", "token_drop", "dropless") or spec.moe_capacity_factor < 1:
        raise SpecError("model.moe_routing", (spec.moe_routing, spec.moe_capacity_factor), "unknown routing or a "
                        "capacity factor below 1", "use forced_balance, token_drop or dropless, capacity >= 1")
    if not 0 <= spec.first_k_dense_layers <= spec.num_layers:
        raise SpecError("model.first_k_dense_layers", spec.first_k_dense_layers,
                        f"must lie in [0, num_layers={spec.num_layers}]", "lower first_k_dense_layers")
    if spec.first_k_dense_layers and spec.ffn_hidden_size < 1 or not spec.is_moe and spec.ffn_hidden_size < 1:
        raise SpecError("model.ffn_hidden_size", spec.ffn_hidden_size, "dense layers need an MLP width",
                        "set model.ffn_hidden_size")
    if spec.is_moe:
        if not 1 <= spec.top_k <= spec.num_experts:
            raise SpecError("model.top_k", spec.top_k, f"must lie in [1, num_experts={spec.num_experts}]",
                            "set top_k to the experts each token visits, e.g. 2")
        if spec.num_expert_groups < 1 or spec.num_experts % spec.num_expert_groups \
                or not 0 <= spec.expert_groups_per_token <= spec.num_expert_groups:
            raise SpecError("model.expert_groups_per_token", (spec.num_expert_groups, spec.expert_groups_per_token),
                            f"need num_expert_groups dividing num_experts={spec.num_experts} and "
                            "0 <= expert_groups_per_token <= num_expert_groups",
                            "set e.g. num_expert_groups: 8, expert_groups_per_token: 4 (or leave both out)")
        if spec.moe_ffn_hidden_size < 1:
            raise SpecError("model.moe_ffn_hidden_size", spec.moe_ffn_hidden_size,
                            "an MoE model needs the expert width", "set model.moe_ffn_hidden_size")


# Published shapes. Batch sizes are the ones the public recipes trained with.
PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(name="llama3-8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_heads=32,
                  num_kv_heads=8, vocab_size=128256, seq_len=8192, global_batch_sequences=512),
        ModelSpec(name="llama3-70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_heads=64,
                  num_kv_heads=8, vocab_size=128256, seq_len=8192, global_batch_sequences=512),
        ModelSpec(name="mixtral-8x7b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_heads=32,
                  num_kv_heads=8, vocab_size=32000, num_experts=8, top_k=2, moe_ffn_hidden_size=14336,
                  seq_len=4096, global_batch_sequences=512),
        ModelSpec(name="llama3.1-405b", num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_heads=128,
                  num_kv_heads=8, vocab_size=128256, seq_len=8192, global_batch_sequences=512),
        ModelSpec(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_heads=32,
                  num_kv_heads=4, head_dim=128, vocab_size=151936, num_experts=128, top_k=8,
                  moe_ffn_hidden_size=768, seq_len=4096, global_batch_sequences=512),
        ModelSpec(name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_heads=64,
                  num_kv_heads=4, head_dim=128, vocab_size=151936, num_experts=128, top_k=8,
                  moe_ffn_hidden_size=1536, seq_len=4096, global_batch_sequences=2048),
        ModelSpec(name="deepseek-v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_heads=128,
                  num_kv_heads=128, head_dim=128, vocab_size=129280, num_experts=256, top_k=8,
                  num_shared_experts=1, moe_ffn_hidden_size=2048, first_k_dense_layers=3, num_expert_groups=8,
                  expert_groups_per_token=4, q_lora_rank=1536,
                  kv_lora_rank=512, rope_head_dim=64, seq_len=4096, global_batch_sequences=8192,
                  precision="fp8", mtp_depth=1),
    )
}


def preset(name: str, **overrides: Any) -> ModelSpec:
    """A published shape by name, with any field overridden (e.g. ``num_layers=4``)."""
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise SpecError("model.preset", name, "unknown preset", f"use one of {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[key], **overrides)


class ModelSpecInput(BaseModel):
    """The public (YAML/SDK) form of a model spec: a preset, explicit fields, or both.

    Explicit fields override the preset's. ``global_batch_tokens`` may replace
    ``global_batch_sequences`` (it must be a multiple of ``seq_len``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str | None = None
    name: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    num_shared_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    first_k_dense_layers: int | None = None
    num_expert_groups: int | None = None
    expert_groups_per_token: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    rope_head_dim: int | None = None
    seq_len: int | None = None
    global_batch_sequences: int | None = None
    global_batch_tokens: int | None = None
    precision: Precision | None = None
    moe_routing: MoeRouting | None = None
    moe_capacity_factor: float | None = None
    mtp_depth: int | None = None

    @model_validator(mode="after")
    def _batch_given_once(self) -> "ModelSpecInput":
        if self.global_batch_sequences is not None and self.global_batch_tokens is not None:
            raise ValueError("give global_batch_sequences or global_batch_tokens, not both")
        return self

    def to_spec(self) -> ModelSpec:
        fields = {k: v for k, v in self.model_dump().items()
                  if v is not None and k not in ("preset", "global_batch_tokens")}
        tokens = self.global_batch_tokens
        if self.preset is not None:
            base = preset(self.preset)
            seq = fields.get("seq_len", base.seq_len)
        else:
            required = ("num_layers", "hidden_size", "num_heads", "vocab_size")
            missing = [k for k in required if k not in fields]
            if missing:
                raise SpecError("model", sorted(fields), f"missing {missing} and no preset",
                                f"add {missing} or `preset: {sorted(PRESETS)[0]}`")
            base = None
            seq = fields.get("seq_len", 4096)
        if tokens is not None:
            if tokens % seq:
                raise SpecError("model.global_batch_tokens", tokens, f"is not a multiple of seq_len={seq}",
                                "use a whole number of sequences")
            fields["global_batch_sequences"] = tokens // seq
        if base is not None:
            return replace(base, **fields)
        fields.setdefault("name", "custom")
        fields.setdefault("num_kv_heads", fields["num_heads"])
        fields.setdefault("ffn_hidden_size", 4 * fields["hidden_size"])
        return ModelSpec(**fields)


def load_model_spec(source: str | Path | Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """A ``ModelSpec`` from a YAML path, a preset name, a mapping or a spec; errors name the field."""
    if isinstance(source, ModelSpec):
        return source
    if isinstance(source, (str, Path)) and str(source).strip().lower() in PRESETS:
        return preset(str(source))
    if isinstance(source, (str, Path)):
        import yaml  # only the YAML edge needs it

        path = Path(source)
        if not path.exists():
            raise SpecError("model", str(source), "no such file or preset",
                            f"pass a YAML path or one of {', '.join(sorted(PRESETS))}")
        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, Mapping) and "model" in data and isinstance(data["model"], Mapping):
            data = data["model"]
        source = data
    try:
        return ModelSpecInput.model_validate(dict(source)).to_spec()
    except ValidationError as err:
        first = err.errors()[0]
        field = "model." + ".".join(str(p) for p in first["loc"]) if first["loc"] else "model"
        raise SpecError(field, first.get("input"), first["msg"],
                        "see examples/models/*.yaml for the accepted fields") from None
