"""Hugging Face tensor names <-> rayfleet state-dict keys, with per-rank slicing on the way in.

Design decisions:
- One table of ``WeightRule`` (rayfleet key <- HF key, or <- a stack of per-expert HF keys)
  drives both directions, so import and export cannot disagree about a name.
- Reading goes through a ``TensorSource`` (implemented by ``rayfleet.storage.safetensors_io``
  over fsspec, or by a plain dict in tests): this package never opens files or URIs, and a
  source may read only the bytes of the slice a rank asks for.
- A rank's share is a ``ShardFn``: given a rayfleet key and its full shape it returns the box
  (a ``(start, stop)`` per dim) the rank holds, or None for the whole tensor. Dim 0 is read
  lazily (only those bytes); other dims are cut from the dim-0 slice in memory. On a stacked
  expert tensor dim 0 is the expert axis, so expert parallelism and FSDP's dim-0 shards both
  read only their experts.
- Per-expert keys (``experts.{e}.gate_proj.weight``, what ``save_pretrained`` writes and the hub
  holds) and transformers 5's fused ``experts.gate_up_proj``/``down_proj`` are both read.
- Export writes per-expert keys (the form every transformers version loads) and, for a GQA model
  trained with interleaved rotary pairs, permutes each head's q/k rows into the halves layout
  that Hugging Face's ``rotate_half`` expects (a pure reindexing: bit-exact values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig
from rayfleet.models.hf.config_map import HFModelSpec

__all__ = ["TensorSource", "WeightRule", "ShardFn", "weight_rules", "load_hf_weights", "export_hf_weights",
           "DictSource"]

# (rayfleet key, full shape) -> the box of the full tensor this rank holds: one (start, stop)
# per dim, or None for the whole tensor.
Box = tuple[tuple[int, int], ...]
ShardFn = Callable[[str, tuple[int, ...]], "Box | None"]


class TensorSource(Protocol):
    """Named tensors that can be read whole or as a slice along one dim."""

    def keys(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, *, dim: int = 0, start: int | None = None, stop: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor or its slice; written into ``out`` (and returned) when given."""
        ...


class DictSource:
    """A ``TensorSource`` over in-memory tensors (tests, and state dicts already in memory)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str, *, dim: int = 0, start: int | None = None, stop: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tensors[name]
        if start is not None or stop is not None:
            lo, hi = start or 0, t.shape[dim] if stop is None else stop
            t = t.narrow(dim, lo, hi - lo)
        return t if out is None else out.copy_(t)


@dataclass(frozen=True)
class WeightRule:
    """``target`` (rayfleet key) comes from ``sources`` (one HF key, or one per expert, stacked).

    ``fused``: transformers-5 fallback ``(hf_key, part, parts)``: expert tensor ``[E, parts*n, ..]``
    of which this target is part ``part`` along dim 1 (``gate_up_proj`` holds gate then up).
    """

    target: str
    sources: tuple[str, ...]
    stacked: bool = False
    fused: tuple[str, int, int] | None = None
    rope_rows: bool = False  # q/k rows (or bias / norm entries) that carry rotary pairs


def _attention_rules(c: MoEConfig, rf: str, hf: str) -> list[WeightRule]:
    if c.uses_mla:
        names = [("wkv_a.weight", "kv_a_proj_with_mqa.weight"), ("kv_norm.weight", "kv_a_layernorm.weight"),
                 ("wkv_b.weight", "kv_b_proj.weight"), ("wo.weight", "o_proj.weight")]
        if c.q_lora_rank:
            names += [("wq_a.weight", "q_a_proj.weight"), ("q_norm.weight", "q_a_layernorm.weight"),
                      ("wq_b.weight", "q_b_proj.weight")]
        else:
            names.append(("wq.weight", "q_proj.weight"))
        return [WeightRule(f"{rf}.{a}", (f"{hf}.{b}",)) for a, b in names]
    rules = [WeightRule(f"{rf}.wq.weight", (f"{hf}.q_proj.weight",), rope_rows=True),
             WeightRule(f"{rf}.wk.weight", (f"{hf}.k_proj.weight",), rope_rows=True),
             WeightRule(f"{rf}.wv.weight", (f"{hf}.v_proj.weight",)),
             WeightRule(f"{rf}.wo.weight", (f"{hf}.o_proj.weight",))]
    if c.qkv_bias:
        rules += [WeightRule(f"{rf}.wq.bias", (f"{hf}.q_proj.bias",), rope_rows=True),
                  WeightRule(f"{rf}.wk.bias", (f"{hf}.k_proj.bias",), rope_rows=True),
                  WeightRule(f"{rf}.wv.bias", (f"{hf}.v_proj.bias",))]
    if c.qk_norm:
        rules += [WeightRule(f"{rf}.q_norm.weight", (f"{hf}.q_norm.weight",), rope_rows=True),
                  WeightRule(f"{rf}.k_norm.weight", (f"{hf}.k_norm.weight",), rope_rows=True)]
    return rules


def _ffn_rules(rf: str, hf: str, names: tuple[str, str, str]) -> list[WeightRule]:
    return [WeightRule(f"{rf}.{w}.weight", (f"{hf}.{n}.weight",)) for w, n in zip(("w1", "w3", "w2"), names)]


def _moe_rules(spec: HFModelSpec, rf: str, hf: str) -> list[WeightRule]:
    c = spec.config
    mixtral = spec.architecture == "MixtralForCausalLM"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    fused = {"w1": (f"{hf}.experts.gate_up_proj", 0, 2), "w3": (f"{hf}.experts.gate_up_proj", 1, 2),
             "w2": (f"{hf}.experts.down_proj", 0, 1)}
    rules = [WeightRule(f"{rf}.router.weight", (f"{hf}.gate.weight",))]
    for w, n in zip(("w1", "w3", "w2"), names):
        rules.append(WeightRule(f"{rf}.experts.{w}", tuple(f"{hf}.experts.{e}.{n}.weight" for e in range(c.num_experts)),
                                stacked=True, fused=fused[w]))
    if c.num_shared_experts:
        shared = "shared_expert" if spec.architecture == "Qwen2MoeForCausalLM" else "shared_experts"
        rules += _ffn_rules(f"{rf}.shared_experts", f"{hf}.{shared}", ("gate_proj", "up_proj", "down_proj"))
    if c.shared_expert_gate:
        rules.append(WeightRule(f"{rf}.shared_expert_gate", (f"{hf}.shared_expert_gate.weight",)))
    # DeepSeek-V3's routing bias is the checkpoint's e_score_correction_bias; the other
    # architectures have none: rayfleet's buffer loads as zeros and must still be zero on export.
    bias_sources = (f"{hf}.gate.e_score_correction_bias",) if spec.architecture == "DeepseekV3ForCausalLM" else ()
    rules.append(WeightRule(f"{rf}.router.expert_bias", bias_sources))
    return rules


def weight_rules(spec: HFModelSpec) -> list[WeightRule]:
    """Every rayfleet state-dict entry of ``spec``'s model and where it lives in HF."""
    c = spec.config
    rules = [WeightRule("tok_embeddings.weight", ("model.embed_tokens.weight",)),
             WeightRule("norm.weight", ("model.norm.weight",)),
             WeightRule("output.weight", ("lm_head.weight",))]
    moe_name = "block_sparse_moe" if spec.architecture == "MixtralForCausalLM" else "mlp"
    for i in range(c.num_layers):
        rf, hf = f"layers.{i}", f"model.layers.{i}"
        rules += [WeightRule(f"{rf}.attention_norm.weight", (f"{hf}.input_layernorm.weight",)),
                  WeightRule(f"{rf}.ffn_norm.weight", (f"{hf}.post_attention_layernorm.weight",))]
        rules += _attention_rules(c, f"{rf}.attention", f"{hf}.self_attn")
        if c.is_moe_layer(i):
            rules += _moe_rules(spec, f"{rf}.feed_forward", f"{hf}.{moe_name}")
        else:
            rules += _ffn_rules(f"{rf}.feed_forward", f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj"))
    return rules


def _narrow(tensor: torch.Tensor, box: Box | None, first: int) -> torch.Tensor:
    """Cut dims ``first..`` of ``box`` out of ``tensor`` (a copy when anything was cut)."""
    if box is None:
        return tensor
    out = tensor
    for dim, (lo, hi) in enumerate(box[first:], start=first):
        if (lo, hi) != (0, tensor.shape[dim]):
            out = out.narrow(dim, lo, hi - lo)
    return out if out is tensor else out.contiguous()


def _read(source: TensorSource, name: str, box: Box | None, out: torch.Tensor | None = None) -> torch.Tensor:
    if box is None:
        return source.get(name, out=out)
    if all((lo, hi) == (0, n) for (lo, hi), n in zip(box[1:], source.shape(name)[1:])):
        return source.get(name, dim=0, start=box[0][0], stop=box[0][1], out=out)  # rows only: read in place
    part = _narrow(source.get(name, dim=0, start=box[0][0], stop=box[0][1]), box, 1)
    return part if out is None else out.copy_(part)


def _read_stacked(rule: WeightRule, source: TensorSource, keys: set[str], box: Box | None) -> torch.Tensor:
    lo, hi = box[0] if box is not None else (0, len(rule.sources))
    inner = box[1:] if box is not None else None
    if rule.sources[0] in keys:
        # Each expert is read straight into its slot of the stacked tensor (no torch.stack copy).
        first = _read(source, rule.sources[lo], inner)
        stacked = torch.empty((hi - lo, *first.shape), dtype=first.dtype)
        stacked[0] = first
        del first
        for i, e in enumerate(range(lo + 1, hi), start=1):
            _read(source, rule.sources[e], inner, out=stacked[i])
        return stacked
    if rule.fused is None or rule.fused[0] not in keys:
        raise SpecError("checkpoint", rule.sources[0], "tensor missing from the checkpoint",
                        "check that config.json matches the weights (architecture, layer and expert counts)")
    name, part, parts = rule.fused
    fused = source.get(name, dim=0, start=lo, stop=hi)
    width = fused.shape[1] // parts
    out = fused.narrow(1, part * width, width)
    return _narrow(out, None if box is None else ((lo, hi), *box[1:]), 1).contiguous()


def _full_shape(rule: WeightRule, source: TensorSource, keys: set[str]) -> tuple[int, ...]:
    if not rule.stacked:
        return tuple(source.shape(rule.sources[0]))
    if rule.sources[0] in keys:
        return (len(rule.sources), *source.shape(rule.sources[0]))
    assert rule.fused is not None
    e, rows, *rest = source.shape(rule.fused[0])
    return (e, rows // rule.fused[2], *rest)


def load_hf_weights(spec: HFModelSpec, source: TensorSource, *, shard: ShardFn | None = None,
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """rayfleet state dict of ``spec`` read from ``source`` (only each tensor's ``shard``).

    Raises ``SpecError`` naming the first HF tensor that is missing or has the wrong shape.
    """
    keys = set(source.keys())
    out: dict[str, torch.Tensor] = {}
    for rule in weight_rules(spec):
        sources = rule.sources
        if rule.target == "output.weight" and (spec.tie_word_embeddings or sources[0] not in keys):
            sources = ("model.embed_tokens.weight",)
            rule = WeightRule(rule.target, sources)
        if rule.target.endswith("expert_bias") and (not sources or sources[0] not in keys):
            # No bias in this architecture (or saved before any balancing step): zeros, fp32.
            num_experts = spec.config.num_experts
            out[rule.target] = torch.zeros(num_experts, dtype=torch.float32)
            continue
        if not rule.stacked and sources[0] not in keys:
            raise SpecError("checkpoint", sources[0], "tensor missing from the checkpoint",
                            "check that config.json matches the weights (architecture, layer and expert counts)")
        part = shard(rule.target, _full_shape(rule, source, keys)) if shard is not None else None
        tensor = _read_stacked(rule, source, keys, part) if rule.stacked else _read(source, sources[0], part)
        if rule.target.endswith("expert_bias"):
            tensor = tensor.float()  # the balancing bias accumulates tiny steps
        elif dtype is not None:
            tensor = tensor.to(dtype)
        out[rule.target] = tensor
    return out


def _halves_perm(head_dim: int) -> torch.Tensor:
    """Index map interleaved -> halves within one head: new[j] = old[perm[j]]."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _to_halves(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    rows = tensor.shape[0]
    perm = _halves_perm(head_dim)
    return tensor.reshape(rows // head_dim, head_dim, *tensor.shape[1:])[:, perm].reshape(tensor.shape)


def export_hf_weights(spec: HFModelSpec, state_dict: Mapping[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], bool]:
    """HF tensors for ``state_dict`` and whether the embeddings stay tied.

    Ties only when ``spec`` was tied and the output head still equals the embedding bit for bit.
    """
    c = spec.config
    permute = c.rope_interleaved and not c.uses_mla
    out: dict[str, torch.Tensor] = {}
    for rule in weight_rules(spec):
        if rule.target not in state_dict:
            raise SpecError("checkpoint", rule.target, "missing from the rayfleet state dict",
                            "export a checkpoint of a model with this config")
        tensor = state_dict[rule.target].detach().cpu()
        if not rule.sources:  # rayfleet-only state (a routing bias the architecture lacks)
            if torch.count_nonzero(tensor):
                raise SpecError(rule.target, "non-zero", f"{spec.architecture} has no expert routing bias",
                                "train with router_bias_update_rate=0 for this architecture")
            continue
        if permute and rule.rope_rows:
            tensor = _to_halves(tensor, c.resolved_head_dim)
        if rule.stacked:
            for e, name in enumerate(rule.sources):
                out[name] = tensor[e].contiguous()
        else:
            out[rule.sources[0]] = tensor.contiguous()
    tied = spec.tie_word_embeddings and torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])
    if tied:
        del out["lm_head.weight"]
    return out, tied
