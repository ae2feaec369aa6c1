"""Serving errors shared by the rooms (engine replicas, routing, deploy, the OpenAI app).

Kept apart, below every room, so that a room raises a type that a higher room maps (the OpenAI
app turns each into an HTTP status) without either importing the other: ``routing`` (which
coordinates split prefills over replicas) and ``deploy`` (which owns the replica clients and the
request path) raise them, ``openai_api`` reads them.
"""

from __future__ import annotations

from rayfleet.errors import RayfleetError

__all__ = ["ReplicaUnavailableError", "RequestFailedError", "ReplicaOverloadedError", "ServiceUnavailableError"]


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


class RequestFailedError(RayfleetError):
    """The engine failed this one request (logged on the replica with its id and traceback);
    the replica goes on serving. Not retried: the same request would fail again."""

    def __init__(self, request_id: str, replica: str) -> None:
        super().__init__(f"request {request_id} failed inside engine replica {replica} "
                         "(the replica's log has the details under this request id)")
        self.request_id, self.replica = request_id, replica

    def __reduce__(self):  # crosses Ray processes
        return (RequestFailedError, (self.request_id, self.replica))


class ReplicaOverloadedError(RayfleetError):
    """Too many requests queued (on a replica or the whole app): retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Ray processes
        return (ReplicaOverloadedError, (str(self), self.retry_after_s))


class ServiceUnavailableError(RayfleetError):
    """No replica could serve (or finish) the request after the allowed retries (HTTP 503)."""
