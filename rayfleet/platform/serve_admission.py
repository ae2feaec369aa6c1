"""What a Serve pool asks its queue for (pure: no Ray, clock or I/O).

A serve spec's pool may name a ``queue`` (``serving/pool_queue.py``). At deploy time each pool
that asks for accelerators becomes an :class:`~rayfleet.platform.admission.AdmissionRequest`
(``serve_pool_request``) and is admitted by the fleet controller's admission book with the same
``admission_step`` -> ``queues.admit`` that admits training jobs: there is no second copy of the
rules. What is particular to a Serve pool is decided here.

Design decisions:
- **Sizes.** A pool asks for ``replicas .. max_replicas`` replicas of ``accelerators_per_replica``
  accelerators of its ``accelerator_type`` (a replica is the gang unit: a vLLM DP pool's replica
  is its whole gang, as the shared autoscaler lends it). Admission gives it the largest number of
  whole replicas in that range that fits, never fewer than ``replicas``; the deployer caps Serve's
  own autoscaling at what was admitted, so the pool never holds more than its queue granted.
- **Refused, not queued, when it does not fit.** ``deploy`` is synchronous: it returns a URL that
  serves or raises. A pool that waited in line would hold the caller for an unbounded time with
  half an application on the fleet. So a pool whose minimum does not fit now is refused with the
  queue's reason (``queues.admit``'s) and the settings that fix it, and no record stays behind;
  Kubernetes' ResourceQuota answers a Deployment over quota the same way ("exceeded quota"). A
  pool whose admission reclaims borrowed accelerators waits for them (bounded by the deploy's
  timeout), as a training job does.
- **Guaranteed, never borrowing.** A pool is a ``GUARANTEED`` workload: it runs only inside its
  leaf queue's quota and is never a reclaim victim. Reclaim shrinks training after a flash
  snapshot; a Serve replica has requests in flight and nothing to snapshot, and borrowing that
  could be taken back mid-traffic is not what a service owner expects. Its growth through the
  shared autoscaler's lending is capped by ``admission.growth_limits`` like a training job's
  (every queue on its path within quota + borrow limit, the roots' quota, and its leaf quota).
- **Names.** The record's ``job_id`` is ``serve:<app>/<role>`` (``rayfleet job list`` cannot
  confuse it with a Ray submission id) and its ``name`` (the key of its growth limits and of
  ``resized``) is ``<app>/<role>``, which the pool's Serve shell reports as
  ``ServeObservation.pool_key``.
- **No driver.** A pool has no driver to heartbeat, so its record is not expired for silence; it
  is released when the app is shut down (``ServeDeployment.shutdown``), replaced when an app of
  the same name is deployed again, and ``held`` follows what the Serve shell reports.
"""

from __future__ import annotations

from rayfleet.errors import SpecError
from rayfleet.platform.admission import DEFAULT_QUEUE, AdmissionRequest
from rayfleet.platform.queues import JobClass

__all__ = ["SERVE_JOB_PREFIX", "pool_key", "serve_pool_job_id", "serve_pool_request", "pool_refusal"]

SERVE_JOB_PREFIX = "serve:"


def pool_key(app: str, role: str) -> str:
    """The admission record's name of ``role``'s pool in app ``app`` (``chat/decode``)."""
    return f"{app}/{role}"


def serve_pool_job_id(app: str, role: str) -> str:
    """The admission record's id of ``role``'s pool in app ``app`` (``serve:chat/decode``)."""
    return SERVE_JOB_PREFIX + pool_key(app, role)


def serve_pool_request(*, app: str, role: str, queue: str, accelerator_type: str | None,
                       accelerators_per_replica: int, replicas: int, max_replicas: int | None,
                       priority: int = 0) -> AdmissionRequest | None:
    """The request ``role``'s pool makes, or ``None`` when it asks for no accelerators.

    Example: ``replicas=2, max_replicas=4, accelerators_per_replica=8`` asks for 16..32 H100 in
    whole replicas of 8.

    Raises:
        SpecError: the pool names a queue (other than ``default``) but asks for no accelerators
            of a named type, so its queue could not count it.
    """
    if accelerators_per_replica <= 0 or not accelerator_type:
        if queue != DEFAULT_QUEUE:
            raise SpecError(f"{role}.queue", queue, "is set on a pool that asks for no accelerators of a named "
                            f"type (accelerator_type={accelerator_type!r}, accelerators_per_replica="
                            f"{accelerators_per_replica}), so the queue could not count it",
                            f"set {role}.accelerator_type and {role}.accelerators_per_replica, or remove {role}.queue")
        return None
    per = accelerators_per_replica
    return AdmissionRequest(job_id=serve_pool_job_id(app, role), name=pool_key(app, role), queue=queue,
                            accelerator_type=accelerator_type, min_size=replicas * per,
                            max_size=(max_replicas or replicas) * per, replica_size=per,
                            job_class=JobClass.GUARANTEED, priority=priority, serve_pool=True)


def pool_refusal(request: AdmissionRequest, *, reason: str | None = None, quota: int | None = None,
                 in_use: int = 0, queue_error: SpecError | None = None) -> list:
    """``[field, value, message]`` of a refused pool, the field named as the serve spec spells it.

    ``queue_error``: its queue is unknown (or a parent), as ``admission.route`` said: the field is
    ``<role>.queue``. Else ``reason``: its minimum does not fit (``queues.admit``'s reason), with
    its queue's ``quota`` of the pool's type and what its admitted jobs use of it (``in_use``): the
    field is ``<role>.replicas``. Plain values: the answer crosses Ray as it is.

    >>> r = serve_pool_request(app="chat", role="decode", queue="inference", accelerator_type="H100",
    ...                        accelerators_per_replica=8, replicas=2, max_replicas=None)
    >>> field, value, message = pool_refusal(r, reason="quota full", quota=8)
    >>> (field, value), message.split(". Fix")[0]
    (('decode.replicas', 2), 'decode.replicas=2: Serve pool chat/decode does not fit in queue inference: it asks for 16 H100 (2 x 8); its H100 quota is 8, 0 in use (quota full)')
    """
    role = request.name.rsplit("/", 1)[-1]
    if queue_error is not None:
        # route's message is ``queue='x': why. Fix: ...``: the same, with the pool's own field
        message = f"{role}.{queue_error}".replace("leave `queue` unset", f"leave `{role}.queue` unset")
        return [f"{role}.{queue_error.field}", queue_error.value, message]
    replicas, kind = request.min_size // request.replica_size, request.accelerator_type
    room = "" if quota is None else f"; its {kind} quota is {quota}, {in_use} in use"
    return [f"{role}.replicas", replicas, str(SpecError(
        f"{role}.replicas", replicas, f"Serve pool {request.name} does not fit in queue {request.queue}: it asks for "
        f"{request.min_size} {kind} ({replicas} x {request.replica_size}){room} ({reason})",
        f"lower the pool's replicas, raise queue {request.queue}'s {request.accelerator_type} quota "
        "(`rayfleet queue apply`), or deploy again once its jobs end"))]
