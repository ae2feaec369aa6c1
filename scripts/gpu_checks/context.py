"""What every GPU check module gets: the device, a recorder of named results, and a timer.

A check module exposes ``run(ctx: Context) -> None`` and calls ``ctx.record`` once per named
check: ``ok=True/False`` for a pass/fail judgement, ``ok=None`` for a measurement that judges
nothing (a speed, a bandwidth). Figures are keyword arguments (numbers, strings, short lists):
they land unrounded in the JSON and rounded in the summary. ``ctx.skip`` records a check that
cannot run here (CUDA-only on ``--device cpu``) with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["CheckResult", "Context"]


@dataclass
class CheckResult:
    group: str
    name: str
    status: str  # "pass", "fail", "info" (a measurement), "skip"
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Context:
    """One run's device and results. ``quick`` shrinks shapes and step counts (the CPU mode)."""

    def __init__(self, device: str, *, quick: bool = False, deadline_s: float | None = None) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.quick = quick
        self.results: list[CheckResult] = []
        self.group = ""
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s

    # ---- recording ---------------------------------------------------------------------------
    def record(self, name: str, ok: bool | None, detail: str = "", **figures: Any) -> bool:
        status = "info" if ok is None else ("pass" if ok else "fail")
        self.results.append(CheckResult(self.group, name, status, detail, _plain(figures)))
        print(f"  [{status:4}] {self.group}/{name}" + (f": {detail}" if detail else ""), flush=True)
        return bool(ok) if ok is not None else True

    def skip(self, name: str, why: str) -> None:
        self.results.append(CheckResult(self.group, name, "skip", why))
        print(f"  [skip] {self.group}/{name}: {why}", flush=True)

    def needs_cuda(self, name: str) -> bool:
        """True when the check can run; else records a skip (CPU mode) and returns False."""
        if self.on_cuda:
            return True
        self.skip(name, "needs CUDA (this run is --device cpu)")
        return False

    def time_left_s(self) -> float:
        return float("inf") if self._deadline is None else self._deadline - time.monotonic()

    # ---- timing ------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def seconds_per_call(self, fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10) -> float:
        """Median seconds of one ``fn()`` (CUDA events on a GPU, the wall clock on CPU)."""
        if self.quick:
            warmup, iters = 1, 2
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            if self.on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]


def _plain(value: Any) -> Any:
    """Figures as JSON values: tensors and numpy scalars become Python numbers or lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
