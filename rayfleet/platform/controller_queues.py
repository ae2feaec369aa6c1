"""The fleet controller's queue and admission methods (``FleetController`` inherits them).

Split out of ``controller.py`` by responsibility: declaring queues (one at a time or a whole file,
``rayfleet queue apply``) and the actor-facing admission calls a job's driver makes
(``jobs/admission_gate.py``), which the controller's :class:`~rayfleet.platform.admission_book.AdmissionBook`
answers. The mixin uses the controller's ``store``, ``_lock``, ``_event`` and ``admission``.
"""

from __future__ import annotations

from rayfleet.errors import SpecError
from rayfleet.platform.admission import AdmissionRequest
from rayfleet.platform.queues import QueueTree, parse_queue_spec

__all__ = ["QueueMethods"]


class QueueMethods:
    """Queue declaration and admission calls of ``FleetController`` (see module doc)."""

    # -- queues -----------------------------------------------------------------------------
    def _queue_tree(self) -> QueueTree:
        return QueueTree.build(parse_queue_spec(v) for _, v in self.store.items("queue/"))

    def create_queue(self, spec: dict) -> dict:
        """Create or replace a queue; the whole tree is re-validated first (SpecError if not)."""
        queue = parse_queue_spec(spec)
        with self._lock:
            self._queue_tree().with_queue(queue)
            self.store.put(f"queue/{queue.name}", queue.to_json())
            self._event(queue.name, "queue_created", f"quota {dict(queue.quota)}, borrow limit "
                        f"{'unlimited' if queue.borrow_limit is None else dict(queue.borrow_limit)}, priority {queue.priority}")
        self.admission.step()  # outside self._lock (see delete_queue): a new quota may admit waiting jobs
        return queue.to_json()

    def delete_queue(self, name: str) -> None:
        jobs = self.admission.jobs_in(name)  # outside self._lock: the book takes it (free accelerators)
        if jobs:
            raise SpecError("queue", name, f"holds {len(jobs)} queued or running job(s) ({', '.join(jobs[:3])})",
                            "wait for them to end, or stop them (`rayfleet job stop JOB`)")
        with self._lock:
            self._queue_tree().without(name)
            self.store.delete(f"queue/{name}")
            self._event(name, "queue_deleted", "operator")

    def list_queues(self) -> list[dict]:
        return [q.to_json() for q in sorted(self._queue_tree().queues.values(), key=lambda q: q.name)]

    def apply_queues(self, specs: list[dict]) -> dict[str, list[str]]:
        """Create or replace every queue in ``specs`` at once (``rayfleet queue apply``): the tree
        they make with the queues already declared is validated as a whole before anything is
        stored. Returns the names ``created``, ``updated`` and ``unchanged``."""
        queues = [parse_queue_spec(spec) for spec in specs]
        out: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": []}
        with self._lock:
            current = self._queue_tree().queues
            names = {q.name for q in queues}
            if len(names) != len(queues):
                raise SpecError("queues", sorted(q.name for q in queues), "names a queue twice", "give each queue once")
            QueueTree.build([q for n, q in current.items() if n not in names] + queues)
            for queue in queues:
                old = current.get(queue.name)
                key = "created" if old is None else "unchanged" if old == queue else "updated"
                out[key].append(queue.name)
                if key != "unchanged":
                    self.store.put(f"queue/{queue.name}", queue.to_json())
                    self._event(queue.name, f"queue_{key}", f"applied: quota {dict(queue.quota)}, borrow limit "
                                f"{'unlimited' if queue.borrow_limit is None else dict(queue.borrow_limit)}, "
                                f"priority {queue.priority}")
        self.admission.step()  # a larger quota may admit waiting jobs now
        return out

    # -- admission of training jobs (see admission_book; the job driver calls these) ---------------
    def request_admission(self, request: dict) -> dict:
        """A job driver asks its queue for accelerators (``AdmissionRequest`` fields)."""
        return self.admission.request(AdmissionRequest.from_json(request))

    def admission_status(self, job_id: str) -> dict | None:
        return self.admission.status(job_id)

    def admission_heartbeat(self, job_id: str, held: int | None = None) -> bool:
        return self.admission.heartbeat(job_id, held)

    def release_admission(self, job_id: str, why: str = "the job ended") -> bool:
        return self.admission.release(job_id, why)

    def admissions(self) -> list[dict]:
        """Every queued and admitted job: state, size, reason, place in line (JSON-able)."""
        return self.admission.records()

    def admit_serve_pool(self, request: dict) -> dict:
        """A Serve deploy asks its pool's queue for accelerators (``serve_admission``): admitted at
        once, or refused with the reason and fix; ``direct`` for a pool outside the queues."""
        return self.admission.request_pool(AdmissionRequest.from_json(request))
