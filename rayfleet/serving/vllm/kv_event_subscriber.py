"""A replica's subscription to its own vLLM engine's KV events (ZMQ SUB on a private ipc socket).

``RayfleetLLMServer`` gives its engine a ``kv_events_config`` whose endpoint is an ``ipc://``
socket in a directory only this user can enter (``private_ipc_endpoint``: ``mkdtemp``, mode
0700), and starts a ``KVEventSubscriber`` on it. vLLM's publisher binds it; the subscriber
connects. No TCP port is opened, so nothing on the network reaches the events (docs/security.md:
whoever runs code as the fleet's user is trusted anyway).

Design decisions:
- The thread receives, decodes (``kv_event_feed.decode_kv_event_batch``) and rehashes
  (``TokenBlockMapper``), and hands rayfleet events to the replica's event loop through a
  ``queue.SimpleQueue``; the loop drains it when it publishes routing stats
  (``drain``). Hashing stays off the request path and off the event loop; the mapper is
  owned by the thread alone (no locks).
- A gap in the publisher's sequence numbers (its high-water mark dropped messages, or the
  subscriber joined late) means stores or removals were missed: the thread then publishes
  ``AllBlocksCleared`` and starts over, so the replica never claims a block it evicted (the
  price: hits missed until the blocks are stored again). Messages before the first one seen
  are not a gap: the engine caches nothing before the subscriber connects (it connects before
  the engine starts; ZMQ's slow joiner can only lose the first batch of an empty cache).
- Rejected: vLLM's replay endpoint (a ROUTER socket for missed batches): a second socket for a
  case the clear-and-rebuild covers.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import shutil
import tempfile
import threading

from rayfleet.serving.engine.kv_events import AllBlocksCleared, KVEvent
from rayfleet.serving.vllm.kv_event_feed import TokenBlockMapper, decode_kv_event_batch

__all__ = ["KVEventSubscriber", "private_ipc_endpoint", "KV_EVENTS_TOPIC"]

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv"


def private_ipc_endpoint() -> str:
    """A fresh ``ipc://`` endpoint in a new directory only this user can enter (mode 0700),
    removed when this process exits."""
    directory = tempfile.mkdtemp(prefix="rayfleet-kv-")
    os.chmod(directory, 0o700)
    atexit.register(shutil.rmtree, directory, True)
    return f"ipc://{directory}/events.sock"


class KVEventSubscriber:
    """Receives one engine's KV events on ``endpoint`` in a daemon thread (module doc).

    ``drain()`` returns the rayfleet events received since the last call, in order.
    Counters (read from any thread): ``num_batches``, ``num_events`` (rayfleet events out),
    ``num_gaps`` (sequence gaps, each turned into a clear), ``num_errors`` (undecodable messages).
    """

    def __init__(self, endpoint: str, *, model_id: str, block_size: int, topic: str = KV_EVENTS_TOPIC) -> None:
        import zmq

        self.endpoint = endpoint
        self.mapper = TokenBlockMapper(model_id=model_id, block_size=block_size)
        self._out: queue.SimpleQueue[KVEvent] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop here: the publisher's gap check covers its side
        self._sub.connect(endpoint)  # ipc: connecting before the publisher binds is fine in ZMQ
        self._stop = threading.Event()
        self.num_batches = self.num_events = self.num_gaps = self.num_errors = 0
        self._last_seq: int | None = None
        self._thread = threading.Thread(target=self._run, name="rayfleet-kv-events", daemon=True)
        self._thread.start()

    def drain(self) -> list[KVEvent]:
        out: list[KVEvent] = []
        while True:
            try:
                out.append(self._out.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                frames = self._sub.recv_multipart()
                self._on_message(frames)
        finally:
            self._sub.close(linger=0)
            self._ctx.term()

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.num_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.num_gaps += 1
            logger.warning("KV events %s: sequence gap %d -> %d; clearing and rebuilding", self.endpoint,
                           self._last_seq, seq)
            self._emit(self.mapper.map([AllBlocksCleared()]))
        self._last_seq = seq
        try:
            batch = decode_kv_event_batch(frames[2])
        except ValueError:
            self.num_errors += 1
            logger.exception("KV events %s: undecodable batch %d", self.endpoint, seq)
            return
        self.num_batches += 1
        self._emit(self.mapper.map(batch.events))

    def _emit(self, events: list[KVEvent]) -> None:
        for event in events:
            self._out.put(event)
        self.num_events += len(events)
