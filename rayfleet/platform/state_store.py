"""Persisted controller state: a small key/value + event log on SQLite.

Design decisions:
- SQLite (standard library, one file, atomic transactions) rather than a Ray object or a GCS KV
  entry: the controller must come back with its inventory after the actor — or the whole Ray
  cluster — restarts, and the file can be copied, inspected with ``sqlite3`` and backed up.
- Values are JSON so the schema can grow without migrations; keys are namespaced strings
  (``node/<name>``, ``queue/<name>``, ...).
- Every write is its own transaction: a crash never leaves half an update behind.
- The event log is bounded (``max_events``, oldest dropped on append): a long-lived controller
  recording every autoscaler decision must not grow its file and its queries without end.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["StateStore", "Event"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL, cause TEXT NOT NULL,
    detail TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class Event:
    """Something that happened to a node or job, with its cause (shown by ``rayfleet status``)."""

    ts: float
    kind: str
    subject: str
    cause: str
    detail: dict


class StateStore:
    """Thread-safe JSON key/value store and append-only event log in one SQLite file."""

    def __init__(self, path: str | Path, *, max_events: int = 20_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events={max_events} must be >= 1")
        self.max_events = max_events
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, key: str, value: Any) -> None:
        text = json.dumps(value, sort_keys=True)
        with self._lock:
            self._db.execute("INSERT INTO kv(key, value) VALUES(?, ?) "
                             "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, text))

    def delete(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM kv WHERE key = ?", (key,))

    def items(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                                    (prefix, prefix + "\uffff")).fetchall()
        for key, value in rows:
            yield key, json.loads(value)

    def append_event(self, event: Event) -> None:
        with self._lock:
            cursor = self._db.execute("INSERT INTO events(ts, kind, subject, cause, detail) VALUES(?,?,?,?,?)",
                                      (event.ts, event.kind, event.subject, event.cause, json.dumps(event.detail)))
            # ids are increasing (AUTOINCREMENT): keep the newest max_events by id.
            self._db.execute("DELETE FROM events WHERE id <= ?", (cursor.lastrowid - self.max_events,))

    def events(self, *, limit: int = 50, subject: str | None = None) -> list[Event]:
        """Newest ``limit`` events, oldest first."""
        query = "SELECT ts, kind, subject, cause, detail FROM events"
        params: tuple = ()
        if subject is not None:
            query += " WHERE subject = ?"
            params = (subject,)
        query += " ORDER BY id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, params + (limit,)).fetchall()
        return [Event(ts, kind, subj, cause, json.loads(detail)) for ts, kind, subj, cause, detail in reversed(rows)]

    def close(self) -> None:
        with self._lock:
            self._db.close()
