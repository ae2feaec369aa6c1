"""The decoder-only MoE transformer, one definition for training and serving.

Design decisions:
- ``forward(tokens)`` trains on full sequences; ``forward(tokens, positions=..., kv_cache=...,
  paged=...)`` serves with an external paged KV cache (see ``kv_cache``). Both go through the
  same blocks, so the serving engine runs exactly the weights and numerics that were trained.
- Build on the meta device, then ``materialize`` (``to_empty`` + ``init_weights``): parallel
  wrappers (FSDP2, TP, EP) are applied to a shapeless model and each rank allocates only its
  shard. ``init_weights`` seeds one generator per parameter from (seed, name), so values do not
  depend on module creation order, device, or which other parameters exist.
- Submodule names (``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.experts.w1``,
  ``output`` ...) are the checkpoint keys and the names FP8 converters and parallelizers match.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig
from rayfleet.models.kv_cache import PagedBatch, PagedKVCache
from rayfleet.models.layers import Attention, FeedForward, RMSNorm
from rayfleet.models.mla import LatentAttention
from rayfleet.models.moe import MoELayer

__all__ = ["TransformerBlock", "MoETransformer", "build_model", "materialize"]


class TransformerBlock(nn.Module):
    def __init__(self, config: MoEConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention: nn.Module
        if config.uses_mla:
            self.attention = LatentAttention(
                dim=config.dim, num_heads=config.num_heads, q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank, nope_head_dim=config.resolved_head_dim,
                rope_head_dim=config.rope_head_dim, v_head_dim=config.v_head_dim,
                rope_theta=config.rope_theta, rope_interleaved=config.rope_interleaved,
                norm_eps=config.norm_eps)
        else:
            self.attention = Attention(dim=config.dim, num_heads=config.num_heads,
                                       num_kv_heads=config.num_kv_heads,
                                       head_dim=config.resolved_head_dim, rope_theta=config.rope_theta,
                                       rope_interleaved=config.rope_interleaved,
                                       qkv_bias=config.qkv_bias, qk_norm=config.qk_norm,
                                       norm_eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module
        if config.is_moe_layer(layer_id):
            self.feed_forward = MoELayer(
                dim=config.dim, hidden_dim=config.moe_ffn_dim, num_experts=config.num_experts,
                top_k=config.top_k, num_shared_experts=config.num_shared_experts,
                score=config.router_score, route_scale=config.route_scale,
                bias_update_rate=config.router_bias_update_rate,
                aux_loss_coef=config.aux_loss_coef, capacity_factor=config.capacity_factor,
                norm_topk=config.router_norm_topk, num_groups=config.router_num_groups,
                topk_groups=config.router_topk_groups, shared_hidden_dim=config.resolved_shared_ffn_dim,
                shared_expert_gate=config.shared_expert_gate)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                paged: PagedBatch | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions, kv=kv, paged=paged)
        return x + self.feed_forward(self.ffn_norm(x))


class _Embedding(nn.Embedding):
    """``nn.Embedding`` that leaves a meta weight uninitialized: ``init_weights`` sets every weight
    once the model is materialized, and ``normal_`` on a meta tensor imports ``torch._dynamo`` (about
    1 CPU s of every process that builds a model: each training worker, replica and test rank)."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class MoETransformer(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = _Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                kv_cache: PagedKVCache | None = None,
                paged: PagedBatch | None = None) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` for tokens ``[B, S]``.

        Training: only ``tokens`` (causal over the sequence, positions 0..S-1).
        Serving: ``kv_cache`` and ``paged`` (positions come from ``paged.positions``); the new
        tokens' K/V are written into ``kv_cache`` in place and attention reads each sequence's
        blocks. Padding tokens (position -1) produce logits the caller must ignore.
        """
        if (kv_cache is None) != (paged is None):
            raise SpecError("kv_cache/paged", (kv_cache is None, paged is None),
                            "a paged forward needs both the cache and its addressing",
                            "pass kv_cache=PagedKVCache and paged=PagedBatch together, or neither")
        if paged is not None:
            positions = paged.positions
        elif positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            kv = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i])
            h = layer(h, positions, kv=kv, paged=paged)
        return self.output(self.norm(h))

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def tokens_per_expert(self) -> torch.Tensor:
        """Routed load of the last forward, ``[num_moe_layers, num_experts]`` int64."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros(0, self.config.num_experts, dtype=torch.int64)
        return torch.stack([m.last_tokens_per_expert for m in layers])

    def update_router_biases(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """One aux-loss-free balancing step per MoE layer (call after the optimizer step).

        ``tokens_per_expert`` ``[num_moe_layers, E]``, typically all-reduced over data
        parallel ranks; default is this rank's last forward.
        """
        for i, layer in enumerate(self.moe_layers()):
            layer.update_router_bias(None if tokens_per_expert is None else tokens_per_expert[i])

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init: each parameter from its own (seed, name)-seeded generator."""
        std = self.config.init_std
        out_std = std / (2 * self.config.num_layers) ** 0.5
        for name, param in self.named_parameters():
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                value = torch.ones(param.shape)
            elif leaf == "bias":
                value = torch.zeros(param.shape)
            elif name.startswith("tok_embeddings"):
                value = torch.randn(param.shape, generator=gen)
            elif name.startswith("output"):
                value = torch.randn(param.shape, generator=gen) * self.config.dim ** -0.5
            elif leaf in ("wo", "w2") or name.endswith(("wo.weight", "w2.weight")):
                value = torch.randn(param.shape, generator=gen) * out_std
            else:
                value = torch.randn(param.shape, generator=gen) * std
            param.copy_(value.to(param.dtype))
        for layer in self.moe_layers():
            layer.router.expert_bias.zero_()
            layer.last_tokens_per_expert.zero_()
        # Buffers that converters add (e.g. FP8 amax histories) are garbage after to_empty;
        # such modules expose reset_state so this model need not know about them.
        for module in self.modules():
            reset = getattr(module, "reset_state", None)
            if callable(reset):
                reset()


def materialize(model: MoETransformer, *, device: torch.device | str = "cpu", seed: int = 0) -> MoETransformer:
    """Allocate a meta-built model on ``device`` and initialize it from ``seed`` (in place)."""
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def build_model(config: MoEConfig | Mapping[str, Any], *, device: torch.device | str = "cpu", seed: int = 0,
                dtype: torch.dtype | None = None) -> MoETransformer:
    """Build on meta; unless ``device == "meta"``, materialize on ``device`` from ``seed``.

    ``config`` may be the saved dict of a ``MoEConfig`` (a servable's ``config``).
    """
    if not isinstance(config, MoEConfig):
        config = MoEConfig.from_dict(config)
    with torch.device("meta"):
        model = MoETransformer(config)
    if dtype is not None:
        model.to(dtype=dtype)
        for layer in model.moe_layers():  # the balancing bias accumulates tiny steps: keep fp32
            layer.router.expert_bias.data = layer.router.expert_bias.data.float()
    if torch.device(device).type == "meta":
        return model
    return materialize(model, device=device, seed=seed)
