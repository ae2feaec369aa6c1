"""The fleet controller's admission state: records in SQLite, steps of the pure admission.

Design decisions:
- One record per queued or admitted job under ``admission/<job id>`` in the controller's
  :class:`~rayfleet.platform.state_store.StateStore`, written on every change: a restarted
  controller reloads them and every waiting job keeps its state, reason and place in line.
- Nothing here imports Ray: the controller passes in the queue tree, Ray's idle accelerators
  per type and where decisions go (``carry_out``: the shared autoscaler's inboxes), so the book
  is unit-tested in-process (tests/unit/platform/test_admission_controller.py).
- A job's driver heartbeats while it waits and while it runs (``heartbeat``, with what its
  formation holds) and releases its record when it ends; a driver killed without a word is
  released after ``heartbeat_ttl_s``. After a controller restart every record gets a fresh
  grace period (its driver's heartbeats resume against the new controller).
- The shared autoscaler asks the book how far each admitted job may grow (``growth_limits``)
  and tells it every resize it decides (``resized``): a record's ``size`` follows the job
  (admission, reclaim, the autoscaler's growth and lending), so the queues' usage, borrowing
  and reclaim see what the job is sized to, not what it was admitted at.
- Serve pools (``serve_admission``) are admitted by ``request_pool``: at once or refused, never
  left waiting; they have no driver, so silence does not expire them. ``ended`` may name a pool
  whose app Serve no longer runs; it is released once it has served (``held`` > 0).
- Reclaims go out as the autoscaler's own ``ShrinkTraining`` decisions (a preempted job's
  ``new_size`` is 0: its shell pauses it), and a preempted job admitted again gets a
  ``GrowTraining`` to its new size: the job shells already carry both out.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable, Mapping

from rayfleet.errors import SpecError
from rayfleet.platform.admission import (
    AdmissionRecord, AdmissionRequest, AdmissionState, admission_step, growth_limits, resized, route, settled,
)
from rayfleet.platform.autoscaler.types import Decision, GrowTraining, QueueGrowthLimits, ShrinkTraining
from rayfleet.platform.queues import QueueTree
from rayfleet.platform.serve_admission import pool_refusal

__all__ = ["AdmissionBook", "HEARTBEAT_TTL_S"]

HEARTBEAT_TTL_S = 30.0  # drivers beat every 2 s; a stopped driver releases at once (SIGTERM)
_PREFIX = "admission/"


class AdmissionBook:
    """Queued and admitted training jobs of one controller (thread-safe; see module doc)."""

    def __init__(self, store, *, tree: Callable[[], QueueTree], ray_idle: Callable[[], Mapping[str, int]],
                 carry_out: Callable[[Decision], None], record: Callable[[str, str, str, dict], None],
                 clock: Callable[[], float] = time.time, heartbeat_ttl_s: float = HEARTBEAT_TTL_S) -> None:
        self.store, self.tree, self.ray_idle, self.carry_out, self.record = store, tree, ray_idle, carry_out, record
        self.clock, self.heartbeat_ttl_s = clock, heartbeat_ttl_s
        self._lock = threading.RLock()
        self._records = {key[len(_PREFIX):]: AdmissionRecord.from_json(value) for key, value in store.items(_PREFIX)}
        now = clock()
        self._beats = {job_id: now for job_id in self._records}
        self._resend_unfinished_reclaims()

    # -- the job driver's side ---------------------------------------------------------------------
    def request(self, request: AdmissionRequest) -> dict:
        """Queue ``request`` (or find it queued already: a driver retrying after a controller restart)
        and run a step. Returns ``{"outcome": "direct"}`` for a job outside the queues, else
        ``{"outcome": "queued", "record": ...}``; a bad queue gives ``{"outcome": "refused",
        "error": [field, value, why-and-fix message]}`` (plain values: they cross Ray as they are)."""
        try:
            leaf = route(self.tree(), request.queue)
        except SpecError as err:
            return {"outcome": "refused", "error": [err.field, err.value, str(err)]}
        if leaf is None:
            return {"outcome": "direct"}
        with self._lock:
            if request.job_id not in self._records:
                record = AdmissionRecord(request=request, state=AdmissionState.QUEUED, submitted_at=self.clock(),
                                         reason="waiting for the next admission step")
                self._put(record)
                self.record(f"job:{request.name}", "queue_submitted",
                            f"{request.min_size}..{request.max_size} {request.accelerator_type} in queue {request.queue}",
                            {"job_id": request.job_id, "class": request.job_class.value})
            self._beats[request.job_id] = self.clock()
            self.step()
            return {"outcome": "queued", "record": self._records[request.job_id].to_json()}

    def request_pool(self, request: AdmissionRequest) -> dict:
        """Admit a Serve pool now or refuse it (``serve_admission``: a deploy does not wait in line).

        A record of the same pool (the app deployed again) is replaced. Returns ``request``'s
        answers, except that a pool whose minimum does not fit is ``refused`` with the queue's
        reason and the fix, and leaves no record; a refusal names the pool's own field
        (``decode.queue``, ``decode.replicas``: ``serve_admission.pool_refusal``)."""
        try:  # before a running app's record is touched: a bad queue leaves it as it is
            route(self.tree(), request.queue)
        except SpecError as err:  # named as the serve spec spells it (``decode.queue``)
            return {"outcome": "refused", "error": pool_refusal(request, queue_error=err)}
        with self._lock:
            if request.job_id in self._records:
                self.release(request.job_id, "the Serve app is deployed again")
            answer = self.request(request)
            record = self._records.get(request.job_id)
            if answer["outcome"] != "queued" or record is None or record.state is AdmissionState.ADMITTED:
                return answer
            self._records.pop(request.job_id)
            self._beats.pop(request.job_id, None)
            self.store.delete(_PREFIX + request.job_id)
            self.record(f"serve:{request.name}", "queue_refused", record.reason,
                        {"job_id": request.job_id, "queue": request.queue, "min_size": request.min_size})
            kind, leaf = request.accelerator_type, request.queue
            in_use = sum(r.size for r in self._records.values() if r.state is AdmissionState.ADMITTED
                         and r.request.queue == leaf and r.request.accelerator_type == kind)
            return {"outcome": "refused", "error": pool_refusal(
                request, reason=record.reason, quota=self.tree().queues[leaf].quota_of(kind), in_use=in_use)}

    def status(self, job_id: str) -> dict | None:
        """The job's record and whether it may start (admitted, every job it reclaimed from has
        let go); ``None`` for an unknown job."""
        with self._lock:
            record = self._records.get(job_id)
            if record is None:
                return None
            ready = record.state is AdmissionState.ADMITTED and all(
                settled(self._records.get(v)) for v in record.waiting_for)
            return {"record": record.to_json(), "ready": ready}

    def heartbeat(self, job_id: str, held: int | None = None) -> bool:
        """The driver is alive; ``held``: accelerators its running formation holds (0 between
        formations). Returns whether the job is known (False: re-request after a lost record)."""
        with self._lock:
            record = self._records.get(job_id)
            if record is None:
                return False
            self._beats[job_id] = self.clock()
            if held is not None and held != record.held:
                self._put(replace(record, held=int(held)))
                self.step()
            return True

    def release(self, job_id: str, why: str = "the job ended") -> bool:
        """Forget the job (its driver ended) and admit what now fits. Returns whether it was known."""
        with self._lock:
            record = self._records.pop(job_id, None)
            self._beats.pop(job_id, None)
            if record is None:
                return False
            self.store.delete(_PREFIX + job_id)
            self.record(f"job:{record.request.name}", "queue_released", why,
                        {"job_id": job_id, "queue": record.request.queue, "size": record.size})
            self.step()
            return True

    # -- the shared autoscaler's side ------------------------------------------------------------------
    def growth_limits(self) -> QueueGrowthLimits:
        """How far each admitted job may grow by its queue's rules (``admission.growth_limits``)."""
        with self._lock:
            return growth_limits(self.tree(), list(self._records.values()))

    def resized(self, job_name: str, new_size: int, reason: str) -> bool:
        """The autoscaler resized job ``job_name`` (its shell's inbox) to ``new_size``: the admitted
        record follows, with its borrowing recomputed, and a step runs (a shrink may let a waiting
        job in). Returns whether a record changed (False: a job outside the queues, or unchanged)."""
        with self._lock:
            matches = [r for r in self._records.values()
                       if r.request.name == job_name and r.state is AdmissionState.ADMITTED and r.size != new_size]
            if not matches:
                return False
            tree = self.tree()
            for record in matches:
                new = resized(tree, self._records.values(), job_id=record.job_id, new_size=new_size, reason=reason)
                self._put(new)
                self.record(f"job:{job_name}", "queue_resized", f"{record.size}->{new_size}"
                            + (f", borrowing {new.borrowed}" if new.borrowed else "") + f": {reason}",
                            {"job_id": record.job_id, "queue": record.request.queue, "size": new_size,
                             "borrowed": new.borrowed})
            self.step()
            return True

    def pool_held(self, name: str, held: int) -> bool:
        """Serve pool ``name`` (``serve_admission.pool_key``) holds ``held`` accelerators, as its
        Serve shell reports. Returns whether its record changed."""
        with self._lock:
            record = next((r for r in self._records.values() if r.request.serve_pool and r.request.name == name), None)
            if record is None or record.held == held:
                return False
            self._put(replace(record, held=int(held)))
            self.step()
            return True

    # -- the controller's side -----------------------------------------------------------------------
    def expire(self, ended: Callable[[set[str]], set[str]] | None = None) -> list[str]:
        """Release jobs that ended without a word: those ``ended(job ids)`` names (Ray's job table
        says they ended: a driver SIGKILLed by ``ray job stop``) and those whose driver has not
        heartbeat for ``heartbeat_ttl_s``."""
        now = self.clock()
        with self._lock:
            known = set(self._records)
            stale = [j for j in known if now - self._beats.get(j, now) > self.heartbeat_ttl_s
                     and not self._records[j].request.serve_pool]  # no driver: released at shutdown
        try:
            gone = sorted(set(ended(known)) & known) if ended is not None and known else []
        except Exception:  # noqa: BLE001 - the job API not answering: the heartbeat deadline still holds
            gone = []
        with self._lock:  # a Serve pool not yet serving (held 0) may be a deploy on its way, its app not created
            gone = [j for j in gone if j in self._records
                    and not (self._records[j].request.serve_pool and self._records[j].held == 0)]
        for job_id in gone:
            self.release(job_id, "its Ray job ended")
        for job_id in stale:
            if job_id not in gone:
                self.release(job_id, f"no heartbeat from its driver for {self.heartbeat_ttl_s:g}s")
        return gone + [j for j in stale if j not in gone]

    def step(self) -> None:
        """One admission step over every record; persists what changed and carries out reclaims."""
        with self._lock:
            if not self._records:
                return
            before = dict(self._records)
            result = admission_step(self.tree(), before.values(), ray_idle=self.ray_idle(), now=self.clock())
            for record in result.records:
                if before.get(record.job_id) != record:
                    self._put(record)
            for subject, kind, cause, detail in result.events:
                self.record(subject, kind, cause, detail)
            for order in result.reclaims:
                victim, reclaim = order.victim, order.reclaim
                per = victim.request.replica_size
                self.carry_out(ShrinkTraining(
                    job_id=victim.request.name, new_size=reclaim.new_size,
                    replicas=tuple(range(reclaim.new_size // per, victim.size // per)), freed_by_node={},
                    reason=f"queue reclaim: {reclaim.reason}", snapshot_first=True))
            for record in result.admitted:
                if record.times_admitted > 1:  # preempted earlier: its shell waits, paused, for this
                    self.carry_out(GrowTraining(job_id=record.request.name, new_size=record.size, nodes=(),
                                                reason=f"queue re-admission: {record.reason}"))

    def _resend_unfinished_reclaims(self) -> None:
        """After a restart: the reclaims a job still waits for, sent again to victims that still
        hold more than their new size. The autoscaler's inboxes live in memory, so a decision not
        yet taken when the controller died is gone; the shells ignore a shrink they already took
        (same target size)."""
        waited = {v for r in self._records.values() if r.state is AdmissionState.ADMITTED for v in r.waiting_for}
        for job_id in sorted(waited):
            victim = self._records.get(job_id)
            if victim is None or victim.held <= victim.size:
                continue
            per = victim.request.replica_size
            self.carry_out(ShrinkTraining(
                job_id=victim.request.name, new_size=victim.size,
                replicas=tuple(range(victim.size // per, victim.held // per)), freed_by_node={},
                reason=f"queue reclaim (sent again after a controller restart): shrink to {victim.size}",
                snapshot_first=True))

    def records(self) -> list[dict]:
        """Every record, queued first in line order, then admitted (JSON-able)."""
        with self._lock:
            rows = sorted(self._records.values(), key=lambda r: (r.state is AdmissionState.ADMITTED,
                                                                 r.request.queue, r.position, r.submitted_at))
            return [r.to_json() for r in rows]

    def jobs_in(self, queue: str) -> list[str]:
        with self._lock:
            return sorted(j for j, r in self._records.items() if r.request.queue == queue)

    def _put(self, record: AdmissionRecord) -> None:
        self._records[record.job_id] = record
        self.store.put(_PREFIX + record.job_id, record.to_json())
