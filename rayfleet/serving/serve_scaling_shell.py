"""The shared autoscaler's Serve shell: report a served model's load, carry out ``ScaleServe``.

The fleet controller's policy (:mod:`rayfleet.platform.autoscaler.policy`) decides; this shell
only gathers and acts, so it stays thin:
- Every ``interval_s`` it builds a ``ServeObservation`` from what the app itself measures — the
  ingress's requests in flight and waiting for a first token (queue depth) and its recent TTFTs
  (p95 over ``window_s`` against ``ttft_slo_s``), the router's polled KV usage — and reports it.
  A vLLM pool (``engine: vllm``) has no such ingress: the same figures come from vLLM's own
  metrics (``serving.vllm.pool_load``); the pool is then Serve LLM's deployment of that role.
  The pool is one Serve deployment that Serve autoscales only within bounds this shell moves
  (``pool_scaling``), so *desired* replicas come from the same rule Serve's uses:
  ``ceil(in flight / target_ongoing_requests)`` within ``[pool replicas, max_replicas]``
  (``desired_replicas``, pure).
- ``ScaleServe`` adding replicas: once the accelerator the policy freed is free (the training
  job steps off it after its current step), the pool deployment's bounds are raised by one and
  Serve starts the replica (placed by the pool's accelerator resource and labels, so on a free
  accelerator of that type: the freed one unless another is free). The time from the decision
  to the replica RUNNING in Serve is the *handover time*, recorded as an event.
- ``ScaleServe`` removing replicas: only as many as the autoscaler lent; the bounds are lowered
  and Serve drains the replica it stops (no new routes, its requests finish within
  ``graceful_shutdown_timeout_s``; what is left resumes elsewhere), so a scale-down fails no
  request. Serve picks which replica stops, so the freed node may not be the named one.
A vLLM pool with ``data_parallel_size`` > 1 is lent and reclaimed in whole gangs of DP ranks:
the shell reports it to the policy with a gang as the replica (``deploy.gang_units.LendUnit``) and
moves Serve's bounds by the gang's ranks.
The shell is a Ray actor (``num_cpus=0``, on the head node) so that it outlives a notebook
cell but not the driver that started it. Its pure rules (the observation it reports, desired
replicas, when a lent replica may be placed) are ``deploy.serve_scaling_rules``. It sits at the
top of ``serving``, above ``deployer``, because it serves either engine: a built-in pool's load
comes from its ingress, a vLLM pool's from ``vllm.pool_load``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.platform.autoscaler.shell import AutoscalerShellBase, RayChannel
from rayfleet.platform.autoscaler.types import Decision, ScaleServe, ServeObservation
from rayfleet.platform.polling import poll_delays
from rayfleet.platform.serve_admission import pool_key
from rayfleet.serving.deploy.gang_units import LendUnit
from rayfleet.serving.deploy.serve_scaling_rules import (LentReplica, RoomWatch, ServeShellConfig,
                                                        free_accelerators_of_type, serve_observation)
from rayfleet.serving.deployer import pool_deployment_name
from rayfleet.serving.spec import ServeSpec

__all__ = ["ServeShell", "start_serve_shell", "ServeShellHandle"]


log = logging.getLogger(__name__)


class ServeShell(AutoscalerShellBase):
    """Ray actor body (see module doc) on the shells' take -> apply -> report skeleton.
    ``history()`` lists every lent replica."""

    observation_type = ServeObservation

    def __init__(self, spec: dict, config: dict) -> None:
        from rayfleet.platform.controller import get_controller

        self.spec = ServeSpec.parse(spec)
        self.config = ServeShellConfig(**config)
        self.role = self.config.role or ("colocated" if self.spec.mode == "colocated" else "decode")
        pool = self.spec.pools().get(self.role)
        if pool is None:
            raise SpecError("autoscale.role", self.role, f"is not a pool of this {self.spec.mode} deployment",
                            f"use one of {sorted(self.spec.pools())}")
        if not pool.accelerator_type:
            raise SpecError(f"{self.role}.accelerator_type", None, "is needed to lend accelerators to this pool",
                            "set the pool's accelerator_type (e.g. H100)")
        self.pool = pool
        # The policy's replica: a gang of DP ranks in a wide-EP vLLM pool (gang_units)
        self.unit = LendUnit.of_pool(data_parallel_size=pool.data_parallel_size,
                                     accelerators_per_replica=pool.accelerators_per_replica)
        if self.unit.ranks > 1:  # the target is per Serve replica (rank); desired counts gangs
            self.config = replace(self.config, target_ongoing_requests=self.config.target_ongoing_requests * self.unit.ranks)
        super().__init__(RayChannel(get_controller(), timeout_s=10), inbox=self.spec.name,
                         subject=f"serve:{self.spec.name}", interval_s=self.config.interval_s, log=log.warning,
                         thread_name="serve-shell")
        self.deployment = pool_deployment_name(self.spec, self.role)  # the pool's Serve deployment
        self.load_source = _load_source(self.spec, self.deployment, window_s=self.config.window_s)
        self.base_nodes = _replica_nodes(self.spec.name, self.deployment, self.unit)
        self.lent: list[LentReplica] = []
        self._lock = threading.Lock()
        self.last_observation: ServeObservation | None = None
        self.start()

    # -- queries ---------------------------------------------------------------------------
    def history(self) -> list[dict]:
        with self._lock:
            return [{**asdict(r), "handover_s": r.handover_s} for r in self.lent]

    def observation(self) -> dict | None:
        return None if self.last_observation is None else asdict(self.last_observation)

    def stop(self) -> None:
        """Stop reporting and forget the deployment in the controller (lent replicas stay)."""
        self.close()

    # -- the skeleton's steps (take -> apply -> report) ------------------------------------------
    def on_tick_error(self, exc: Exception) -> None:  # keep reporting through hiccups
        self.event("autoscaler_serve_shell_error", repr(exc), {})

    def observe(self) -> ServeObservation:
        load, kv = self.load_source.sample()
        with self._lock:
            lent = list(self.lent)
        observation = serve_observation(
            deployment=self.spec.name, accelerator_type=self.pool.accelerator_type,
            accelerators_per_replica=self.unit.accelerators, load=load,
            kv_usage_by_replica=kv, base_nodes=self.base_nodes, lent=lent, config=self.config,
            pool_key=pool_key(self.spec.name, self.role))  # its queue's limits cap the lends (serve_admission)
        self.last_observation = observation
        return observation

    def apply(self, decision: Decision, decided_at_s: float) -> None:
        match decision:
            case ScaleServe():
                self._scale(decision, decided_at_s)

    def _scale(self, decision: ScaleServe, decided_at: float) -> None:
        for node in decision.add_on_nodes:
            with self._lock:
                index = len(self.spec.replica_names()[self.role]) + len(self.lent)
                name = f"{self.role}-{index}"
                replica = LentReplica(name=name, app_name=self.spec.name, node=node, decided_at=decided_at)
                self.lent.append(replica)
            threading.Thread(target=self._add, args=(replica, decision.reforming), daemon=True).start()
        for node in decision.remove_from_nodes:
            with self._lock:
                active = [r for r in self.lent if r.removal_decided_at is None and r.running_at is not None]
                victims = [r for r in active if r.node == node] or active
                if not victims:
                    continue
                victim = victims[-1]
                victim.removal_decided_at = decided_at
            threading.Thread(target=self._remove, args=(victim, decision.reason), daemon=True).start()

    def _lent_bounds(self) -> int:
        """Units (replicas or gangs) of the pool the shell wants now: base + lent ones not being removed."""
        with self._lock:
            active = [r for r in self.lent if r.removal_decided_at is None and not r.error and r.placed_at is not None]
        return len(self.base_nodes) + len(active)

    def _set_bounds_and_wait(self, units: int, timeout_s: float) -> None:
        """Serve's bounds to ``units`` whole units (a gang's ranks together), then wait for them to run."""
        from rayfleet.serving.deploy.pool_scaling import set_pool_bounds

        replicas = self.unit.serve_replicas(units)
        set_pool_bounds(self.spec.name, self.deployment, min_replicas=replicas, max_replicas=replicas)
        deadline = time.monotonic() + timeout_s
        delays = poll_delays(max_s=2.0)  # a replica start takes seconds (built-in) to minutes (vLLM)
        while _running_replicas(self.spec.name, self.deployment) != replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.role} pool did not reach {replicas} running replicas in {timeout_s:g}s")
            time.sleep(next(delays))

    def _add(self, replica: LentReplica, reforming: tuple[str, ...] = ()) -> None:
        try:
            # Raise the bounds only once the policy's freed accelerator is really free (the
            # training job steps off it after its current step): a replica queued in Ray before
            # that was seen to stay pending after the accelerator freed up.
            self._wait_for_room(replica.node, self.unit.accelerators, reforming=reforming)
            replica.placed_at = time.time()
            self._set_bounds_and_wait(self._lent_bounds(), timeout_s=self.config.replica_start_timeout_s)
        except Exception as exc:  # noqa: BLE001 - recorded; the policy sees no new replica
            replica.error = repr(exc)
            if replica.placed_at is not None:
                # Lower the bounds again: left raised, Serve went on starting the replica the policy
                # no longer counted, and the next lend preempted the whole job for it (seen live).
                self._give_back_bounds()
            self.event("autoscaler_handover_failed", f"{replica.name} on {replica.node}: {exc!r}",
                       {"replica": replica.name, "node": replica.node})
            return
        replica.running_at = time.time()
        self.event("autoscaler_handover",
                   f"{replica.name} serving on {replica.node} {replica.handover_s:.1f}s after the decision",
                   {"replica": replica.name, "node": replica.node, "handover_s": round(replica.handover_s, 2)})

    def _give_back_bounds(self) -> None:
        from rayfleet.serving.deploy.pool_scaling import set_pool_bounds

        try:
            replicas = self.unit.serve_replicas(self._lent_bounds())
            set_pool_bounds(self.spec.name, self.deployment, min_replicas=replicas, max_replicas=replicas)
        except Exception as exc:  # noqa: BLE001 - reported; the next decision retries through the policy
            self.event("autoscaler_serve_shell_error", f"lowering the pool's bounds failed: {exc!r}", {})

    def _wait_for_room(self, node: str, count: int, timeout_s: float = 300.0, settle_s: float = 90.0, *,
                       reforming: tuple[str, ...] = ()) -> None:
        """Until ``node`` has ``count`` free accelerators and the lender has settled around them.

        Serve places the new replica on any free accelerator of the type. While the training job
        re-forms, *all* its accelerators are free for a moment; a replica started then may take one
        the job's new layout counts on (seen: the job's placement group pending for good). So the
        bounds rise only once nothing but the lent accelerators is free (the job holds its new
        layout), or after ``settle_s`` with room on the node (a lender that never re-forms).
        With no job ``reforming`` (the decision's: nothing re-forms around the room), as soon
        as the node has room.
        """
        import ray
        from rayfleet.platform.ray_compat import available_resources_per_node

        from rayfleet.platform.catalogue import get_accelerator

        resource = get_accelerator(self.pool.accelerator_type).ray_resource  # GPU, XPU or NPU
        deadline = time.monotonic() + timeout_s
        watch = RoomWatch(node, count, settle_s=settle_s, reforming=bool(reforming))
        delays = poll_delays(max_s=1.0)  # the lender steps off within its step; a re-formation takes 10-60 s
        while time.monotonic() < deadline and not self._halt.is_set():
            free_by_node = free_accelerators_of_type(ray.nodes(), available_resources_per_node(), resource=resource,
                                                     accelerator_type=self.pool.accelerator_type)
            if watch.ready(time.monotonic(), free_by_node, self._pending_lent_accelerators(count)):
                return
            time.sleep(next(delays))
        raise TimeoutError(f"{count} accelerator(s) on {node} did not become free within {timeout_s:g}s")

    def _pending_lent_accelerators(self, per_replica: int) -> int:
        with self._lock:
            return per_replica * sum(1 for r in self.lent if r.placed_at is None and not r.error)

    def _remove(self, replica: LentReplica, reason: str) -> None:
        try:
            self._set_bounds_and_wait(self._lent_bounds(), timeout_s=self.config.drain_timeout_s + 30)
        except Exception as exc:  # noqa: BLE001
            replica.error = repr(exc)
            self.event("autoscaler_replica_remove_failed", f"{replica.name}: {exc!r}", {"replica": replica.name})
            return
        replica.removed_at = time.time()
        self.event("autoscaler_replica_removed",
                   f"{replica.name} drained and removed from the {self.role} pool "
                   f"{replica.removed_at - replica.removal_decided_at:.1f}s after the decision ({reason})",
                   {"replica": replica.name, "node": replica.node})


class _IngressLoad:
    """The built-in engine's load source: its ingress measures load and polls KV usage."""

    def __init__(self, app_name: str, window_s: float) -> None:
        from ray import serve

        self.ingress, self.window_s = serve.get_deployment_handle("ingress", app_name=app_name), window_s

    def sample(self) -> tuple[dict, dict[str, float]]:
        load = self.ingress.load.remote(self.window_s).result(timeout_s=10)
        states = self.ingress.replica_states.remote().result(timeout_s=10)
        return load, {name: 1.0 - s.snapshot.num_free_blocks / max(1, s.snapshot.num_total_blocks)
                      for name, s in states.items()}


def _load_source(spec: ServeSpec, deployment: str, *, window_s: float):
    """Where a pool's load comes from, by engine: the built-in ingress, or vLLM's own metrics
    (``serving.vllm.pool_load``; a Serve LLM app has no ingress that measures load)."""
    if spec.engine.kind == "vllm":
        from rayfleet.serving.vllm.pool_load import VLLMPoolLoadSource

        return VLLMPoolLoadSource(spec.name, deployment, window_s=window_s)
    return _IngressLoad(spec.name, window_s)


def _replica_nodes(app_name: str, deployment: str, unit: LendUnit) -> list[str]:
    """rayfleet node of each running replica of the pool deployment ('' when not labelled); of
    each complete gang, grouped by its placement group, when the pool's unit is a gang."""
    import ray
    from ray.util.state import list_actors

    from rayfleet.platform import labels as L

    node_of = {n["NodeID"]: (n.get("Labels") or {}).get(L.NODE, "") for n in ray.nodes()}
    cls = f"ServeReplica:{app_name}:{deployment}"
    # This cluster's address: with another Ray instance on the host, "auto" is ambiguous.
    alive = list_actors(address=ray.get_runtime_context().gcs_address, detail=unit.ranks > 1,
                        filters=[("state", "=", "ALIVE"), ("class_name", "=", cls)], limit=10000)
    if unit.ranks == 1:
        return sorted(node_of.get(a.node_id, "") for a in alive)
    by_gang: dict[str, list[str]] = {}
    for a in alive:
        by_gang.setdefault(a.placement_group_id or a.actor_id, []).append(node_of.get(a.node_id, ""))
    return unit.unit_nodes(by_gang)


def _running_replicas(app_name: str, deployment: str) -> int:
    """RUNNING replicas of ``deployment`` in Serve's status (0 if unknown)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    status = app.deployments.get(deployment) if app is not None else None
    if status is None:
        return 0
    return sum(n for state, n in (status.replica_states or {}).items() if str(getattr(state, "value", state)) == "RUNNING")


@dataclass
class ServeShellHandle:
    """What ``Fleet.autoscale_serve`` returns: the shell actor and the app it scales."""

    actor: Any
    deployment: str
    config: ServeShellConfig = field(default_factory=ServeShellConfig)

    def history(self) -> list[dict]:
        """Every replica the autoscaler lent to this app: node, decision/running/removed times."""
        import ray

        return ray.get(self.actor.history.remote())

    def observation(self) -> dict | None:
        import ray

        return ray.get(self.actor.observation.remote())

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        finally:
            ray.kill(self.actor)


def start_serve_shell(spec: ServeSpec, **config: Any) -> ServeShellHandle:
    """Start the Serve shell for a deployed ``spec`` (see ``ServeShellConfig`` for ``config``)."""
    import ray

    from rayfleet.platform import labels as L

    shell_config = ServeShellConfig(**config)
    actor = ray.remote(ServeShell).options(num_cpus=0, max_concurrency=4, label_selector={L.ROLE: "head"}).remote(
        spec.model_dump(mode="json"), asdict(shell_config))
    ray.get(actor.observation.remote(), timeout=60)  # constructed (raises SpecError here if misconfigured)
    return ServeShellHandle(actor=actor, deployment=spec.name, config=shell_config)
