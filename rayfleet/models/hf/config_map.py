"""Hugging Face ``config.json`` <-> ``MoEConfig``, with a clear refusal for what we cannot run.

Design decisions:
- A whitelist of architectures and, inside each, of the config fields whose non-default values
  change the numerics. A field we do not model (sliding windows, RoPE scaling, biases on the
  MLP, a non-SiLU activation, ...) is refused with ``SpecError`` naming the field, rather than
  loaded into a model that silently computes something else. Fields that only matter to
  training regularisation (dropout) or to Hugging Face's runtime (``use_cache``) are ignored.
- Both config generations are read: transformers 4 (``rope_theta``/``rope_scaling``,
  ``num_experts``) and 5 (``rope_parameters``, ``num_local_experts``).
- Export keeps the imported ``config.json`` as its base and overwrites only the shape fields
  rayfleet owns, so token ids, ``transformers_version`` and unknown extras survive the trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "HFModelSpec", "from_hf_config", "to_hf_config",
           "hf_architecture_for"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                           "DeepseekV3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}


@dataclass(frozen=True)
class HFModelSpec:
    """An imported model's shape: rayfleet's config plus what the HF side needs to go back."""

    architecture: str
    config: MoEConfig
    tie_word_embeddings: bool = False
    hf_config: Mapping[str, Any] = field(default_factory=dict)


def _refuse(name: str, value: object, why: str, fix: str) -> SpecError:
    return SpecError(f"config.json:{name}", value, why, fix)


def _rope(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise _refuse("rope_parameters.rope_type", kind,
                      "RoPE scaling (yarn, llama3, dynamic ...) is not implemented in rayfleet's transformer",
                      "use a checkpoint with default RoPE, or remove the scaling for short contexts")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _check_common(arch: str, hf: Mapping[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "rayfleet's MLPs are SwiGLU (silu)",
                      "use a model with hidden_act='silu'")
    if hf.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "rayfleet's MLPs have no biases", "use mlp_bias=false")
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
        raise _refuse("attention_bias", True, f"{arch} with attention biases is not supported",
                      "use attention_bias=false (Qwen2 q/k/v biases are supported)")
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window", bool(window)) and window and window < hf.get("max_position_embeddings", 0):
        raise _refuse("sliding_window", window, "sliding-window attention is not supported",
                      "set sliding_window=null / use_sliding_window=false (full attention)")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse("layer_types", layer_types, "only full attention layers are supported",
                      "use a model whose layer_types are all 'full_attention'")
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) > 0:
        raise _refuse("router_jitter_noise", hf["router_jitter_noise"], "router noise is not supported",
                      "set router_jitter_noise=0")


def _dense_layers(hf: Mapping[str, Any], num_layers: int) -> int:
    """Qwen-MoE's ``mlp_only_layers``/``decoder_sparse_step`` as a dense prefix, or a refusal."""
    only = sorted(hf.get("mlp_only_layers") or [])
    if only != list(range(len(only))):
        raise _refuse("mlp_only_layers", only, "rayfleet puts dense layers only before the MoE layers",
                      "use a prefix [0, 1, .., k-1]")
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    if step != 1 and num_layers > len(only) + 1:
        raise _refuse("decoder_sparse_step", step, "interleaved dense/MoE layers are not supported",
                      "use decoder_sparse_step=1")
    return len(only)


def from_hf_config(hf: Mapping[str, Any]) -> HFModelSpec:
    """Map a Hugging Face ``config.json`` dict onto ``MoEConfig`` (or raise ``SpecError``)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _refuse("architectures", archs, "not an architecture rayfleet can map",
                      f"use one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    _check_common(arch, hf)
    heads = int(hf["num_attention_heads"])
    common: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or 0), ffn_dim=int(hf.get("intermediate_size") or 0),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)), rope_theta=_rope(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_interleaved=False,
        router_bias_update_rate=0.0, aux_loss_coef=0.0, num_shared_experts=0,
        init_std=float(hf.get("initializer_range", 0.02)))
    dense = dict(num_dense_layers=common["num_layers"], num_experts=0, top_k=0, moe_ffn_dim=0)
    num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0)
    moe = dict(num_experts=num_experts, top_k=int(hf.get("num_experts_per_tok", 0) or 0),
               moe_ffn_dim=int(hf.get("moe_intermediate_size") or 0), router_score="softmax",
               router_norm_topk=bool(hf.get("norm_topk_prob", True)))
    if arch == "LlamaForCausalLM":
        fields = {**common, **dense}
    elif arch == "Qwen2ForCausalLM":
        fields = {**common, **dense, "qkv_bias": True}
    elif arch == "Qwen3ForCausalLM":
        fields = {**common, **dense, "qk_norm": True}
    elif arch == "MixtralForCausalLM":
        fields = {**common, **moe, "moe_ffn_dim": common["ffn_dim"], "num_dense_layers": 0,
                  "router_norm_topk": True}
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        fields = {**common, **moe, "num_dense_layers": _dense_layers(hf, common["num_layers"])}
        if arch == "Qwen3MoeForCausalLM":
            fields["qk_norm"] = True
        else:
            shared = int(hf.get("shared_expert_intermediate_size") or 0)
            if not shared:
                raise _refuse("shared_expert_intermediate_size", shared, "Qwen2-MoE always has a shared expert",
                              "set it to the shared expert's width")
            fields.update(qkv_bias=bool(hf.get("qkv_bias", True)), num_shared_experts=1,
                          shared_ffn_dim=shared, shared_expert_gate=True)
    else:
        fields = {**common, **moe, **_deepseek_fields(hf, heads)}
    fields["num_kv_heads"] = fields["num_kv_heads"] if not fields.get("kv_lora_rank") else heads
    return HFModelSpec(architecture=arch, config=MoEConfig(**fields),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), hf_config=dict(hf))


def _deepseek_fields(hf: Mapping[str, Any], heads: int) -> dict[str, Any]:
    if int(hf.get("moe_layer_freq", 1) or 1) != 1:
        raise _refuse("moe_layer_freq", hf["moe_layer_freq"], "only every-layer MoE after the dense prefix",
                      "use moe_layer_freq=1")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _refuse("scoring_func/topk_method", (hf.get("scoring_func"), hf.get("topk_method")),
                      "DeepSeek-V3 routing is sigmoid scores with noaux_tc", "use the V3 defaults")
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise _refuse("num_key_value_heads", kv_heads, f"latent attention expands K/V for all {heads} heads",
                      "set num_key_value_heads = num_attention_heads")
    return dict(num_dense_layers=int(hf.get("first_k_dense_replace", 0)),
                num_shared_experts=int(hf.get("n_shared_experts") or 0), router_score="sigmoid",
                route_scale=float(hf.get("routed_scaling_factor", 1.0)),
                router_num_groups=int(hf.get("n_group") or 1), router_topk_groups=int(hf.get("topk_group") or 1),
                router_bias_update_rate=1e-3, kv_lora_rank=int(hf["kv_lora_rank"]),
                q_lora_rank=int(hf.get("q_lora_rank") or 0), head_dim=int(hf["qk_nope_head_dim"]),
                rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                rope_interleaved=bool(hf.get("rope_interleave", True)))


def hf_architecture_for(config: MoEConfig) -> str:
    """The HF architecture that computes exactly what ``config`` computes, or ``SpecError``.

    GQA models may use either rotary layout (export permutes interleaved q/k rows into halves).
    """
    arch = _architecture_for(config)
    if not arch:
        raise SpecError("model", "rayfleet config",
                        "no Hugging Face architecture computes this model (e.g. a sigmoid router with "
                        "GQA attention, shared experts without a gate, or q/k norm with q/k/v biases)",
                        "start from a Hugging Face model (`rayfleet model import`, or `model: {hf: DIR}` "
                        "in the job spec) so that the trained weights keep an exportable shape")
    if arch != "DeepseekV3ForCausalLM" and config.num_moe_layers and (
            config.router_bias_update_rate > 0 or config.route_scale != 1.0):
        raise SpecError("router_bias_update_rate/route_scale",
                        (config.router_bias_update_rate, config.route_scale),
                        f"{arch} routes without a balancing bias or a scale",
                        "train with router_bias_update_rate=0 and route_scale=1")
    return arch


def _architecture_for(c: MoEConfig) -> str:
    if c.uses_mla:
        ok = c.num_shared_experts >= 1 and c.shared_ffn_dim in (0, c.resolved_shared_ffn_dim) and (
            c.router_score == "sigmoid" and not c.shared_expert_gate)
        return "DeepseekV3ForCausalLM" if ok or not c.num_moe_layers else ""
    if c.qkv_bias and c.qk_norm:
        return ""
    if not c.num_moe_layers:
        return "Qwen3ForCausalLM" if c.qk_norm else "Qwen2ForCausalLM" if c.qkv_bias else "LlamaForCausalLM"
    if c.router_score != "softmax" or c.router_num_groups != 1:
        return ""
    if c.shared_expert_gate and c.num_shared_experts == 1 and not c.qk_norm:
        return "Qwen2MoeForCausalLM"
    if c.num_shared_experts or c.qkv_bias:
        return ""
    if c.qk_norm:
        return "Qwen3MoeForCausalLM"
    return "MixtralForCausalLM" if not c.num_dense_layers and c.router_norm_topk else ""


def to_hf_config(spec: HFModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict for ``spec`` (its imported dict updated with rayfleet's shape)."""
    c, arch = spec.config, spec.architecture
    hf = dict(spec.hf_config)
    hf.update(architectures=[arch], model_type=_MODEL_TYPES[arch], vocab_size=c.vocab_size,
              hidden_size=c.dim, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
              num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.norm_eps, hidden_act="silu",
              max_position_embeddings=c.max_seq_len, tie_word_embeddings=spec.tie_word_embeddings)
    hf.setdefault("rope_theta", c.rope_theta)
    if "rope_parameters" in hf:
        hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": c.rope_theta}
    else:
        hf["rope_theta"] = c.rope_theta
    if c.num_dense_layers or arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        hf["intermediate_size"] = c.ffn_dim
    if not c.uses_mla:
        hf["head_dim"] = c.resolved_head_dim
    if arch == "MixtralForCausalLM":
        hf.update(num_local_experts=c.num_experts, num_experts_per_tok=c.top_k, intermediate_size=c.moe_ffn_dim)
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        hf.update(num_experts=c.num_experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_ffn_dim,
                  norm_topk_prob=c.router_norm_topk, mlp_only_layers=list(range(c.num_dense_layers)),
                  decoder_sparse_step=1)
        if "num_local_experts" in hf:
            hf["num_local_experts"] = c.num_experts
        if arch == "Qwen2MoeForCausalLM":
            hf.update(shared_expert_intermediate_size=c.resolved_shared_ffn_dim, qkv_bias=c.qkv_bias)
    elif arch == "DeepseekV3ForCausalLM":
        hf.update(n_routed_experts=c.num_experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_ffn_dim,
                  n_shared_experts=c.num_shared_experts, first_k_dense_replace=c.num_dense_layers,
                  n_group=c.router_num_groups, topk_group=c.router_topk_groups, norm_topk_prob=c.router_norm_topk,
                  routed_scaling_factor=c.route_scale, kv_lora_rank=c.kv_lora_rank,
                  q_lora_rank=c.q_lora_rank or None, qk_nope_head_dim=c.resolved_head_dim,
                  qk_rope_head_dim=c.rope_head_dim, v_head_dim=c.v_head_dim,
                  qk_head_dim=c.resolved_head_dim + c.rope_head_dim, head_dim=c.rope_head_dim,
                  rope_interleave=c.rope_interleaved)
    return hf
