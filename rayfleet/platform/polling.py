"""Sleeps for poll loops that wait on Ray for something with no event to await.

Design decisions:
- A Serve replica's start, a training job's re-formation and an app's first health answer take
  from a second to minutes, and Ray 2.60 pushes none of them to a client: they are polled. A fixed
  0.25 s poll of ``serve.status()`` or of every node's free resources kept the Serve shell at
  25-45% of a core (and the Serve controller and dashboard busy answering it) through a vLLM
  engine's 3-5 minute start on 2 cores, the cores the start itself needed.
- So the wait starts fast and slows down: ``first_s``, growing by ``factor`` up to ``max_s``. An
  event a second away is still seen within ``first_s``; a slow one costs ``1 / max_s`` calls a
  second and is seen at most ``max_s`` late.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["poll_delays"]


def poll_delays(first_s: float = 0.25, max_s: float = 2.0, factor: float = 1.5) -> Iterator[float]:
    """Endless sleeps: ``first_s``, ``first_s * factor``, ... capped at ``max_s``."""
    if not 0 < first_s <= max_s or factor < 1:
        raise ValueError(f"poll_delays(first_s={first_s}, max_s={max_s}, factor={factor}): "
                         "need 0 < first_s <= max_s and factor >= 1")
    delay = first_s
    while True:
        yield delay
        delay = min(max_s, delay * factor)
