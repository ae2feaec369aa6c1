"""A Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) behind the
``ByteTokenizer`` interface, with the model's chat template.

Design decisions:
- ``tokenizers`` (the Rust library) does the encoding, not ``transformers``: it is small, has
  no torch dependency, and ``tokenizer.json`` is exactly its format, so the ids are the ones
  ``AutoTokenizer`` produces for the same files (a unit test checks that).
- Chat templates render with Jinja's immutable sandbox and the same options and helpers as
  transformers (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, a non-escaping
  ``tojson``), so a model's own template means what its authors meant.
- Built from file contents, not paths: reading local folders or fsspec URIs is the caller's
  job (``rayfleet.storage.hf_checkpoint``), which keeps this package free of I/O.
- ``bos_id``/``eos_id``/``pad_id`` come from tokenizer_config's token strings; a tokenizer
  without a BOS (Qwen) has ``bos_id = None`` and ``encode(add_bos=True)`` adds nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from rayfleet.errors import SpecError

__all__ = ["HFTokenizer", "train_byte_level_bpe", "DEFAULT_CHAT_TEMPLATE"]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


class HFTokenizer:
    """Encode/decode with a ``tokenizers.Tokenizer``; render chats with the model's template."""

    def __init__(self, tokenizer_json: str, tokenizer_config: Mapping[str, Any] | None = None, *,
                 chat_template: str | None = None, name: str = "hf") -> None:
        from tokenizers import Tokenizer

        self.tokenizer_json = tokenizer_json
        self.config = dict(tokenizer_config or {})
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.name = name
        self.config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        template = chat_template or self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.bos_id = self._id(self.bos_token)
        self.eos_id = self._id(self.eos_token)
        self.pad_id = self._id(self.pad_token)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its source text: it crosses processes (a Serve replica hands it to the ingress).
        return (_rebuild, (self.tokenizer_json, self.config, self.chat_template, self.name))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None)

    def encode(self, text: str | bytes, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text`` without the post-processor's own specials; BOS/EOS only on request."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` as the model was trained to see it."""
        if not self.chat_template:
            raise SpecError("tokenizer.chat_template", None, "this tokenizer has no chat template",
                            "add chat_template to tokenizer_config.json (or chat_template.jinja), "
                            "or use the completions endpoint")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        specials = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **specials, **extra)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}

    def to_files(self) -> dict[str, bytes]:
        """``tokenizer.json`` and ``tokenizer_config.json`` as an HF folder holds them."""
        config = dict(self.config)
        if self.chat_template and "chat_template" not in config:
            config["chat_template"] = self.chat_template
        return {"tokenizer.json": self.tokenizer_json.encode(),
                "tokenizer_config.json": json.dumps(config, indent=2).encode()}

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], *, name: str = "hf") -> "HFTokenizer":
        """From an HF folder's files (name -> bytes); ``tokenizer.json`` is required."""
        if "tokenizer.json" not in files:
            raise SpecError("tokenizer", sorted(files), "has no tokenizer.json",
                            "use a folder saved by a fast (Rust) tokenizer: tokenizer.save_pretrained(DIR)")
        config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        template = files.get("chat_template.jinja")
        return cls(files["tokenizer.json"].decode(), config,
                   chat_template=template.decode() if template else None, name=name)


def _rebuild(tokenizer_json: str, config: dict[str, Any], chat_template: str | None, name: str) -> HFTokenizer:
    return HFTokenizer(tokenizer_json, config, chat_template=chat_template, name=name)


DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def train_byte_level_bpe(texts: Iterable[str], *, vocab_size: int = 512, bos_token: str = "<s>",
                         eos_token: str = "</s>", pad_token: str = "<pad>",
                         chat_template: str = DEFAULT_CHAT_TEMPLATE) -> HFTokenizer:
    """A byte-level BPE tokenizer trained on ``texts`` (GPT-2 style: every byte is encodable).

    Returns an ``HFTokenizer``; ``to_files()`` gives its ``tokenizer.json`` and
    ``tokenizer_config.json``, which ``transformers.AutoTokenizer`` loads.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [bos_token, eos_token, pad_token]
    if vocab_size < 256 + len(specials):
        raise SpecError("vocab_size", vocab_size, "a byte-level BPE needs the 256 bytes and the specials",
                        f"use vocab_size >= {256 + len(specials)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos_token, "eos_token": eos_token,
              "pad_token": pad_token, "model_max_length": 1 << 20, "chat_template": chat_template}
    return HFTokenizer(tok.to_str(), config, name="hf-bpe")
