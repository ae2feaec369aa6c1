"""Token ids to client text for one choice: stop strings excluded, UTF-8 kept whole, logprobs
aligned with the text that is actually sent.

Design decisions:
- The served tokenizer is the byte tokenizer: an id below 256 is one byte, the specials are
  none. So holding back text is holding back tokens, and what a client receives (text, token
  ids, logprobs) always describes the same tokens.
- OpenAI excludes the matched stop string from the text. While streaming, the last
  ``len(longest stop) - 1`` bytes are held back (they may begin a stop string); when a stop
  string appears, everything from its first byte on is dropped and the choice is done, even
  if the engine had not seen it (a stop string straddling a resumption point).
- Text is decoded incrementally (``errors="replace"``), so a character split over tokens is
  sent whole in one chunk.
- Any other tokenizer (Hugging Face BPE, SentencePiece) goes through ``DecodedTextStream``: a
  token's text depends on its neighbours (byte-level merges, leading-space rules), so new text is
  decoded with the previous delta's tokens as context (the window vLLM's incremental detokenizer
  uses): ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``, advanced only when it does
  not end in U+FFFD (a character still split over tokens). The cost per delta is the window, not
  the whole output (decoding all of it each token was quadratic: 1.7 s of event-loop time for a
  2,000-token output with a stop string). Text is sent up to a token boundary, leaving
  ``len(longest stop) - 1`` characters held back.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rayfleet.serving.engine.sampling import TokenLogprobs

__all__ = ["Released", "ChoiceTextStream", "DecodedTextStream", "token_text"]

_SPECIAL_NAMES = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}


def token_text(token_id: int) -> str:
    """A readable string for one byte-tokenizer id (logprobs' ``token``): the character when the
    byte is one on its own, else OpenAI's ``bytes:\\xNN`` form."""
    if token_id < 128:
        return chr(token_id)
    if token_id < 256:
        return f"bytes:\\x{token_id:02x}"
    return _SPECIAL_NAMES.get(token_id, f"<|{token_id}|>")


@dataclass
class Released:
    """What may be sent now: text and the tokens (with their logprobs) it came from."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def _nbytes(token_id: int) -> int:
    return 1 if token_id < 256 else 0


class ChoiceTextStream:
    """Feed token deltas; get what may be sent. ``stop_hit`` names the stop string once found."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stops = [s.encode("utf-8") for s in stop]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending: list[tuple[int, TokenLogprobs | None]] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop_hit: str | None = None
        self.text = ""  # everything released so far

    @property
    def done(self) -> bool:
        return self.stop_hit is not None

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] = ()) -> Released:
        if self.done:
            return Released()
        lps: list[TokenLogprobs | None] = list(logprobs) + [None] * (len(token_ids) - len(logprobs))
        self._pending.extend(zip(token_ids, lps))
        data = bytes(t for t, _ in self._pending if t < 256)
        found = [(data.find(s), i) for i, s in enumerate(self._stops) if s in data]
        if found:
            at, which = min(found)
            self.stop_hit = self._stops[which].decode("utf-8")
            return self._release(self._count_tokens_within(at), final=True)
        keep_bytes = self._hold
        n = len(self._pending)
        held = 0
        while n > 0 and held + _nbytes(self._pending[n - 1][0]) <= keep_bytes and keep_bytes:
            held += _nbytes(self._pending[n - 1][0])
            n -= 1
        return self._release(n, final=False)

    def finish(self) -> Released:
        """Everything still held (the request ended without a stop string in it)."""
        if self.done:
            return Released()
        return self._release(len(self._pending), final=True)

    def _count_tokens_within(self, num_bytes: int) -> int:
        """How many pending tokens lie entirely in the first ``num_bytes`` bytes."""
        total = 0
        for i, (t, _) in enumerate(self._pending):
            if total + _nbytes(t) > num_bytes or (total == num_bytes and _nbytes(t)):
                return i
            total += _nbytes(t)
        return len(self._pending)

    def _release(self, n: int, *, final: bool) -> Released:
        out, self._pending = self._pending[:n], self._pending[n:]
        ids = [t for t, _ in out]
        text = self._decoder.decode(bytes(t for t in ids if t < 256), final=final)
        self.text += text
        return Released(text, ids, [lp for _, lp in out])


class DecodedTextStream:
    """``ChoiceTextStream``'s interface for a tokenizer whose tokens are not bytes (module doc).

    ``decode(ids) -> str`` is the served tokenizer's (specials skipped). A stop string ends the
    text at its first character; the tokens sent are those whose text lies before it.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = list(stop)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._lps: list[TokenLogprobs | None] = []
        self._num_sent = 0  # tokens released
        self._full = ""  # decoded text of ids[:read] (never ends in a split character)
        self._prefix = self._read = 0  # the decoding window: context ids[prefix:read], new ids[read:]
        self._bounds: list[tuple[int, int]] = []  # (token count, len(_full)) at each clean advance
        self.stop_hit: str | None = None
        self.text = ""  # everything released so far

    @property
    def done(self) -> bool:
        return self.stop_hit is not None

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] = ()) -> Released:
        if self.done:
            return Released()
        self._ids += [int(t) for t in token_ids]
        self._lps += list(logprobs) + [None] * (len(token_ids) - len(logprobs))
        if not self._advance():
            return Released()
        full = self._full
        searched = max(0, len(self.text) - self._hold)  # earlier text was checked for stops already
        found = [(at, i) for i, s in enumerate(self._stops) if (at := full.find(s, searched)) >= 0]
        if found:
            at, which = min(found)
            self.stop_hit = self._stops[which]
            return self._release(self._tokens_within(at), full[:at])
        n = self._tokens_within(len(full) - self._hold)
        return self._release(n, full[:self._text_len(n)]) if n > self._num_sent else Released()

    def finish(self) -> Released:
        """Everything still held (the request ended without a stop string in it)."""
        if self.done:
            return Released()
        return self._release(len(self._ids), self._full + self._pending_text())

    def _pending_text(self) -> str:
        """Text of ids[read:] in context (may end in U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._decode(self._ids[self._prefix:])[len(self._decode(self._ids[self._prefix:self._read])):]

    def _advance(self) -> bool:
        """Decode the new tokens in their window; False while they end in a split character."""
        new = self._pending_text()
        if not new and self._read == len(self._ids) or new.endswith("\ufffd"):
            return False
        self._full += new
        self._prefix, self._read = self._read, len(self._ids)
        self._bounds.append((self._read, len(self._full)))
        return True

    def _tokens_within(self, num_chars: int) -> int:
        """The most tokens (at a clean boundary) whose text fits in ``num_chars`` (at least those sent)."""
        best = self._num_sent
        for count, length in reversed(self._bounds):
            if length <= num_chars:
                best = max(best, count)
                break
        return best

    def _text_len(self, count: int) -> int:
        return next(length for c, length in reversed(self._bounds) if c == count)

    def _release(self, n: int, text: str) -> Released:
        new = text[len(self.text):] if text.startswith(self.text) else ""
        self.text += new
        ids, lps = self._ids[self._num_sent:n], self._lps[self._num_sent:n]
        self._num_sent = max(n, self._num_sent)
        return Released(new, ids, lps)
