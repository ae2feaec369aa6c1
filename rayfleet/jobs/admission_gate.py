"""The job driver's side of queue admission: ask, wait while QUEUED, heartbeat, release.

Every training job on a fleet passes through ``python -m rayfleet.jobs.train`` (``rayfleet
train``, ``fleet.train`` and ``ray job submit`` all run it), and that driver calls
:meth:`AdmissionTicket.open` in ``run_training`` before it asks Ray for a single accelerator.
The controller decides (``platform/admission.py`` around ``queues.admit``); this module only
carries the job's side:

- a job in an undeclared queue is refused before anything starts (exit code 2, the controller's
  message naming ``queue``, its value and the fix); a job without a queue (``default``, not
  declared) or on a plain Ray cluster without a controller runs at once, as before;
- while QUEUED it prints one line per change of reason or place in line
  (``rayfleet queue: QUEUED in team-b (place 1 in line): ...``) and keeps polling, also through
  a controller restart (its record is persisted; the driver retries until the actor is back);
- once admitted *and* every job it reclaimed from has let go, it returns the size granted (an
  elastic job's shell caps its formations there);
- a daemon thread heartbeats with what the running formation holds (``held``), so the
  controller counts accelerators promised but not yet placed, and notices a dead driver;
- ``close`` releases the record (also on SIGTERM: Ray's driver turns it into ``SystemExit``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.planning import world_size_of
from rayfleet.jobs.train_job import TrainJob
from rayfleet.platform.admission import AdmissionRequest, request_sizes
from rayfleet.platform.queues import JobClass

__all__ = ["AdmissionTicket", "admission_request", "submission_id", "QueueRefusedError"]

POLL_S = 0.5
HEARTBEAT_S = 2.0
CALL_TIMEOUT_S = 30.0


class QueueRefusedError(RayfleetError):
    """The controller refused the job's queue (message: field, value, why, fix)."""


def submission_id(*, run_key: str | None, name: str) -> str:
    """This driver's Ray submission id (what ``rayfleet job list`` shows), read from the job
    config Ray's job supervisor hands the driver; else the run key, else the job's name."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "") or "{}")
        found = (config.get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        found = None
    return found or run_key or name


def admission_request(job: TrainJob, *, job_id: str) -> AdmissionRequest:
    """What ``job`` asks its queue for (pure): its size range in whole DP replicas and its class.

    Raises:
        SpecError: a fixed-size job that does not say its size (the queue must know it).
    """
    klass = JobClass(job.queue_class)
    if job.elastic is not None and job.is_elastic:
        low, high = request_sizes(min_workers=job.elastic.min_workers, max_workers=job.elastic.max_workers,
                                  replica_size=job.replica_size)
        replica = job.replica_size
    else:
        size = world_size_of(job.planning)
        if size is None:
            raise SpecError("resources.num_workers", None, f"a job in queue {job.queue!r} must say how many "
                            "accelerators it needs", "set resources.num_workers (or an explicit plan's degrees, "
                            "or resources.elastic with a checkpoint)")
        low = high = replica = size
    return AdmissionRequest(job_id=job_id, name=job.name, queue=job.queue, accelerator_type=job.accelerator,
                            min_size=low, max_size=high, replica_size=replica, job_class=klass,
                            priority=job.priority)


class AdmissionTicket:
    """A queued or admitted job's handle on its record at the controller (see module doc)."""

    def __init__(self, controller: Any, request: AdmissionRequest, log: Callable[[str], None], *,
                 poll_s: float = POLL_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.controller, self.request, self.log = controller, request, log
        self.poll_s, self.heartbeat_s = poll_s, heartbeat_s
        self.size = 0
        self._held = 0
        self._halt = threading.Event()
        self._beat = threading.Event()
        self._thread = threading.Thread(target=self._heartbeats, name="rayfleet-admission", daemon=True)
        self._restore_sigterm: Callable[[], Any] | None = None

    @classmethod
    def open(cls, job: TrainJob, log: Callable[[str], None], *, job_id: str) -> "AdmissionTicket | None":
        """Ask the fleet controller to admit ``job``; ``None`` when it runs outside the queues.

        Raises:
            QueueRefusedError: the job's queue is not declared (or is not a leaf).
            SpecError: the job does not say its size.
        """
        controller = _controller()
        if controller is None:
            log(f"rayfleet queue: no fleet controller; queue {job.queue!r} is not enforced")
            return None
        request = admission_request(job, job_id=job_id)
        ticket = cls(controller, request, log)
        answer = ticket._call("request_admission", request.to_json())
        if answer["outcome"] == "refused":
            raise QueueRefusedError(answer["error"][2])
        if answer["outcome"] == "direct":
            return None
        ticket._thread.start()
        ticket._release_on_sigterm()
        return ticket

    # -- the driver calls these ---------------------------------------------------------------------
    def wait(self) -> int:
        """Block until admitted and ready; returns the accelerators granted."""
        last = None
        while True:
            status = self._call("admission_status", self.request.job_id)
            if status is None:  # the record is gone (released for a missed heartbeat): ask again
                self._call("request_admission", self.request.to_json())
                continue
            record = status["record"]
            if status["ready"]:
                self.size = int(record["size"])
                borrowed = f", {record['borrowed']} borrowed" if record["borrowed"] else ""
                self.log(f"rayfleet queue: admitted in {self.request.queue} at {self.size} "
                         f"{self.request.accelerator_type}{borrowed}: {record['reason']}")
                return self.size
            if record["state"] == "QUEUED":
                line = (f"rayfleet queue: QUEUED in {self.request.queue} (place {record['position']} in line): "
                        f"{record['reason']}")
            else:
                line = (f"rayfleet queue: admitted at {record['size']}, waiting for "
                        f"{', '.join(record['waiting_for'])} to let go of the accelerators it reclaims")
            if line != last:
                self.log(line)
                last = line
            time.sleep(self.poll_s)

    def holding(self, accelerators: int) -> None:
        """The running formation now holds ``accelerators`` (0: between formations)."""
        if accelerators != self._held:
            self._held = accelerators
            self._beat.set()

    def close(self, why: str = "the job ended") -> None:
        self._halt.set()
        self._beat.set()
        if self._restore_sigterm is not None:
            self._restore_sigterm()
        try:
            self._call("release_admission", self.request.job_id, why, retries=3)
        except Exception as exc:  # noqa: BLE001 - the controller expires it after a missed heartbeat
            self.log(f"rayfleet queue: could not release {self.request.job_id}: {exc!r}")

    # -- helpers -------------------------------------------------------------------------------------
    def _release_on_sigterm(self) -> None:
        """Release first when the driver is stopped: ``ray job stop`` sends SIGTERM and SIGKILLs
        3 s later, before the driver's ``finally`` blocks may have run. (Where Ray Train replaces
        this handler, the controller sees the Ray job end on its next reconcile.) Ray's own
        handler (``sys.exit``) runs next."""
        import signal

        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):  # noqa: ANN001 - a signal handler's signature
            import ray

            try:  # fire and forget: a ray.get inside a handler that interrupted one may not return
                self.controller.release_admission.remote(self.request.job_id, "the job was stopped")
            except Exception:  # noqa: BLE001 - the controller sees the Ray job end (or the heartbeat stop)
                pass
            if callable(previous):
                previous(signum, frame)
            else:
                raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._restore_sigterm = lambda: (signal.getsignal(signal.SIGTERM) is on_sigterm
                                         and signal.signal(signal.SIGTERM, previous))

    def _heartbeats(self) -> None:
        while not self._halt.is_set():
            try:
                if not self._call("admission_heartbeat", self.request.job_id, self._held, retries=1):
                    self._call("request_admission", self.request.to_json(), retries=1)
            except Exception:  # noqa: BLE001 - the controller restarting; the next beat retries
                pass
            self._beat.wait(self.heartbeat_s)
            self._beat.clear()

    def _call(self, method: str, *args: Any, retries: int | None = None) -> Any:
        """``controller.method(*args)``, retried while the controller restarts (``retries=None``:
        until it answers)."""
        import ray

        attempt, noted = 0, False
        while True:
            try:
                return ray.get(getattr(self.controller, method).remote(*args), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:  # restarting, too
                attempt += 1
                if retries is not None and attempt > retries:
                    raise
                if not noted and method != "admission_heartbeat":
                    self.log(f"rayfleet queue: the fleet controller is not answering ({type(exc).__name__}); "
                             "retrying (its queue state is persisted)")
                    noted = True
                time.sleep(1.0)


def _controller() -> Any:
    import ray

    try:
        from rayfleet.platform.controller import get_controller

        controller = get_controller()
        ray.get(controller.ping.remote(), timeout=CALL_TIMEOUT_S)
        return controller
    except Exception:  # noqa: BLE001 - a plain Ray cluster: no controller
        return None
