"""``PrefixLoadRequestRouter``: rayfleet's prefix+load policy as a Ray Serve ``RequestRouter``.

Configure a pool deployment with
``request_router_config=RequestRouterConfig(request_router_class=PrefixLoadRequestRouter,
request_router_kwargs={"role": "prefill", "load_weight": 0.5}, request_routing_stats_period_s=...)``.
Serve builds one instance per deployment in every process that holds a handle to it and calls
``choose_replicas`` there, so routing costs no extra hop and no router deployment.

Design decisions:
- Thin shell over ``pool_router.PoolRouterCore`` (pure, unit-tested): it feeds the core each
  candidate's ``routing_stats`` (published by the replica's ``record_routing_stats``, schema in
  ``pool_router.ROUTING_STATS_KEYS`` and ``hash_log``), reads the call's ``RouteHint`` (keyword
  ``route`` by default, or any positional ``RouteHint``), and returns one-replica tiers best
  first. Serve then sends to the first tier whose replica accepts (queue below
  ``max_ongoing_requests``), so a full or dead best replica falls through to the next. The
  routed prompt's blocks are indexed (``PoolRouterCore.flush_bookings``) once the answer is
  returned, off the decision path.
- Generic: any engine whose replicas publish those stats and whose callers attach a
  ``RouteHint`` can use it (the Serve LLM pools reuse it with their own block hashes).
- No ``FIFOMixin``: Serve's FIFO matching hands a chosen replica to the *oldest* pending
  request, which would send a pinned call (a KV release) to another call's replica. Without it
  Serve matches the chosen replica to exactly the request it was chosen for.
- The best replica's tier is repeated ``best_attempts`` times before the next one. Serve probes
  each tier's queue length with a deadline that starts at 0.1 s and doubles per tier; on a busy
  host the first probe of the best replica can miss it, and Serve would then send the call to
  the second tier: the prefix's replica lost a request it should have had (seen live: one of a
  tenant's four requests on the other replica). Repeating the tier gives the probe 0.1 + 0.2 +
  0.4 + 0.8 + 1.0 s (Serve caps one probe at 1 s); three tries (0.7 s) still lost a tenant's
  request in CI on a loaded machine. A replica that answers "full" costs only fast probes before
  the call spills over; only one that does not answer at all delays the call, by 2.5 s.
- Never raises and never returns nothing: an exception inside ``choose_replicas`` leaves the
  request waiting forever in Serve's routing loop, and so does an empty ranking; both fall back
  to all candidates (Serve's least-queue choice). A pinned replica that left the pool gets the
  same fallback: the replica that receives the call sees it is not the target and raises
  ``ReplicaUnavailableError``, which the caller handles like a dead replica.
- ``for_deployment(app, name)`` finds this process's instance (the ingress reads replica stats
  from it for ``/metrics``, ``/health`` and per-replica calls); instances register themselves in
  ``router``'s registry: Serve pickles this module *by value* into every handle, so a registry
  here would be a separate copy per unpickling, invisible to a normal import.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from rayfleet.serving.routing.policy import RouterPolicy
from rayfleet.serving.routing import router as _router
from rayfleet.serving.routing.pool_router import PoolRouterCore, RouteHint
from rayfleet.serving.routing.ttft_cost import prefill_policy

__all__ = ["PrefixLoadRequestRouter"]

log = logging.getLogger(__name__)

class PrefixLoadRequestRouter(RequestRouter):
    """Serve request router for one pool deployment (see module doc)."""

    def initialize_state(self, *, role: str = "prefill", load_weight: float = 0.5, mode: str = "prefix_aware",
                         hint_kwarg: str = "route", best_attempts: int = 5, spread_weight: float | None = None,
                         cost: str = "predicted_ttft", tokens_per_block: int = 16, step_token_budget: int = 2048,
                         **_: Any) -> None:
        # ``cost``: ``ttft_cost.PREFILL_POLICIES``; ``load_weight``/``spread_weight`` are the
        # prefix_load cost's (None: its default), ``step_token_budget`` the TTFT cost's.
        if cost == "prefix_load":
            policy = RouterPolicy(load_weight=load_weight) if spread_weight is None else RouterPolicy(
                load_weight=load_weight, spread_weight=spread_weight)
        else:
            policy = prefill_policy(cost, step_token_budget=step_token_budget)
        self.core = PoolRouterCore(role=role, policy=policy, mode=mode, tokens_per_block=tokens_per_block)
        self.hint_kwarg = hint_kwarg
        self.best_attempts = max(1, int(best_attempts))  # module doc: probes that miss a busy replica
        self.num_fallbacks = 0  # choose_replicas calls answered with every candidate (errors, lost pins)
        _router.register_pool_router(self._deployment_id.app_name, self._deployment_id.name, self)

    @classmethod
    def for_deployment(cls, app_name: str, deployment: str) -> "PrefixLoadRequestRouter | None":
        return _router.pool_router(app_name, deployment)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Latest published routing stats of every running replica of the pool, by replica id."""
        # A copy first: Serve may run this router on its own event-loop thread.
        return {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in list(self._replicas.values())}

    def _hint(self, pending_request: PendingRequest | None) -> RouteHint | None:
        if pending_request is None:
            return None
        hint = (pending_request.kwargs or {}).get(self.hint_kwarg)
        if isinstance(hint, RouteHint):
            return hint
        return next((a for a in pending_request.args or () if isinstance(a, RouteHint)), None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        try:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            self.core.retain(list(by_id))
            now, wall = time.monotonic(), time.time()
            for uid, replica in by_id.items():
                self.core.observe(uid, replica.routing_stats, now, wall)
            ranked = self.core.rank(list(by_id), self._hint(pending_request), now_s=now)
            tiers = [[by_id[u] for u in tier if u in by_id] for tier in ranked]
            tiers = [t for t in tiers if t]
            asyncio.get_running_loop().call_soon(self.core.flush_bookings)  # after we answer (module doc)
            if tiers:
                return [tiers[0]] * self.best_attempts + tiers[1:]
        except Exception:  # noqa: BLE001 - an exception here would hang the request (module doc)
            log.exception("PrefixLoadRequestRouter: ranking failed; routing to any replica")
        self.num_fallbacks += 1
        return [list(candidate_replicas)]
