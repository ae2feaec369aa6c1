"""How Serve's ways of reporting a dead replica map onto ``ReplicaUnavailableError`` (the one
error the ingress retries or resumes on). Only Ray's exception classes are used; no cluster."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.deploy.replica_client import ReplicaUnavailableError, ServeReplicaClient

ray_exceptions = pytest.importorskip("ray.exceptions")
serve_exceptions = pytest.importorskip("ray.serve.exceptions")


def _translate(exc: BaseException) -> BaseException:
    return ServeReplicaClient("prefill-0", handle=None)._translate(exc)


def _actor_died() -> BaseException:
    return ray_exceptions.ActorDiedError()


def test_serve_replica_unavailable_is_a_replica_failure():
    """Regression: Serve's own ``ReplicaUnavailableError`` (a chosen replica left the set before
    dispatch) was not recognised and reached the client as a 500."""
    out = _translate(serve_exceptions.ReplicaUnavailableError("replica-abc"))
    assert isinstance(out, ReplicaUnavailableError) and out.replica == "prefill-0"


def test_actor_death_chained_under_a_serve_exception_is_a_replica_failure():
    wrapped = serve_exceptions.RayServeException("upstream actor died")
    wrapped.__cause__ = _actor_died()
    assert isinstance(_translate(wrapped), ReplicaUnavailableError)
    assert isinstance(_translate(_actor_died()), ReplicaUnavailableError)


def test_user_errors_and_unrelated_failures_keep_their_types():
    plain = serve_exceptions.RayServeException("bad config")
    assert _translate(plain) is plain
    boom = KeyError("x")
    assert _translate(boom) is boom
    user = SpecError("max_tokens", 0, "must be positive", "ask for at least one token")
    assert _translate(user) is user
