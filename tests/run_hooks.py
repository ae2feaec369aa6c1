"""Train-loop hooks the multi-rank unit tests share (they pickle to the ranks, so they live in an
importable module on the tests' path, as ``live_helpers`` does)."""

from __future__ import annotations

from rayfleet.jobs.train_state import TrainHooks

__all__ = ["StopAfter", "PerRun"]


class StopAfter:
    """``should_stop`` that asks to stop after ``steps`` steps."""

    def __init__(self, steps: int) -> None:
        self.steps, self.calls = steps, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.steps


class PerRun(TrainHooks):
    """The ``index``-th run of ``run_local_many`` gets ``hooks[index]`` (``None``: no hook)."""

    def __init__(self, hooks: list[TrainHooks | None]) -> None:
        self.hooks, self.run = hooks, -1

    def _current(self) -> TrainHooks | None:
        return self.hooks[self.run] if 0 <= self.run < len(self.hooks) else None

    def on_start(self, **kwargs) -> None:
        self.run += 1
        if self._current():
            self._current().on_start(**kwargs)

    def before_step(self, step: int) -> None:
        if self._current():
            self._current().before_step(step)

    def after_step(self, step: int, **kwargs) -> None:
        if self._current():
            self._current().after_step(step, **kwargs)

    def on_end(self, summary, **kwargs) -> None:
        if self._current():
            self._current().on_end(summary, **kwargs)
