"""Tiny random Hugging Face models of every supported architecture, built locally (no hub).

Shared by the oracle tests: ``transformers`` builds each model from a config, every parameter
(norms, biases and DeepSeek's routing bias included) is redrawn at a scale where logits are
O(1) and routing is uneven, and ``save_pretrained`` writes the directory rayfleet then loads.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=211, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
              tie_word_embeddings=False)


def hf_configs() -> dict[str, object]:
    from transformers import (DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)

    return {
        "llama": LlamaConfig(**COMMON),
        "qwen2": Qwen2Config(**COMMON),
        "qwen3": Qwen3Config(**COMMON, head_dim=24),
        "mixtral": MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[0], head_dim=16),
        "qwen2_moe": Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48),
        "deepseek_v3": DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, n_routed_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                        first_k_dense_replace=1, n_group=4, topk_group=2, q_lora_rank=24,
                                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                        v_head_dim=16),
    }


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def hf_config_dict(name: str) -> dict:
    """``config.json`` contents of the tiny ``name`` model, as ``save_pretrained`` writes them."""
    return {**hf_configs()[name].to_dict(), "architectures": [ARCHITECTURES[name]]}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw every parameter and buffer that is a weight: norms around 1, matrices ~N(0, 0.15)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def save_tiny(name: str, root: Path, *, seed: int = 0) -> Path:
    """Build, randomize and ``save_pretrained`` the tiny ``name`` model under ``root``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_configs()[name], dtype=torch.float32)
    randomize(model, seed)
    out = root / name
    model.save_pretrained(out)
    return out


CODE_TEXT = ["def add(a, b):\n    return a + b\n" * 40, "for i in range(10):\n    print(i)\n" * 40]


def save_tiny_moe_with_data(root: Path, *, seed: int = 0, shard_tokens: int = 512, seq_len: int = 32):
    """A tiny random Qwen3-MoE at ``root/hf`` with a locally trained BPE tokenizer of the model's
    vocabulary size, and a token dataset of ``CODE_TEXT`` at ``root/data``; returns the tokenizer."""
    import transformers

    from rayfleet.models.hf.tokenizer import train_byte_level_bpe
    from rayfleet.storage.safetensors_io import write_files
    from rayfleet.storage.tokens import prepare_token_dataset

    tok = train_byte_level_bpe(CODE_TEXT, vocab_size=300)
    config = hf_configs()["qwen3_moe"]
    config.vocab_size = tok.vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed=seed)
    model.save_pretrained(root / "hf")
    write_files(str(root / "hf"), tok.to_files())
    src = root / "src"
    src.mkdir()
    for i, text in enumerate(CODE_TEXT):
        (src / f"f{i}.py").write_text(text)
    prepare_token_dataset([str(src)], str(root / "data"), shard_tokens=shard_tokens, seq_len=seq_len, tokenizer=tok)
    return tok
