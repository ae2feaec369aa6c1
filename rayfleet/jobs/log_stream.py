"""A Ray job's log as a synchronous stream of chunks (Ray's ``tail_job_logs``, from plain code).

``JobSubmissionClient.tail_job_logs`` is an async generator over a websocket: the job API sends
the log from its start and then each chunk once, as the driver writes it, and closes the socket
when the job ends. The CLI, the SDK and ``TrainingRun.follow`` are synchronous, so this module
drives that generator on a private event loop, one chunk at a time. Polling ``get_job_logs``
instead would download the whole log again on every poll (what ``follow`` did before).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

__all__ = ["stream_job_logs", "complete_lines"]


def stream_job_logs(client: Any, job_id: str) -> Iterator[str]:
    """Chunks of ``job_id``'s log until the job ends (``client``: a ``JobSubmissionClient``).

    Raises ``RuntimeError`` (Ray's) when the job does not exist or the socket closes abnormally.
    """
    loop = asyncio.new_event_loop()
    chunks = client.tail_job_logs(job_id)
    try:
        while True:
            try:
                chunk = loop.run_until_complete(chunks.__anext__())
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        loop.run_until_complete(chunks.aclose())
        loop.close()


def complete_lines(chunks: Iterator[str]) -> Iterator[str]:
    """Whole lines out of ``chunks`` (a chunk may end inside a line); the last partial line is
    yielded when the stream ends."""
    pending = ""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split("\n")
        yield from lines
    if pending:
        yield pending
