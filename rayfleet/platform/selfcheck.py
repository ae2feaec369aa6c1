"""Deterministic GEMM self-check: how a node agent catches silent data corruption.

Design decision: the check multiplies small *integer-valued* float32 matrices whose every partial
sum is an integer below 2**24, so the product is exact in float32 whatever the summation order,
thread count, BLAS library or accelerator. The expected checksum is therefore computable anywhere
(here in int64) and identical on every healthy node; a node whose result differs is corrupting
data, not merely rounding differently. A second, random-float pass checks run-to-run determinism
on the same node (same inputs twice must give bit-identical results).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch loads when a check runs: importing this module (the controller's and a
    import torch   # job driver's import of the agent's names) costs no torch import

__all__ = ["SelfCheckResult", "run_gemm_self_check", "expected_checksum", "flip_one_bit"]

# |a|,|b| <= 8 and K = 256 keep every partial sum below 8*8*256 = 16,384 << 2**24.
_VALUE_RANGE = 8
_SHAPE = (256, 256, 256)  # M, K, N


@dataclass(frozen=True)
class SelfCheckResult:
    """Outcome of one self-check.

    Attributes:
        ok: True when both the exact and the repeatability check passed.
        checksum: sha256 of the exact GEMM's result bytes on this node.
        expected: the checksum every healthy node must produce.
        repeatable: the random-float GEMM gave bit-identical results twice.
        device: where it ran ("cpu", "cuda:0", ...).
        seconds: wall time of the check (reported, not used for decisions).
    """

    ok: bool
    checksum: str
    expected: str
    repeatable: bool
    device: str
    seconds: float


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    m, k, n = _SHAPE
    a = torch.randint(-_VALUE_RANGE, _VALUE_RANGE + 1, (m, k), generator=gen, dtype=torch.int64)
    b = torch.randint(-_VALUE_RANGE, _VALUE_RANGE + 1, (k, n), generator=gen, dtype=torch.int64)
    return a, b


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


def expected_checksum(seed: int = 0) -> str:
    """Checksum of the exact product computed in int64 (the ground truth), as float32 bytes."""
    import torch

    a, b = _inputs(seed)
    return _digest((a @ b).to(torch.float32))


def run_gemm_self_check(
    *,
    seed: int = 0,
    device: str = "cpu",
    corrupt: Callable[[torch.Tensor], torch.Tensor] | None = None,
    clock: Callable[[], float] | None = None,
) -> SelfCheckResult:
    """Run the check on ``device``.

    ``corrupt`` lets tests (and the fault-injection API of the node agent) flip bits in the
    result, standing in for a faulty accelerator. ``clock`` is injected so the function stays
    free of wall-clock reads when a caller wants it pure.
    """
    import torch

    start = clock() if clock else 0.0
    a, b = _inputs(seed)
    if device.startswith("cuda"):
        # TF32 would round the operands and break exactness; the check wants plain FP32.
        torch.backends.cuda.matmul.allow_tf32 = False
    result = a.to(device=device, dtype=torch.float32) @ b.to(device=device, dtype=torch.float32)
    if corrupt is not None:
        result = corrupt(result)
    checksum = _digest(result)
    expected = expected_checksum(seed)

    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(128, 512, generator=gen).to(device)
    y = torch.randn(512, 128, generator=gen).to(device)
    first, second = x @ y, x @ y
    if corrupt is not None:
        second = corrupt(second)
    repeatable = bool(torch.equal(first, second))
    seconds = (clock() - start) if clock else 0.0
    return SelfCheckResult(
        ok=(checksum == expected and repeatable), checksum=checksum, expected=expected,
        repeatable=repeatable, device=device, seconds=seconds,
    )


def flip_one_bit(t: torch.Tensor) -> torch.Tensor:
    """A corruption that a real faulty ALU produces: one flipped mantissa bit in one element."""
    import torch

    out = t.clone().contiguous()
    flat = out.view(-1).view(torch.int32)
    flat[len(flat) // 2] ^= 1 << 3
    return out
