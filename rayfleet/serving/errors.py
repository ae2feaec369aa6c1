"""Serving errors shared by the rooms (engine replicas, routing, deploy).

Kept apart so that ``routing`` (which coordinates split prefills over replicas) and ``deploy``
(which owns the replica clients) both raise the same type without importing each other.
"""

from __future__ import annotations

from rayfleet.errors import RayfleetError

__all__ = ["ReplicaUnavailableError"]


class ReplicaUnavailableError(RayfleetError):
    """An engine replica died or is unreachable; the request may be retried elsewhere."""

    def __init__(self, replica: str, why: str) -> None:
        super().__init__(f"engine replica {replica} is unavailable: {why}")
        self.replica = replica

    def __reduce__(self):
        # Rebuilt from the final message so that the text survives crossing a Ray process.
        return (_rebuild_unavailable, (self.replica, str(self)))


def _rebuild_unavailable(replica: str, message: str) -> ReplicaUnavailableError:
    err = ReplicaUnavailableError.__new__(ReplicaUnavailableError)
    RayfleetError.__init__(err, message)
    err.replica = replica
    return err
