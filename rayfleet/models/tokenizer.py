"""Byte-level tokenizer: 256 byte ids plus a few special tokens; nothing to download.

Design decisions:
- Bytes, not characters: every UTF-8 text round-trips exactly, and any file (source code,
  logs) is encodable offline. The cost is ~4x longer sequences than a BPE tokenizer, which is
  fine for the tiny models that train on CPU.
- Special ids sit right after the bytes (BOS=256, EOS=257, PAD=258), so the vocabulary is
  small and contiguous; models may pad their embedding table beyond ``vocab_size``.
- ``to_dict`` describes the tokenizer for dataset manifests so that a reader can check it
  tokenizes the same way the writer did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ByteTokenizer"]


@dataclass(frozen=True)
class ByteTokenizer:
    """Maps UTF-8 bytes to ids 0..255; ``bos_id``, ``eos_id``, ``pad_id`` follow."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    name: str = "byte"

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.bos_id, self.eos_id, self.pad_id))

    def encode(self, text: str | bytes, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = list(data)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in (int(t) for t in ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}
