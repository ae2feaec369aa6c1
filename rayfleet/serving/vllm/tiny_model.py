"""A tiny Hugging Face Qwen3-MoE directory written locally: no hub, no download.

For tests, benchmarks and demos of ``engine: vllm`` on machines without network or GPU. Needs
``transformers`` (the ``test`` extra), never imported by the serving path itself.

Design decisions:
- Qwen3-MoE because vLLM, transformers and rayfleet's HF import all know it, and it is an MoE.
- ``head_dim`` 32: vLLM's CPU attention supports 32, 64, 80, ... (16 fails at the first forward).
- The tokenizer is a byte-level BPE trained here with ``tokenizers`` on a fixed text, so the same
  seed and text give the same directory; its vocabulary is padded up to the model's ``vocab_size``
  by the model's embedding (``vocab_size`` >= tokenizer size), which vLLM accepts.
- A chat template is saved with the tokenizer so ``/v1/chat/completions`` works.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_VOCAB_SIZE", "write_tiny_qwen3_moe"]

TINY_VOCAB_SIZE = 1024

_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    # Varied English so BPE merges are realistic: prompts of a few hundred tokens stay a few
    # hundred tokens (the PD tests need prompts of several KV blocks).
    words = ("the fleet serves mixture of experts models on shared accelerators while training jobs "
             "lend and take back replicas; prefill computes the prompt cache and decode streams tokens "
             "one at a time; a router sends each request to the replica holding its prefix").split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(200)]


def _write_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE - 16, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return len(fast)


def write_tiny_qwen3_moe(directory: str | Path, *, seed: int = 0, dtype: str = "float32",
                         num_layers: int = 2, hidden_size: int = 128, num_experts: int = 8,
                         max_position_embeddings: int = 2048) -> Path:
    """Write a random Qwen3-MoE (``config.json``, safetensors) and a tokenizer to ``directory``.

    Shapes: 4 query heads, 2 KV heads, head_dim 32, ``num_experts`` experts of which 2 are used
    per token. Returns the directory. Deterministic for a given ``seed``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size = _write_tokenizer(out)
    assert tokenizer_size <= TINY_VOCAB_SIZE, tokenizer_size
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|im_end|>")
    config = Qwen3MoeConfig(vocab_size=TINY_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            moe_intermediate_size=hidden_size, num_hidden_layers=num_layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=num_experts,
                            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                            max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                            eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=0, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, dtype))
    # Larger random weights than the HF init (std 0.02) so greedy choices are not near-ties: a
    # cross-engine comparison must not hinge on the last bit of a float sum.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return out
