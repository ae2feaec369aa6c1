"""One control actor per Ray Train ``fit``: rank 0's metrics rows to the driver, and the driver's
stop flag to every rank.

Design decisions:
- One actor, not two: a Ray actor is a process of its own (about 2 CPU s to start and import on
  a 2-core host), and every job paid for a metrics queue (``ray.util.queue.Queue``) and, when
  elastic, a stop-signal actor beside it. Both jobs are small and asynchronous, so one asyncio
  actor (``num_cpus=0``, on the driver's node) holds both.
- Rows: rank 0 ``put``s a step's row (a background thread, the step never waits); the driver's
  drain thread long-polls ``take``, which answers with every waiting row the moment one arrives
  (or an empty list after ``timeout_s``), not one row per call.
- The stop flag: the driver ``set``s it (end the formation: the fleet can hold a larger one, the
  autoscaler resized the job); each rank's flag thread long-polls ``wait_stop``, answered the
  moment the flag is raised. Polled twice a second instead, it cost 17 CPU s through one 8-minute
  lend on 2 cores, and the stop was seen up to 0.5 s late.
- ``set``, ``should_stop`` and ``put`` are plain methods (the elastic driver's
  unit tests call them in-process); the long polls are coroutines woken thread-safely.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["FormationControl", "LONG_POLL_S"]

LONG_POLL_S = 30.0  # how long one ``wait_stop`` call waits before answering "not yet"


class FormationControl:
    """A formation's metrics rows (rank 0 -> driver) and stop flag (driver -> every rank)."""

    def __init__(self) -> None:
        self.reason = ""
        self._rows: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's loop, set by the first long poll
        self._raised: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None

    def _bind(self) -> None:
        if self._loop is None:
            self._loop, self._raised, self._arrived = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()
            if self.reason:
                self._raised.set()
            if self._rows:
                self._arrived.set()

    def _wake(self, event: asyncio.Event | None) -> None:
        if event is not None:  # from whichever thread runs the call
            self._loop.call_soon_threadsafe(event.set)

    # -- the stop flag --------------------------------------------------------------------------
    def set(self, reason: str) -> None:
        self.reason = reason or "stop"
        self._wake(self._raised)

    def should_stop(self) -> bool:
        return bool(self.reason)

    async def wait_stop(self, timeout_s: float = LONG_POLL_S) -> bool:
        """Whether the flag is raised, answered when it is raised or after ``timeout_s``."""
        self._bind()
        if not self.reason:
            try:
                await asyncio.wait_for(self._raised.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
        return True

    # -- rank 0's rows ----------------------------------------------------------------------------
    def put(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        self._wake(self._arrived)

    async def take(self, timeout_s: float = 0.5) -> list[dict[str, Any]]:
        """Every row waiting, in order; waits up to ``timeout_s`` for the first (then ``[]``)."""
        self._bind()
        if not self._rows:
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        rows, self._rows = self._rows, []
        self._arrived.clear()
        return rows
