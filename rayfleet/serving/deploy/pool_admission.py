"""The deploy's side of queue admission: ask for every pool, cap Serve at what was granted, release.

``deployer.deploy`` calls :func:`admit_pools` before it sets a single Serve bound. The fleet
controller decides (``platform/admission_book.py``'s ``request_pool`` around the same
``admission_step`` -> ``queues.admit`` that admits training jobs; the rules for pools are in
``platform/serve_admission.py``); this module only carries the app's side, as
``jobs/admission_gate.py`` does for a training driver:

- each pool that asks for accelerators sends its request (``PoolQueueFields.admission_request``);
  a pool outside the queues (``default``, undeclared) is ``direct`` and keeps its spec's bounds;
- a refused pool (unknown queue, or its minimum does not fit its queue now) fails the deploy
  with the controller's message (field, value, why, fix) before anything is deployed, and the
  pools already admitted for it are released;
- an admitted pool's grant caps Serve's own autoscaling (``PoolGrant.replicas``); a pool whose
  admission reclaims borrowed accelerators waits until the jobs reclaimed from let go, up to the
  deploy's deadline;
- on a plain Ray cluster without a controller nothing is enforced (a warning names the queue).

``call(method, *args)`` is the controller's method, called and waited for: the deployer passes
:func:`controller_call`'s Ray-backed one, tests an in-process controller's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rayfleet.errors import RayfleetError
from rayfleet.platform.admission import DEFAULT_QUEUE

__all__ = ["PoolGrant", "PoolRefusedError", "admit_pools", "release_pools", "report_started", "serve_bounds",
           "controller_call"]

log = logging.getLogger(__name__)
Call = Callable[..., Any]
CALL_TIMEOUT_S = 30.0


class PoolRefusedError(RayfleetError):
    """The fleet controller refused a pool's queue admission (message: field, value, why, fix)."""


@dataclass(frozen=True)
class PoolGrant:
    """What a pool may hold: ``replicas`` (whole replicas, gangs for a DP pool) of its spec's
    ``accelerators_per_replica``. ``job_id``: its admission record (None: outside the queues)."""

    role: str
    replicas: int
    accelerators_per_replica: int
    job_id: str | None = None
    reason: str = "outside the queues"


def admit_pools(app: str, pools: Mapping[str, Any], call: Call, *, deadline: float,
                poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> dict[str, PoolGrant]:
    """Admit every pool of app ``app`` (``ServeSpec.pools()``) through its queue (see module doc).

    Raises:
        SpecError: a pool names a queue but no accelerator type (before anything is asked).
        PoolRefusedError: a pool's queue refused it, or a reclaim it waits for did not finish
            before ``deadline`` (``clock``'s time); nothing stays admitted for the app then.
    """
    requests = {role: pool.admission_request(app=app, role=role) for role, pool in pools.items()}
    grants: dict[str, PoolGrant] = {}
    try:
        for role, request in requests.items():
            pool = pools[role]
            if request is None:
                grants[role] = PoolGrant(role, pool.max_replicas or pool.replicas, pool.accelerators_per_replica)
                continue
            answer = call("admit_serve_pool", request.to_json())
            if answer["outcome"] == "refused":
                raise PoolRefusedError(f"serve {app!r}: {answer['error'][2]}")
            if answer["outcome"] == "direct":
                grants[role] = PoolGrant(role, pool.max_replicas or pool.replicas, pool.accelerators_per_replica)
                continue
            grants[role] = PoolGrant(role, 0, request.replica_size, job_id=request.job_id,
                                     reason="waiting for the jobs it reclaims from")  # released if it fails
            record = _wait_ready(call, request.job_id, deadline=deadline, poll_s=poll_s, clock=clock, sleep=sleep)
            grants[role] = PoolGrant(role, int(record["size"]) // request.replica_size, request.replica_size,
                                     job_id=request.job_id, reason=record["reason"])
            log.info("serve %r: pool %s admitted in queue %s at %d replica(s): %s", app, role, request.queue,
                     grants[role].replicas, record["reason"])
    except BaseException:
        release_pools(grants.values(), call, "the deploy did not go ahead")
        raise
    return grants


def _wait_ready(call: Call, job_id: str, *, deadline: float, poll_s: float, clock, sleep) -> dict:
    """The pool's record once every job it reclaimed from has let go."""
    while True:
        status = call("admission_status", job_id)
        if status is not None and status["ready"]:
            return status["record"]
        if clock() >= deadline:
            waiting = ", ".join((status or {}).get("record", {}).get("waiting_for", [])) or "?"
            raise PoolRefusedError(f"{job_id}: admitted, but the jobs it reclaims from ({waiting}) did not let go "
                                   "before the deploy's timeout. Fix: deploy again with a longer timeout_s")
        sleep(poll_s)


def serve_bounds(pool: Any, grant: PoolGrant | None) -> tuple[int, int]:
    """Serve replicas (DP ranks) the pool's deployment may autoscale within: its spec's bounds,
    the top capped at what its queue granted (never below the floor, which admission covered).

    >>> from types import SimpleNamespace as Pool
    >>> pool = Pool(serve_replica_bounds=lambda: (2, 8), data_parallel_size=2)
    >>> serve_bounds(pool, PoolGrant("decode", replicas=3, accelerators_per_replica=8, job_id="serve:a/decode"))
    (2, 6)
    """
    lo, hi = pool.serve_replica_bounds()
    if grant is None:
        return lo, hi
    return lo, max(lo, min(hi, grant.replicas * pool.data_parallel_size))


def report_started(grants: Mapping[str, PoolGrant], pools: Mapping[str, Any], call: Call) -> None:
    """The app serves: each admitted pool holds its spec's ``replicas`` (Serve starts there; the
    Serve shell reports from then on)."""
    for role, grant in grants.items():
        if grant.job_id is not None:
            call("admission_heartbeat", grant.job_id, pools[role].replicas * grant.accelerators_per_replica)


def release_pools(grants, call: Call | None, why: str) -> None:
    """Give back what the pools were admitted at (the app was deleted or did not come up)."""
    for grant in grants:
        if grant.job_id is not None and call is not None:
            try:
                call("release_admission", grant.job_id, why)
            except Exception as exc:  # noqa: BLE001 - the operator can release it: `rayfleet job stop`
                log.warning("could not release %s: %r", grant.job_id, exc)


def controller_call(pools: Mapping[str, Any] | None = None) -> Call | None:
    """The fleet controller's methods as ``call(method, *args)``, or ``None`` on a plain Ray
    cluster (then a pool's named queue is not enforced: a warning says so)."""
    import ray

    try:
        from rayfleet.platform.controller import get_controller

        controller = get_controller()
        ray.get(controller.ping.remote(), timeout=CALL_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - no controller on this cluster
        named = sorted({p.queue for p in (pools or {}).values() if p.queue != DEFAULT_QUEUE})
        if named:
            log.warning("no fleet controller on this cluster: queue(s) %s not enforced for this app", ", ".join(named))
        return None

    def call(method: str, *args: Any) -> Any:
        return ray.get(getattr(controller, method).remote(*args), timeout=CALL_TIMEOUT_S)

    return call
