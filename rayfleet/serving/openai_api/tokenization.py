"""The served model's tokenizer as the OpenAI app uses it: prompts and chats to ids, ids to text.

Design decisions:
- Two implementations of one small interface (``ServedTokenizer``), picked by
  ``served_tokenizer(tok)`` from what the engine replica reports (``GenerationService.tokenizer``):
  the byte tokenizer of presets and training checkpoints, and a Hugging Face tokenizer
  (``rayfleet.models.hf.HFTokenizer``, duck-typed: this package imports nothing of ``jobs`` and
  needs no ``tokenizers`` import of its own).
- Byte tokenizer (unchanged behaviour): a completion prompt is BOS + its UTF-8 bytes; a chat is
  BOS + ``<|role|>\\ncontent\\n`` per message + ``<|assistant|>\\n``; text streams through the
  byte-exact ``ChoiceTextStream``.
- HF tokenizer: a completion prompt is encoded as the data pipeline encodes training text (BOS
  when the tokenizer has one, no post-processor specials); a chat is the model's own chat
  template rendered with ``add_generation_prompt=True`` and encoded without extra specials,
  which is what ``transformers``' ``apply_chat_template(tokenize=True)`` gives. A model without
  a template gets a 400 naming the fix, never a made-up format. Text streams through
  ``DecodedTextStream`` (whole-output decoding, held-back partial characters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from rayfleet.models import ByteTokenizer
from rayfleet.serving.openai_api.errors import APIError
from rayfleet.serving.openai_api.text_stream import ChoiceTextStream, DecodedTextStream, token_text

__all__ = ["ServedTokenizer", "ByteServedTokenizer", "HFServedTokenizer", "served_tokenizer", "BYTE",
           "message_text"]


class ServedTokenizer(Protocol):
    vocab_size: int

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Any]) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...  # logprobs' ``token``

    def token_bytes(self, token_id: int) -> list[int]: ...  # chat logprobs' ``bytes``

    def text_len(self, token_id: int) -> int: ...  # how far ``text_offset`` moves past the token

    def text_stream(self, stop: Sequence[str]) -> ChoiceTextStream | DecodedTextStream: ...


def message_text(message: Any) -> tuple[str, str]:
    """(role, text) of a ``ChatMessage`` or a plain dict of the same shape; text parts joined
    (other parts are refused before this point)."""
    role, content = ((message["role"], message.get("content")) if isinstance(message, dict)
                     else (message.role, message.content))
    if isinstance(content, list):
        content = "".join(p["text"] if isinstance(p, dict) else p.text for p in content)
    return role, content or ""


class ByteServedTokenizer:
    """The byte tokenizer (presets and training checkpoints)."""

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self.tok = tokenizer or ByteTokenizer()
        self.vocab_size = self.tok.vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=True)

    def encode_chat(self, messages: Sequence[Any]) -> list[int]:
        parts = [f"<|{role}|>\n{text}\n" for role, text in map(message_text, messages)]
        return self.tok.encode("".join(parts) + "<|assistant|>\n", add_bos=True)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(ids)

    def token_text(self, token_id: int) -> str:
        return token_text(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        return [token_id] if token_id < 256 else []

    def text_len(self, token_id: int) -> int:
        return len(token_text(token_id)) if token_id < 128 else (1 if token_id < 256 else 0)

    def text_stream(self, stop: Sequence[str]) -> ChoiceTextStream:
        return ChoiceTextStream(stop)


class HFServedTokenizer:
    """A Hugging Face tokenizer (``HFTokenizer``) with the model's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=True)

    def encode_chat(self, messages: Sequence[Any]) -> list[int]:
        if not self.tok.chat_template:
            raise APIError(400, f"the served model ({self.tok.name}) has no chat template, so its chat format is "
                                "unknown; add chat_template to its tokenizer_config.json (or a chat_template.jinja "
                                "file) and redeploy, or send the prompt to /v1/completions",
                           param="messages", code="chat_template_missing")
        from jinja2.exceptions import TemplateError

        chat = [{"role": role, "content": text} for role, text in map(message_text, messages)]
        try:
            text = self.tok.apply_chat_template(chat, add_generation_prompt=True)
        except TemplateError as exc:  # the template's own raise_exception (e.g. roles out of order)
            raise APIError(400, f"the model's chat template refused these messages: {exc}",
                           param="messages") from None
        return self.tok.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_text(token_id).encode("utf-8"))

    def text_len(self, token_id: int) -> int:
        return len(self.tok.decode([token_id]))

    def text_stream(self, stop: Sequence[str]) -> DecodedTextStream:
        return DecodedTextStream(self.tok.decode, stop)


BYTE = ByteServedTokenizer()


def served_tokenizer(tokenizer: Any) -> ServedTokenizer:
    """The app's view of the tokenizer an engine replica reports."""
    if isinstance(tokenizer, ByteTokenizer):
        return BYTE if tokenizer == BYTE.tok else ByteServedTokenizer(tokenizer)
    if hasattr(tokenizer, "apply_chat_template"):
        return HFServedTokenizer(tokenizer)
    raise TypeError(f"unknown tokenizer type {type(tokenizer).__name__}")
