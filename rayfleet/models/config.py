"""Shape of an MoE transformer: one frozen dataclass plus named presets.

Design decisions:
- One config describes both training and serving shapes; the planner reads the same numbers
  (``num_params``) that ``build_model`` turns into modules, so cost estimates and real models
  cannot drift apart (a unit test builds every preset on the meta device and compares counts).
- Presets go from ``tiny`` (unit tests and CPU benchmarks, seconds per step) to the published
  shapes of Mixtral-8x7B and DeepSeek-V3. DeepSeek-V3 uses multi-head latent attention (MLA);
  we model its attention as GQA with the same width and head count, so parameter counts of the
  attention block differ from the paper (the MoE part, which dominates, matches).
- Validation raises ``SpecError`` with the offending field at construction, so a bad shape
  fails before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Literal

from rayfleet.errors import SpecError

__all__ = ["MoEConfig", "PRESETS", "preset", "ParamCount"]


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a model: ``total`` stored, ``active`` used per token."""

    total: int
    active: int
    embedding: int


@dataclass(frozen=True)
class MoEConfig:
    """Decoder-only MoE transformer shape.

    Layers ``[0, num_dense_layers)`` use a dense SwiGLU FFN of width ``ffn_dim``; the rest use
    ``num_experts`` routed experts of width ``moe_ffn_dim`` (top ``top_k`` per token) plus
    ``num_shared_experts`` always-on experts of the same width.
    """

    vocab_size: int = 320
    dim: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 means dim // num_heads
    ffn_dim: int = 384
    moe_ffn_dim: int = 128
    num_experts: int = 4
    top_k: int = 2
    num_shared_experts: int = 1
    num_dense_layers: int = 1
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Sigmoid scores with top-k renormalisation (DeepSeek-V3) or softmax (Mixtral).
    router_score: Literal["sigmoid", "softmax"] = "sigmoid"
    # Multiplies routing weights after normalisation (DeepSeek-V3 uses 2.5).
    route_scale: float = 1.0
    # Aux-loss-free balancing: bias step per update (DeepSeek-V3's gamma); 0 disables it.
    router_bias_update_rate: float = 1e-3
    # Switch-style auxiliary load-balancing loss coefficient; 0 disables it.
    aux_loss_coef: float = 0.0
    # None: dropless. Otherwise each expert takes at most ceil(cf * tokens * top_k / E) tokens.
    capacity_factor: float | None = None
    init_std: float = 0.02
    # --- Hugging Face architectures (defaults keep rayfleet's own presets unchanged) ---
    # Rotary layout: interleaved pairs (x0,x1),(x2,x3).. (rayfleet, DeepSeek) or split halves
    # (x_i, x_{i+D/2}) as in HF Llama/Qwen/Mixtral ("rotate_half").
    rope_interleaved: bool = True
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rotary
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0: head_dim is then the
    # no-rotary q/k width, rope_head_dim the rotary width, v_head_dim the value width.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: a full-rank query projection
    rope_head_dim: int = 0
    v_head_dim: int = 0
    # Router: renormalise the top-k weights (False: Qwen2-MoE's default); group-limited top-k
    # (DeepSeek-V3: pick topk_groups of num_groups expert groups, scored by their top-2 sum).
    router_norm_topk: bool = True
    router_num_groups: int = 1
    router_topk_groups: int = 1
    # Shared experts: total width (0: moe_ffn_dim * num_shared_experts); sigmoid-gated (Qwen2-MoE).
    shared_ffn_dim: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 0):
                raise SpecError(f.name, value, "must be a non-negative integer", "pass an int >= 0")
        positive = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise SpecError(name, getattr(self, name), "must be positive", "pass an int >= 1")
        if self.head_dim == 0 and self.dim % self.num_heads:
            raise SpecError("num_heads", self.num_heads, f"does not divide dim={self.dim}",
                            "choose num_heads dividing dim or set head_dim explicitly")
        if self.num_heads % self.num_kv_heads:
            raise SpecError("num_kv_heads", self.num_kv_heads,
                            f"must divide num_heads={self.num_heads} for grouped-query attention",
                            "pick a divisor of num_heads")
        if self.resolved_head_dim % 2:
            raise SpecError("head_dim", self.resolved_head_dim, "rotary embeddings need an even head_dim",
                            "choose an even head_dim")
        if self.num_dense_layers > self.num_layers:
            raise SpecError("num_dense_layers", self.num_dense_layers,
                            f"exceeds num_layers={self.num_layers}", "lower num_dense_layers")
        if self.num_moe_layers and not 1 <= self.top_k <= self.num_experts:
            raise SpecError("top_k", self.top_k, f"must be in [1, num_experts={self.num_experts}]",
                            "lower top_k or add experts")
        if self.router_score not in ("sigmoid", "softmax"):
            raise SpecError("router_score", self.router_score, "unknown scoring", "use 'sigmoid' or 'softmax'")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise SpecError("capacity_factor", self.capacity_factor, "must be positive",
                            "pass a value > 0, or None for dropless routing")
        self._validate_extensions()
        if self.router_bias_update_rate < 0 or self.aux_loss_coef < 0:
            raise SpecError("router_bias_update_rate/aux_loss_coef",
                            (self.router_bias_update_rate, self.aux_loss_coef),
                            "must be non-negative", "pass 0 to disable")

    def _validate_extensions(self) -> None:
        if self.uses_mla:
            if not self.rope_head_dim or self.rope_head_dim % 2 or not self.v_head_dim:
                raise SpecError("rope_head_dim/v_head_dim", (self.rope_head_dim, self.v_head_dim),
                                "multi-head latent attention needs an even rotary width and a value width",
                                "set both (DeepSeek-V3: 64 and 128)")
            if self.qkv_bias or self.qk_norm or self.num_kv_heads != self.num_heads:
                raise SpecError("kv_lora_rank", self.kv_lora_rank,
                                "latent attention has no qkv bias, q/k norm or KV-head grouping",
                                "set qkv_bias=False, qk_norm=False and num_kv_heads=num_heads")
        elif self.q_lora_rank or self.rope_head_dim or self.v_head_dim:
            raise SpecError("q_lora_rank/rope_head_dim/v_head_dim",
                            (self.q_lora_rank, self.rope_head_dim, self.v_head_dim),
                            "only apply to latent attention", "set kv_lora_rank > 0 or leave them 0")
        groups, chosen = self.router_num_groups, self.router_topk_groups
        if groups < 1 or not 1 <= chosen <= groups or (self.num_moe_layers and self.num_experts % groups):
            raise SpecError("router_num_groups/router_topk_groups", (groups, chosen),
                            f"need 1 <= topk_groups <= num_groups dividing num_experts={self.num_experts}",
                            "use groups=1, topk_groups=1 for plain top-k")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise SpecError("shared_expert_gate", True, "there is no shared expert to gate",
                            "set num_shared_experts >= 1")

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.num_heads

    @property
    def resolved_shared_ffn_dim(self) -> int:
        return self.shared_ffn_dim or self.moe_ffn_dim * self.num_shared_experts

    def attention_params(self) -> int:
        """Parameters of one attention block (projections, biases, q/k or latent norms)."""
        hd, h = self.resolved_head_dim, self.num_heads
        if not self.uses_mla:
            params = self.dim * hd * (2 * h + 2 * self.num_kv_heads)
            if self.qkv_bias:
                params += hd * (h + 2 * self.num_kv_heads)
            return params + (2 * hd if self.qk_norm else 0)
        qk = hd + self.rope_head_dim
        q = (self.dim * h * qk if not self.q_lora_rank
             else self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk)
        kv = (self.dim * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * h * (hd + self.v_head_dim))
        return q + kv + h * self.v_head_dim * self.dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.num_dense_layers

    @classmethod
    def from_dict(cls, fields_: "Mapping[str, object]") -> "MoEConfig":
        """A config from saved fields (e.g. a servable's config.json); unknown keys are ignored
        so that files written by newer versions still load."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in fields_.items() if k in known})  # type: ignore[arg-type]

    def with_overrides(self, **overrides: object) -> "MoEConfig":
        return replace(self, **overrides)

    def num_params(self) -> ParamCount:
        """Analytic parameter counts (equal to the built model's, checked by a unit test)."""
        attn = self.attention_params()
        norms = 2 * self.dim
        dense_ffn = 3 * self.dim * self.ffn_dim
        expert = 3 * self.dim * self.moe_ffn_dim
        router = self.num_experts * self.dim
        shared = 3 * self.dim * self.resolved_shared_ffn_dim + (self.dim if self.shared_expert_gate else 0)
        moe_total = router + expert * self.num_experts + shared
        moe_active = router + expert * self.top_k + shared
        embedding = 2 * self.vocab_size * self.dim  # untied input embedding and output head
        base = embedding + self.dim + self.num_layers * (attn + norms) + self.num_dense_layers * dense_ffn
        return ParamCount(
            total=base + self.num_moe_layers * moe_total,
            active=base + self.num_moe_layers * moe_active,
            embedding=embedding,
        )


PRESETS: dict[str, MoEConfig] = {
    # Unit tests and CPU benchmarks: one dense layer then two MoE layers with a shared expert.
    "tiny": MoEConfig(),
    # A laptop-sized model for end-to-end demos on a local fleet.
    "small": MoEConfig(dim=512, num_layers=8, num_heads=8, num_kv_heads=4, ffn_dim=1536,
                       moe_ffn_dim=512, num_experts=16, top_k=2, num_shared_experts=1,
                       num_dense_layers=1, max_seq_len=4096),
    # Mixtral-8x7B (Jiang et al., 2024): softmax router, no shared experts, all layers MoE.
    "mixtral-8x7b": MoEConfig(vocab_size=32000, dim=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, ffn_dim=14336, moe_ffn_dim=14336, num_experts=8,
                              top_k=2, num_shared_experts=0, num_dense_layers=0,
                              max_seq_len=32768, rope_theta=1e6, router_score="softmax",
                              router_bias_update_rate=0.0, aux_loss_coef=0.01),
    # DeepSeek-V3 (2024): 256 routed + 1 shared expert, top-8, first 3 layers dense.
    "deepseek-v3": MoEConfig(vocab_size=129280, dim=7168, num_layers=61, num_heads=128,
                             num_kv_heads=128, head_dim=128, ffn_dim=18432, moe_ffn_dim=2048,
                             num_experts=256, top_k=8, num_shared_experts=1, num_dense_layers=3,
                             max_seq_len=163840, router_score="sigmoid", route_scale=2.5,
                             router_bias_update_rate=1e-3, aux_loss_coef=1e-4),
}


def preset(name: str, **overrides: object) -> MoEConfig:
    """A named preset, optionally with fields replaced."""
    if name not in PRESETS:
        raise SpecError("preset", name, "unknown model preset", f"use one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
