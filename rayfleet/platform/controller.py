"""The fleet controller: a detached, named Ray actor that holds the fleet's inventory.

Design decisions:
- A thin shell: it gathers observations (``ray.nodes()``, free resources, placement groups,
  agent heartbeats), calls pure code in :mod:`rayfleet.platform.inventory`, and carries out the
  result (create agents, cordon suspect nodes, record events). Later the queues and the shared
  autoscaler live here too.
- Its state (node records, cordons, events) is persisted in SQLite
  (:mod:`rayfleet.platform.state_store`) on the head node, so a killed or restarted controller
  comes back with everything it knew. Ray restarts it (``max_restarts=-1``); ``ensure_controller``
  recreates it when it was removed for good.
- A background thread reconciles every ``reconcile_s`` seconds; methods may be called
  concurrently (``max_concurrency``), so every state change takes ``self._lock``.
- Queues (``queue/<name>`` in the store) are validated as a whole tree on every change
  (:mod:`rayfleet.platform.queues`). The shared autoscaler
  (:class:`~rayfleet.platform.autoscaler.service.SharedAutoscaler`) lives here: Serve and
  training shells *report* small observation dataclasses (``report_serve`` /
  ``report_training``) and *take* their typed decisions from an inbox (``take_decisions``), so
  the controller never imports their internals; node requests go straight to Ray's autoscaler
  (``request_resources``). Every decision is recorded as an event with its reason.
- Training jobs in a queue are admitted here (:class:`~rayfleet.platform.admission_book.AdmissionBook`
  around the pure :mod:`rayfleet.platform.admission`, which calls ``queues.admit``): the job's
  driver asks, waits while QUEUED, heartbeats and releases; reclaims go to the jobs' shells as
  ``ShrinkTraining`` decisions through the autoscaler's inboxes. Records live in the same SQLite.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

import ray

from rayfleet.errors import SpecError
from rayfleet.platform import labels as L
from rayfleet.platform.agent import AGENT_NAMESPACE, NodeAgent, agent_name
from rayfleet.platform.inventory import (
    FleetStatus, HealthPolicy, NodeRecord, NodeStatus, usage_from_observation,
)
from rayfleet.platform.state_store import Event, StateStore
from rayfleet.platform.topology import NodeTopology
from rayfleet.platform.autoscaler.service import SharedAutoscaler
from rayfleet.platform.autoscaler.types import (
    Decision, InboxEntry, RequestNodes, ServeObservation, TrainingObservation,
)
from rayfleet.platform.admission_book import AdmissionBook
from rayfleet.platform.serve_admission import SERVE_JOB_PREFIX
from rayfleet.platform.controller_queues import QueueMethods
from rayfleet.platform.ray_compat import available_resources_per_node

__all__ = ["FleetController", "ensure_controller", "get_controller", "CONTROLLER_NAME"]

log = logging.getLogger(__name__)
CONTROLLER_NAME = "rayfleet_controller"
_ACCELERATOR_RESOURCES = ("GPU", "NPU", "XPU")


class FleetController(QueueMethods):
    def __init__(self, state_path: str | None = None, *, heartbeat_s: float = 2.0,
                 reconcile_s: float = 2.0, heartbeat_timeout_s: float = 15.0,
                 cordon_suspect: bool = True) -> None:
        from rayfleet.platform.launcher import rayfleet_home

        self.state_path = state_path or str(rayfleet_home() / "controller.sqlite")
        self.store = StateStore(self.state_path)
        self.policy = HealthPolicy(heartbeat_timeout_s=heartbeat_timeout_s)
        self.heartbeat_s = heartbeat_s
        self.cordon_suspect = cordon_suspect
        self._lock = threading.RLock()
        self._records: dict[str, NodeRecord] = {
            key.split("/", 1)[1]: NodeRecord.from_json(value) for key, value in self.store.items("node/")
        }
        self._agents: dict[str, object] = {}
        self.autoscaler = SharedAutoscaler(
            free_accelerators=self._free_accelerators, request_nodes=_request_nodes,
            record=self._record)
        self._job_client = None  # Ray's job API, built on first use (_ended_jobs)
        self.admission = AdmissionBook(self.store, tree=self._queue_tree, ray_idle=self._idle_by_type,
                                       carry_out=self.autoscaler.carry_out, record=self._record)
        self.autoscaler.attach_queues(self.admission)  # queue-admitted jobs grow as their queues allow
        self._event("controller", "controller_started", f"restored {len(self._records)} node record(s), "
                    f"{len(self.admission.records())} queued or admitted job(s)")
        self._stop = threading.Event()
        self._reconcile_s = reconcile_s
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()

    # -- persistence helpers --------------------------------------------------------------
    def _save(self, record: NodeRecord) -> None:
        self._records[record.name] = record
        self.store.put(f"node/{record.name}", record.to_json())

    def _event(self, subject: str, kind: str, cause: str, **detail) -> None:
        self._record(subject, kind, cause, detail)

    def _record(self, subject: str, kind: str, cause: str, detail: dict) -> None:
        # detail stays a dict: keys such as "cause" must not collide with the event's own fields
        self.store.append_event(Event(ts=time.time(), kind=kind, subject=subject, cause=cause, detail=dict(detail)))
        log.info("%s %s: %s", subject, kind, cause)

    # -- reconcile ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # keep the controller alive through transient GCS errors
                log.exception("reconcile failed")
            self._stop.wait(self._reconcile_s)

    def reconcile(self) -> int:
        """Sync node records with Ray's node table and make sure every live node has an agent."""
        seen: dict[str, dict] = {}
        for entry in ray.nodes():
            name = (entry.get("Labels") or {}).get(L.NODE)
            if not name:
                continue
            # A restarted node reuses its name with a new id: the live entry wins.
            if name not in seen or entry.get("Alive"):
                seen[name] = entry
        with self._lock:
            for name, entry in seen.items():
                alive = bool(entry.get("Alive"))
                old = self._records.get(name)
                record = (old or NodeRecord(name=name, labels={})).with_(
                    labels=dict(entry.get("Labels") or {}), ray_node_id=entry.get("NodeID"), alive=alive)
                if old is None:
                    self._event(name, "node_joined", "new node in the Ray cluster", ray_node_id=record.ray_node_id)
                elif old.alive and not alive:
                    self._event(name, "node_lost", "Ray reports the node dead", ray_node_id=record.ray_node_id)
                    record = record.with_(last_heartbeat=None)
                elif not old.alive and alive:
                    self._event(name, "node_rejoined", "node is alive again", ray_node_id=record.ray_node_id)
                if record != old:
                    self._save(record)
            live = [name for name, entry in seen.items() if entry.get("Alive")]
        for name in live:
            self._ensure_agent(name)
        try:  # jobs whose drivers died are released; capacity that came back admits waiting jobs
            self.admission.expire(self._ended_jobs)
            self.admission.step()
        except Exception:  # noqa: BLE001 - admission must not stop the node reconcile
            log.exception("admission step failed")
        return len(live)

    def _ensure_agent(self, node: str):
        handle = self._agents.get(node)
        if handle is not None:
            return handle
        actor_cls = ray.remote(NodeAgent)
        handle = actor_cls.options(
            name=agent_name(node), namespace=AGENT_NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_concurrency=4, label_selector={L.NODE: node},
        ).remote(node, CONTROLLER_NAME, heartbeat_s=self.heartbeat_s)
        self._agents[node] = handle
        return handle

    # -- agent reports --------------------------------------------------------------------
    def heartbeat(self, report: dict) -> None:
        """Called by each node agent every heartbeat."""
        name = report["node"]
        with self._lock:
            old = self._records.get(name) or NodeRecord(name=name, labels=report.get("labels", {}))
            check = report.get("self_check") or {}
            ok = check.get("ok")
            record = old.with_(
                last_heartbeat=time.time(), alive=True, cordoned=bool(report.get("cordoned")),
                cordon_reason=report.get("cordon_reason", ""),
                self_check_ok=ok, self_check_at=check.get("at"),
                agent_info={"pid": report.get("pid"), "devices": report.get("devices", []),
                            "accelerators": report.get("accelerators", {}),
                            "load_avg": report.get("load_avg")},
            )
            if ok is False and old.self_check_ok is not False:
                reason = (f"GEMM self-check checksum {str(check.get('checksum'))[:12]} != expected "
                          f"{str(check.get('expected'))[:12]} (repeatable={check.get('repeatable')})")
                record = record.with_(suspect_reason=reason)
                self._event(name, "self_check_failed", reason)
            elif ok is True and old.self_check_ok is False:
                record = record.with_(suspect_reason="")
                self._event(name, "self_check_passed", "GEMM self-check matches again")
            self._save(record)
        if ok is False and self.cordon_suspect and not record.cordoned:
            self.cordon(name, "self-check failed: possible silent data corruption")

    # -- commands -------------------------------------------------------------------------
    def _require(self, node: str) -> NodeRecord:
        with self._lock:
            if node not in self._records:
                raise SpecError("node", node, "no such node in the fleet",
                                f"use one of {sorted(self._records)} (see `rayfleet status`)")
            return self._records[node]

    def cordon(self, node: str, reason: str = "cordoned by operator") -> int:
        """Cordon ``node``: nothing new is placed there. Returns the accelerators reserved."""
        self._require(node)
        reserved = ray.get(self._ensure_agent(node).cordon.remote(reason))
        with self._lock:
            self._save(self._records[node].with_(cordoned=True, cordon_reason=reason))
            self._event(node, "cordoned", reason, accelerators=reserved)
        return reserved

    def uncordon(self, node: str) -> None:
        self._require(node)
        ray.get(self._ensure_agent(node).uncordon.remote())
        with self._lock:
            self._save(self._records[node].with_(cordoned=False, cordon_reason=""))
            self._event(node, "uncordoned", "operator")

    def run_self_check(self, node: str, fault: str | None = None) -> dict:
        """Run the node's GEMM self-check now (``fault='sdc'`` injects corruption first)."""
        self._require(node)
        agent = self._ensure_agent(node)
        ray.get(agent.inject_fault.remote(fault))
        result = ray.get(agent.self_check.remote())
        self.heartbeat(ray.get(agent.report.remote()))
        return result

    # -- queries --------------------------------------------------------------------------
    def inventory(self) -> list[dict]:
        """Persisted node records (JSON-able), as the controller knows them."""
        with self._lock:
            return [r.to_json() for r in sorted(self._records.values(), key=lambda r: r.name)]

    def events(self, limit: int = 50, subject: str | None = None) -> list[Event]:
        return self.store.events(limit=limit, subject=subject)

    def status(self, event_limit: int = 20) -> FleetStatus:
        from ray.util.placement_group import placement_group_table

        totals = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        available = available_resources_per_node()
        holdings: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for group in placement_group_table().values():
            if group.get("state") not in ("CREATED", "RESCHEDULING"):
                continue
            for index, resources in group["bundles"].items():
                node_id = group["bundles_to_node_id"].get(index)
                amount = sum(v for k, v in resources.items() if k in _ACCELERATOR_RESOURCES)
                if node_id and amount:
                    holdings[node_id].append((group.get("name") or "", amount))
        now = time.time()
        rows = []
        with self._lock:
            records = sorted(self._records.values(), key=lambda r: r.name)
        for record in records:
            try:
                topo = NodeTopology.from_labels(record.labels, ray_node_id=record.ray_node_id)
            except ValueError:
                continue
            kind = topo.accelerator.ray_resource
            node_total = totals.get(record.ray_node_id, {})
            usage = usage_from_observation(
                total=node_total.get(kind, 0.0) if record.alive else topo.num_accelerators,
                available=available.get(record.ray_node_id, {}).get(kind, 0.0) if record.alive else topo.num_accelerators,
                group_holdings=holdings.get(record.ray_node_id, []),
            )
            health, reason = self.policy.decide(record, now=now)
            rows.append(NodeStatus(
                topology=topo, usage=usage, health=health, health_reason=reason, cordoned=record.cordoned,
                cordon_reason=record.cordon_reason,
                last_heartbeat_age_s=None if record.last_heartbeat is None else now - record.last_heartbeat,
            ))
        return FleetStatus(nodes=tuple(rows), events=tuple(self.store.events(limit=event_limit)),
                           decisions=tuple(self.autoscaler_decisions(limit=event_limit)),
                           admissions=tuple(self.admission.records()))

    def ping(self) -> str:
        return self.state_path

    # -- shared autoscaler (see autoscaler.service; these are its actor-facing methods) ----------
    def report_serve(self, observation: ServeObservation | None, deployment: str | None = None) -> None:
        """Serve's shell reports a deployment's load (replaces its previous report); ``None`` forgets it."""
        self.autoscaler.report_serve(observation, deployment)

    def report_training(self, observation: TrainingObservation | None, job_id: str | None = None) -> None:
        """A training job's shell reports its size/placement/snapshot; ``None`` forgets the job."""
        self.autoscaler.report_training(observation, job_id)

    def take_decisions(self, target: str) -> list[InboxEntry]:
        """Typed decisions for a job id or deployment name, oldest first; they leave the inbox."""
        return self.autoscaler.take(target)

    def autoscaler_running(self) -> bool:
        """Whether the shared autoscaler loop runs (training shells leave growth to it then)."""
        return self.autoscaler.running

    def record_event(self, subject: str, kind: str, cause: str, detail: dict | None = None) -> None:
        """An event from outside the controller (a shell's handover, a job's health decision), with its cause.
        Subjects: ``job:<name>``, ``serve:<name>``, a node name, ``controller``."""
        with self._lock:
            self._record(subject, kind, cause, detail or {})

    def _free_accelerators(self) -> tuple[dict[str, int], dict[str, str]]:
        available = available_resources_per_node()
        free, types = {}, {}
        with self._lock:
            records = list(self._records.values())
        for record in records:
            if not record.alive or record.cordoned:
                continue
            try:
                topo = NodeTopology.from_labels(record.labels, ray_node_id=record.ray_node_id)
            except ValueError:
                continue
            free[record.name] = int(available.get(record.ray_node_id, {}).get(topo.accelerator.ray_resource, 0))
            types[record.name] = topo.accelerator_type
        return free, types

    def _ended_jobs(self, job_ids: set[str]) -> set[str]:
        """Which of these Ray submission ids have ended (Ray's job API; the controller runs in the
        cluster, so it can ask). A driver stopped with ``ray job stop`` may be SIGKILLed before it
        releases its queue record; this releases it within one reconcile."""
        from ray.job_submission import JobSubmissionClient

        from rayfleet.platform.launcher import ensure_auth_token
        from rayfleet.platform.ray_compat import dashboard_url

        serve_pools = {j for j in job_ids if j.startswith(SERVE_JOB_PREFIX)}
        ended, job_ids = self._ended_serve_pools(serve_pools) if serve_pools else set(), set(job_ids) - serve_pools
        if not job_ids:
            return ended
        if self._job_client is None:
            ensure_auth_token()
            self._job_client = JobSubmissionClient(dashboard_url())
        for details in self._job_client.list_jobs():
            status = str(getattr(details.status, "value", details.status))
            if details.submission_id in job_ids and status in ("SUCCEEDED", "FAILED", "STOPPED"):
                ended.add(details.submission_id)
        return ended

    def _ended_serve_pools(self, job_ids: set[str]) -> set[str]:
        """Serve pools whose app Serve no longer runs (``serve delete``); the book keeps unserved ones."""
        try:  # empty when Serve is not running (it never starts it); an error must not hold back the jobs' check
            from ray import serve
            apps = set(serve.status().applications)
        except Exception:  # noqa: BLE001 - the Serve controller restarting: ask again next reconcile
            return set()
        return {j for j in job_ids if j.removeprefix(SERVE_JOB_PREFIX).rsplit("/", 1)[0] not in apps}

    def _idle_by_type(self) -> dict[str, int]:
        return self.autoscaler.idle_by_type()  # less the room kept for Serve replicas on their way

    def _carry_out(self, decision: Decision) -> None:
        self.autoscaler.carry_out(decision)

    def autoscaler_step(self, now: float | None = None, *, gather=None, act=None) -> list[Decision]:
        """One step of the shared autoscaler; ``gather(now)``/``act(decision)`` may be passed in."""
        return list(self.autoscaler.step(now, gather=gather, act=act))

    def start_autoscaler(self, interval_s: float = 10.0, config: dict | None = None) -> None:
        """Run ``autoscaler_step`` every ``interval_s`` seconds in a background thread.

        ``config``: :class:`~rayfleet.platform.autoscaler.types.AutoscalerConfig` fields (e.g.
        ``scale_down_after_s``); given, it replaces the policy and starts from a fresh state.
        A running loop is restarted with the new interval/config.
        """
        if self.autoscaler.running:
            self.stop_autoscaler()
        self.autoscaler.start(interval_s, config, stopped=self._stop)
        self._event("controller", "autoscaler_started", f"every {interval_s:g}s"
                    + (f", config {config}" if config else ""))

    def stop_autoscaler(self) -> bool:
        """Stop the loop (undelivered decisions are dropped). Returns whether one ran."""
        stopped = self.autoscaler.stop()
        if stopped:
            self._event("controller", "autoscaler_stopped", "operator")
        return stopped

    def autoscaler_decisions(self, limit: int = 20) -> list[Event]:
        """The newest autoscaler events (decisions with reasons, shells' handovers), oldest first."""
        return [e for e in self.store.events(limit=max(200, limit * 10)) if e.kind.startswith("autoscaler")][-limit:]


def _request_nodes(decision: RequestNodes) -> None:
    """Ask Ray's autoscaler for nodes holding the decision's accelerators, in its bundle size."""
    from ray.autoscaler.sdk import request_resources

    from rayfleet.platform.catalogue import get_accelerator

    resource = get_accelerator(decision.accelerator_type).ray_resource
    request_resources(bundles=[{resource: decision.bundle_size}] * max(1, decision.num_accelerators // decision.bundle_size))


def get_controller():
    """Handle of the running controller, or raise ``ValueError`` from Ray if there is none."""
    return ray.get_actor(CONTROLLER_NAME, namespace=AGENT_NAMESPACE)


def ensure_controller(state_path: str | None = None, *, timeout_s: float = 60.0, **options):
    """Get the controller, creating it (pinned to the head node) if it does not exist."""
    actor_cls = ray.remote(FleetController)
    handle = actor_cls.options(
        name=CONTROLLER_NAME, namespace=AGENT_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_concurrency=8, label_selector={L.ROLE: "head"},
    ).remote(state_path, **options)
    ray.get(handle.ping.remote(), timeout=timeout_s)
    return handle
