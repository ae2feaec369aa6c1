"""The deploy's side of queue admission: ask for every pool, cap Serve at what was granted, release.

Every way a serve spec is deployed goes through :func:`admit_app`, one sequence: ``deployer.deploy``
(``rayfleet serve``, ``fleet.serve(spec)``) calls it before Serve starts; Serve's own deploy of the
config ``rayfleet serve --serve-config`` prints (``serve deploy``/``serve run``) imports the
engines' ``app_builder``, which calls it through :func:`build_admitted` inside the cluster before
the app is built. :func:`admit_app` asks for every pool (:func:`admit_pools`) before it writes a
single Serve bound. The fleet
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

``call(method, *args)`` is the controller's method, called and waited for: :func:`controller_call`'s
Ray-backed one (looked up when :func:`admit_app` runs), tests an in-process controller's.

Under ``serve deploy`` nothing waits for the app to serve, so :func:`build_admitted` counts the
pools as started once built (``report_started``); the controller releases the grant when Serve no
longer runs the app (``serve delete``: the controller's ended check). A refused pool raises in the
builder: Serve marks the app ``DEPLOY_FAILED`` with the controller's message (``serve status``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from rayfleet.errors import RayfleetError
from rayfleet.platform.admission import DEFAULT_QUEUE
from rayfleet.serving.deploy import pool_scaling

__all__ = ["PoolGrant", "PoolRefusedError", "AppAdmission", "admit_app", "build_admitted", "admit_pools",
           "release_pools", "report_started", "serve_bounds", "controller_call", "ray_connected"]

log = logging.getLogger(__name__)
Call = Callable[..., Any]
App = TypeVar("App")
CALL_TIMEOUT_S = 30.0
BUILD_ADMISSION_TIMEOUT_S = 300.0  # `serve deploy` has no --timeout: a reclaim the builder waits for


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


@dataclass(frozen=True)
class AppAdmission:
    """What app ``app``'s pools were admitted at (``grants``, by role) and the controller that
    admitted them (``call``; ``None`` on a plain Ray cluster: nothing to report or release)."""

    app: str
    grants: Mapping[str, PoolGrant]
    call: Call | None = None

    def report_started(self, pools: Mapping[str, Any]) -> None:
        if self.call is not None:
            report_started(self.grants, pools, self.call)

    def release(self, why: str) -> None:
        release_pools(self.grants.values(), self.call, why)


def admit_app(app: str, pools: Mapping[str, Any], *, deployment_name: Callable[[str], str], deadline: float,
              connect: Callable[[Mapping[str, Any]], Call | None] | None = None) -> AppAdmission:
    """Admit every pool of app ``app`` through its queue, then write each pool's Serve autoscaling
    bounds (``pool_scaling``, keyed by ``deployment_name(role)``) capped at its grant: the one
    admission of every deploy path (module doc). ``connect(pools)``: the controller's ``call``
    (default :func:`controller_call`; ``None`` from it: no controller, the spec's bounds).

    Raises:
        SpecError, PoolRefusedError: as :func:`admit_pools`; nothing stays admitted then.
    """
    call = (connect or controller_call)(pools)
    admission = AppAdmission(app, admit_pools(app, pools, call, deadline=deadline) if call is not None else {}, call)
    try:
        for role, pool in pools.items():  # Serve autoscales each pool within these, never above its grant
            lo, hi = serve_bounds(pool, admission.grants.get(role))
            pool_scaling.set_pool_bounds(app, deployment_name(role), min_replicas=lo, max_replicas=hi)
    except BaseException:
        admission.release("the deploy did not go ahead")
        raise
    return admission


def build_admitted(spec: Any, build: Callable[[Any], App], *, deployment_name: Callable[[str], str],
                   timeout_s: float = BUILD_ADMISSION_TIMEOUT_S,
                   connect: Callable[[Mapping[str, Any]], Call | None] | None = None) -> App:
    """``build(spec)`` (a ``ServeSpec``'s Serve application) once :func:`admit_app` admitted its
    pools: an engine's ``app_builder``, which Serve runs for ``serve deploy``/``serve run`` of the
    config ``rayfleet serve --serve-config`` prints. Admission is the deployer's, not a copy; the
    pools count as started once built (module doc).

    Outside a Ray cluster (``serve build`` calls the builder to write a config) there is nothing
    to admit on and no KV for the bounds, and asking would start a local Ray: it only builds.
    Serve calls the builder again inside the cluster when the config is deployed.

    Raises:
        SpecError, PoolRefusedError: a pool was refused (nothing is built, nothing stays admitted).
    """
    if not ray_connected():  # ``serve build``, a test building the graph: no queues, no bounds to write
        log.info("serve %r: built outside a Ray cluster, so its pools are not admitted here", spec.name)
        return build(spec)
    pools = spec.pools()
    admission = admit_app(spec.name, pools, deployment_name=deployment_name,
                          deadline=time.monotonic() + timeout_s, connect=connect)
    try:
        app = build(spec)
    except BaseException:
        admission.release("the Serve app could not be built")
        raise
    admission.report_started(pools)
    return app


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


def ray_connected() -> bool:
    """Whether this process is connected to a Ray cluster (Ray's own calls would start one)."""
    import ray

    return ray.is_initialized()


def controller_call(pools: Mapping[str, Any] | None = None) -> Call | None:
    """The fleet controller's methods as ``call(method, *args)``, or ``None`` on a plain Ray
    cluster (then a pool's named queue is not enforced: a warning says so) or without a
    connection to one (nothing to ask; ``ray.get_actor`` would start a local Ray)."""
    import ray

    if not ray_connected():
        return None
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
