"""Checkpoint manifests: what makes a step directory a *committed* checkpoint.

Design decisions:
- A step directory is committed exactly when its ``manifest.json`` exists, parses, and every
  file it lists is present with the listed size. The manifest is written last (to a temporary
  name, then moved into place), so a writer killed at any earlier point leaves a directory that
  readers skip. Sizes are checked on every listing (one ``info`` per file, no data read); the
  CRC-32 of each file is checked by :func:`verify_checkpoint` (it reads everything).
- CRC-32 (zlib), not SHA-256: the manifest guards against torn and corrupted writes, not an
  adversary, and zlib's CRC runs ≈ 3× faster than SHA-256 here (0.28 vs 0.73 s/GiB), which
  matters because the persister hashes every byte it writes.
- Writers hash while they write (:class:`HashingStream`) instead of reading their files back,
  so a persist to remote storage does not download what it just uploaded.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from dataclasses import dataclass, field

import fsspec

__all__ = [
    "FORMAT", "MANIFEST", "FileDigest", "HashingStream", "Manifest", "VerifyResult",
    "crc32_of_file", "digest_of_bytes", "read_manifest", "write_manifest", "check_sizes", "verify_step_dir",
]

FORMAT = "rayfleet-checkpoint/1"
MANIFEST = "manifest.json"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileDigest:
    """Size and CRC-32 of one file of a checkpoint."""

    num_bytes: int
    crc32: int


class HashingStream:
    """Wraps a writable stream; keeps a running CRC-32 and byte count of what passes through.

    On close it reports ``(name, FileDigest)`` to ``on_close``. ``tell``/``fileno``/``flush``
    are forwarded because DCP records offsets and fsyncs through them.
    """

    def __init__(self, raw, name: str, on_close) -> None:
        self._raw = raw
        self.closed = False
        self._name = name
        self._on_close = on_close
        self._crc = 0
        self._num_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        self._num_bytes += view.nbytes
        self._raw.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._raw.close()
            self._on_close(self._name, FileDigest(self._num_bytes, self._crc))


class DigestLog:
    """Thread-safe record of the digests of files written by one rank (DCP may use threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.name_to_digest: dict[str, FileDigest] = {}

    def add(self, name: str, digest: FileDigest) -> None:
        with self._lock:
            self.name_to_digest[name] = digest


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    files: dict[str, FileDigest]
    metadata: dict = field(default_factory=dict)
    created_unix_s: float = 0.0

    @property
    def num_bytes(self) -> int:
        return sum(d.num_bytes for d in self.files.values())

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "step": self.step, "world_size": self.world_size,
            "created_unix_s": self.created_unix_s, "checksum": "crc32",
            "files": {n: {"bytes": d.num_bytes, "crc32": d.crc32} for n, d in sorted(self.files.items())},
            "metadata": self.metadata,
        }, indent=1, sort_keys=True)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of checking a step directory. ``ok`` is False when any problem was found."""

    path: str
    ok: bool
    step: int | None
    problems: tuple[str, ...]


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def crc32_of_file(fs: fsspec.AbstractFileSystem, path: str) -> FileDigest:
    crc, num_bytes = 0, 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            num_bytes += len(chunk)
    return FileDigest(num_bytes, crc)


def digest_of_bytes(data: bytes) -> FileDigest:
    return FileDigest(len(data), zlib.crc32(data))


def write_manifest(fs: fsspec.AbstractFileSystem, step_path: str, manifest: Manifest) -> None:
    """Commit point: the manifest goes to a temporary name, then is moved into place."""
    tmp = _join(step_path, MANIFEST + ".tmp")
    with fs.open(tmp, "wb") as f:
        f.write(manifest.to_json().encode())
    fs.mv(tmp, _join(step_path, MANIFEST))


def read_manifest(fs: fsspec.AbstractFileSystem, step_path: str) -> Manifest | None:
    """The manifest of ``step_path``, or None when absent or unreadable (an uncommitted step)."""
    path = _join(step_path, MANIFEST)
    try:
        with fs.open(path, "rb") as f:
            raw = json.loads(f.read())
    except (FileNotFoundError, ValueError, OSError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None
    try:
        files = {n: FileDigest(int(d["bytes"]), int(d["crc32"])) for n, d in raw["files"].items()}
        return Manifest(step=int(raw["step"]), world_size=int(raw["world_size"]), files=files,
                        metadata=dict(raw.get("metadata") or {}),
                        created_unix_s=float(raw.get("created_unix_s", 0.0)))
    except (KeyError, TypeError, ValueError):
        return None


def check_sizes(fs: fsspec.AbstractFileSystem, step_path: str, manifest: Manifest) -> list[str]:
    """Cheap check (metadata only): every listed file exists with its listed size."""
    problems = []
    for name, digest in manifest.files.items():
        try:
            size = fs.info(_join(step_path, name))["size"]
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != digest.num_bytes:
            problems.append(f"{name} has {size} bytes, manifest says {digest.num_bytes}")
    return problems


def verify_step_dir(fs: fsspec.AbstractFileSystem, step_path: str, *, expect_step: int | None = None,
                    checksums: bool = True) -> VerifyResult:
    """Check a step directory: manifest present, files present with sizes and (optionally) CRCs."""
    manifest = read_manifest(fs, step_path)
    if manifest is None:
        return VerifyResult(step_path, False, None, (f"no valid {MANIFEST} (not committed)",))
    problems = check_sizes(fs, step_path, manifest)
    if expect_step is not None and manifest.step != expect_step:
        problems.append(f"manifest step {manifest.step} != directory step {expect_step}")
    if checksums and not problems:
        for name, digest in manifest.files.items():
            if crc32_of_file(fs, _join(step_path, name)).crc32 != digest.crc32:
                problems.append(f"{name} does not match its manifest CRC-32")
    return VerifyResult(step_path, not problems, manifest.step, tuple(problems))


def now_unix_s() -> float:
    # Manifests carry a wall-clock stamp for humans; nothing decides on it.
    return time.time()
