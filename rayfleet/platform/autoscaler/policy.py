"""The shared autoscaler's policy: lend accelerators from elastic training to Serve and back.

``AutoscalerPolicy.decide(state, observation) -> PolicyResult(state, decisions)`` is pure (no
Ray, clock or I/O): the fleet controller's loop and the simulator (:mod:`rayfleet.platform.sim`)
call the same object. The state it threads through is small and frozen (hysteresis timers,
what was lent, cooldowns), so a restarted controller can rebuild it from its store.

Design decisions:
- Inference first. A deployment needs more replicas when Serve's own autoscaler wants more
  (``desired > running + pending``) or when it is *at risk* (TTFT p95 near its SLO, a deep
  queue per replica, or nearly full KV cache) even if Serve has not asked yet.
- Capacity comes from, in order: free accelerators (best fit: the fullest node that still holds
  a whole replica), then shrinking training, then Ray's autoscaler (``RequestNodes``).
- Shrinking is topology-aware and cheapest-first: a Serve replica must sit on one node, so the
  policy picks, node by node, the cheapest set of training DP replicas on that node which —
  together with the node's free accelerators — make room for a whole Serve replica. Cost is
  ``(job priority, class rank, lost accelerator-seconds)``: low priority first, elastic shrinks
  before opportunistic preemptions (which lose the work since their last snapshot and must
  requeue), then the least work at risk (most recent snapshot, fewest workers restarted).
  Guaranteed jobs are never touched; elastic jobs never go below their minimum (gang size) and
  always shrink by whole DP replicas after a flash snapshot (``snapshot_first``).
- Hysteresis against flapping: a deployment scales down only after its load has stayed low
  (``desired < running + pending`` and TTFT well inside the SLO) for ``scale_down_after_s``
  without a break, and only running replicas are removed: a replica still on its way is not
  recalled (its lend is already paid, and the shell could only cancel it half-started); a
  grown-back job is not resized again within ``job_resize_cooldown_s``; training only grows
  when no deployment is short or at risk.
- A scale-up is fresh until a whole window after its replicas run (``fresh_until``; the
  length is ``fresh_after_scale_up_s``, one ``scale_down_after_s`` unless set): no
  reading taken before then starts a low-load window, as in HPA's scale-down stabilization
  and KEDA's cooldown. Readings while a replica loads measure the deployment without it, and
  those of its first window mix in the backlog from before it (TTFT windows, queues moving
  over): neither says the replica is not needed. "Taken" is the figures' own time: a reading
  ``load_age_s`` old (exported metrics) counts from then (seen live on a vLLM pool whose
  burst paused while the lent engine started: metrics 4 s late read the pause as the first
  low window after the replica ran, it was removed while the resumed burst ran, and the
  burst's late figures lent a second accelerator). Seen live (1 s ticks, 3 s window): a low
  window that began while the lent replica loaded removed it 1 s after it served, burst still
  running; the next lend then preempted the lender whole. So by default a lent replica serves
  at least two windows (in production ``scale_down_after_s`` is minutes; the simulator's price
  of the second one is in ``AutoscalerConfig.fresh_after_scale_up_s``).
- Flapping guard: a scale-up within ``max(scale_down_after_s, reversal_guard_s)`` of the same
  deployment's scale-down reverses it; its lend may shrink jobs but never preempts an elastic
  job whole (the last resort). The replica scaled down gives its accelerator back once
  drained, and a whole preemption is the most expensive way to buy back what is coming free.
- A scale-up no report shows yet (``scaling_to``) counts as on its way for up to
  ``report_lag_s``: the Serve shell takes decisions on its own tick, so the next step may see
  the old report, and deciding on it lent twice for one need (seen live under load).
- A job preempted whole (``paused``: size 0, not re-forming) gets accelerators back as soon as
  they are free, nothing is short and its gang minimum fits at once; the resize cooldown,
  which bounds restarts of a running job, does not hold it back (it makes no progress at all).
- Giving back: accelerators lent by a job are returned to it, but only out of what is free
  beyond the queued training's gang minimums (``reserve_for_queue``): a queued job has made no
  progress yet, so admitting it first shortens mean completion time (lenders-first made the
  policy lose to whole-job preemption on JCT in the simulator). Growth of a job above what it
  was admitted at happens only when no training job waits (``pending_training_accelerators == 0``).
- Queue-admitted jobs grow only as their queues allow (``FleetObservation.queue_limits``,
  computed from the queue tree and the admission records by ``admission.growth_limits`` with
  the queues' own functions): never above what their queue may hold (quota + borrow limit, the
  roots' quota), the room shared by the jobs of a queue within one step, and never into
  accelerators admission granted a job that does not hold them yet. A job waiting in its queue
  is not grown: only admission starts it. Growth above the leaf's quota is borrowing, which a
  lender inside its quota reclaims (the controller records the new size in the admission book).
- Serve pools admitted through a queue (``ServeObservation.pool_key``) scale up by the same
  limits (``queue_cap``): a pool's lend never takes it above what its queues may hold, and what
  it takes comes out of the room its queue's training jobs would grow into in the same step.
- Every decision carries a human-readable ``reason``; the controller records it as an event.

Lending (which training to shrink for a Serve replica) is in :mod:`rayfleet.platform.autoscaler.lending`.
"""

from __future__ import annotations

import math
from collections import defaultdict

from rayfleet.platform.autoscaler.lending import FleetScratch, accelerator_type_matches, lend, shrink_decisions
from rayfleet.platform.autoscaler.types import (
    AutoscalerConfig, AutoscalerState, Decision, FleetObservation, GrowTraining, PolicyResult, QueueGrowthLimits,
    RequestNodes, ScaleServe, ServeObservation, ShrinkTraining, TrainingObservation,
)
from rayfleet.platform.queues import JobClass

# The policy's vocabulary is re-exported: callers (the simulator, the shells) import it from here.
__all__ = [
    "ServeObservation", "TrainingObservation", "FleetObservation", "AutoscalerConfig", "AutoscalerState",
    "ShrinkTraining", "GrowTraining", "ScaleServe", "RequestNodes", "Decision", "PolicyResult",
    "AutoscalerPolicy",
]


class AutoscalerPolicy:
    """Pure policy; one instance is shared by the controller loop and the simulator."""

    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config or AutoscalerConfig()
        fresh = self.config.fresh_after_scale_up_s
        self._fresh_s = self.config.scale_down_after_s if fresh is None else fresh

    # -- entry point -----------------------------------------------------------------------
    def decide(self, state: AutoscalerState, obs: FleetObservation) -> PolicyResult:
        cfg, now = self.config, obs.now_s
        work = FleetScratch(obs)
        low_since, last_resize, lent = dict(state.low_since), dict(state.last_resize_at), dict(state.lent)
        age = {s.deployment: s.load_age_s for s in obs.serve}  # fresh on the figures' clock (_scale_down)
        fresh_until = {d: t for d, t in state.fresh_until.items() if t > now - age.get(d, 0.0)}
        reversal_s = max(cfg.scale_down_after_s, cfg.reversal_guard_s)
        scaled_down_at = {d: t for d, t in state.scaled_down_at.items() if now - t < reversal_s}
        scaling_to = dict(state.scaling_to)
        decisions: list[Decision] = []
        unmet: dict[str, int] = defaultdict(int)
        busy = False  # some deployment is short or at risk: do not grow training this tick
        for serve in sorted(obs.serve, key=lambda s: -s.ttft_p95_s / max(s.ttft_slo_s, 1e-9)):
            at_risk, why = self._at_risk(serve)
            have, unreported = self._have(serve, scaling_to, now)
            want = max(serve.desired_replicas, serve.min_replicas)
            # At risk with no replica on its way: add one. One already loading is the help on its
            # way; adding another every tick until it runs would over-lend (ticks are shorter
            # than a model load).
            if at_risk and want <= have and serve.pending_replicas == 0 and not unreported:
                want = have + 1
            want = min(want, serve.max_replicas)
            cap = queue_cap(work, obs.queue_limits, serve, have)  # a pool admitted through a queue
            want = want if cap is None else min(want, cap)
            busy = busy or at_risk or want > have or unreported
            if want > have:
                low_since.pop(serve.deployment, None)
                trigger = why or f"Serve wants {serve.desired_replicas} replicas, has {have}"
                # Reversing a scale-down: never by preempting an elastic job whole (module doc).
                work.whole_elastic = cfg.preempt_elastic_last_resort and serve.deployment not in scaled_down_at
                decision = self._scale_up(work, serve, have, want - have, now, trigger, last_resize, lent, unmet)
                if decision is not None:
                    take_queue_room(work, obs.queue_limits, serve, have, decision.target_replicas)
                    fresh_until[serve.deployment] = now + self._fresh_s
                    scaling_to[serve.deployment] = (decision.target_replicas, now)
            elif unreported:  # the shell has not shown the last scale-up yet: nothing to judge
                decision = None
            else:
                decision = self._scale_down(serve, want, at_risk, now, low_since, fresh_until)
                if decision is not None:
                    scaled_down_at[serve.deployment] = now
            if decision is not None:
                decisions.append(decision)
        decisions.extend(shrink_decisions(work))
        # While a job re-forms, free capacity includes accelerators it is about to take back:
        # growing anything onto them would make that formation wait.
        if cfg.grow_training and not busy and not any(t.resizing for t in obs.training):
            decisions.extend(self._grow(work, obs, now, last_resize, lent))
        requests, last_request = self._request_nodes(work, obs, unmet, state.last_request_at)
        decisions.extend(requests)
        new_state = AutoscalerState(low_since=low_since, last_resize_at=last_resize,
                                    lent={k: v for k, v in lent.items() if v > 0 and k in work.jobs},
                                    last_request_at=last_request, fresh_until=fresh_until,
                                    scaled_down_at=scaled_down_at, scaling_to=scaling_to)
        return PolicyResult(new_state, tuple(decisions))

    def _have(self, serve: ServeObservation, scaling_to: dict, now: float) -> tuple[int, bool]:
        """Replicas running or on their way, counting a scale-up no report shows yet (for at most
        ``report_lag_s``; ``scaling_to`` mutated), and whether one is unreported."""
        have = serve.running_replicas + serve.pending_replicas
        target, decided_at = scaling_to.get(serve.deployment, (0, -math.inf))
        if have >= target or now - decided_at >= self.config.report_lag_s:
            scaling_to.pop(serve.deployment, None)
            return have, False
        return target, True

    def _scale_up(self, work: FleetScratch, serve: ServeObservation, have: int, count: int, now: float, trigger: str,
                  last_resize: dict, lent: dict, unmet: dict) -> ScaleServe | None:
        """Free accelerators first, then lent ones; what neither covers is ``unmet`` (mutated)."""
        nodes = self._place_on_free(work, serve, count)
        if len(nodes) < count and self.config.lend:
            nodes += lend(work, serve, count - len(nodes), now, trigger, last_resize=last_resize, lent=lent,
                          restart_cost_s=self.config.restart_cost_s)
        if len(nodes) < count:
            unmet[serve.accelerator_type] += (count - len(nodes)) * serve.accelerators_per_replica
        if not nodes:
            return None
        # Shrunk jobs (not those preempted whole, which re-form only when grown) and jobs already
        # re-forming: the shell starts the replica once they hold their new layout.
        reforming = tuple(sorted(t.job_id for t in work.jobs.values() if t.accelerator_type == serve.accelerator_type
                                 and ((work.removed[t.job_id] and work.size[t.job_id] > 0)
                                      or (t.resizing and t.size > 0))))
        return ScaleServe(serve.deployment, have + len(nodes), tuple(nodes), (), f"{trigger}: +{len(nodes)} replica(s)",
                          reforming=reforming)

    def _scale_down(self, serve: ServeObservation, want: int, at_risk: bool, now: float,
                    low_since: dict, fresh_until: dict) -> ScaleServe | None:
        """Remove running replicas once load stayed low for a whole window that began a window
        after the last scale-up ran (``low_since``/``fresh_until`` mutated; see module doc)."""
        cfg = self.config
        have = serve.running_replicas + serve.pending_replicas
        if serve.pending_replicas:  # a replica on its way: the load at the size it makes is not seen yet
            fresh_until[serve.deployment] = now + self._fresh_s
        low = (want < have and not at_risk and serve.ttft_p95_s <= cfg.low_ttft_ratio * serve.ttft_slo_s)
        # Fresh until a window after the replicas ran, on the figures' own clock: figures read
        # now may describe the pool before the lent replica served (``load_age_s``).
        if not low or serve.pending_replicas or now - serve.load_age_s < fresh_until.get(serve.deployment, -math.inf):
            low_since.pop(serve.deployment, None)
            return None
        since = low_since.setdefault(serve.deployment, now)
        # Only running replicas above the minimum can go (see the module doc on hysteresis).
        drop = min(have - want, serve.running_replicas - serve.min_replicas)
        if now - since < cfg.scale_down_after_s or drop <= 0:
            return None
        running_nodes = serve.replica_nodes[:serve.running_replicas]
        remove = tuple(running_nodes[-drop:]) if running_nodes else ()
        low_since[serve.deployment] = now  # the next step down needs another full window
        return ScaleServe(serve.deployment, have - drop, (), remove,
                          f"load low for {now - since:.0f}s >= {cfg.scale_down_after_s:.0f}s "
                          f"(Serve wants {serve.desired_replicas}, has {have}): -{drop} replica(s)")

    def _request_nodes(self, work: FleetScratch, obs: FleetObservation, unmet: dict,
                       last_request: float) -> tuple[list[RequestNodes], float]:
        """Ask Ray's autoscaler for what Serve (and training waiting beside it) still lacks."""
        for kind, count in sorted(obs.pending_training_accelerators.items()):
            if not unmet.get(kind):
                continue
            free_kind = sum(n for node, n in work.free.items() if obs.node_type.get(node) == kind)
            if count > free_kind:
                unmet[kind] += count - free_kind
        out = []
        for kind, count in sorted(unmet.items()):
            if count > 0 and obs.now_s - last_request >= self.config.request_nodes_cooldown_s:
                bundle = max((s.accelerators_per_replica for s in obs.serve if s.accelerator_type == kind), default=1)
                out.append(RequestNodes(kind, count, bundle,
                                        f"Serve and training both starved for {kind}: {count} accelerator(s) short "
                                        "after free capacity and lendable training were used"))
                last_request = obs.now_s
        return out, last_request

    # -- inference side ---------------------------------------------------------------------
    def _at_risk(self, s: ServeObservation) -> tuple[bool, str]:
        cfg = self.config
        if s.ttft_p95_s > cfg.ttft_risk_ratio * s.ttft_slo_s:
            return True, f"TTFT p95 {s.ttft_p95_s:.2f}s > {cfg.ttft_risk_ratio:.0%} of SLO {s.ttft_slo_s:.2f}s"
        if s.queue_depth > cfg.queue_per_replica_risk * max(1, s.running_replicas):
            return True, f"queue depth {s.queue_depth:.0f} over {cfg.queue_per_replica_risk:.0f}/replica"
        if s.kv_usage > cfg.kv_usage_risk:
            return True, f"KV usage {s.kv_usage:.0%} > {cfg.kv_usage_risk:.0%}"
        return False, ""

    @staticmethod
    def _place_on_free(work: FleetScratch, serve: ServeObservation, count: int) -> list[str]:
        per = serve.accelerators_per_replica
        nodes: list[str] = []
        # Best fit: fill the fullest node that still takes a whole replica, keep empty nodes whole.
        fits = sorted((n for n, f in work.free.items() if f >= per and accelerator_type_matches(work, n, serve)),
                      key=lambda n: (work.free[n], n))
        for node in fits:
            while len(nodes) < count and work.free[node] >= per:
                work.free[node] -= per
                nodes.append(node)
            if len(nodes) == count:
                break
        return nodes

    # -- giving back: grow training ---------------------------------------------------------------
    def _grow(self, work: FleetScratch, obs: FleetObservation, now: float, last_resize: dict, lent: dict) -> list[GrowTraining]:
        out = []
        cfg = self.config
        queues = obs.queue_limits
        room = work.queue_room  # shared by the jobs and pools of a queue (see QueueGrowthLimits)
        # The cooldown bounds restarts of a running job; a paused one (preempted whole) makes no
        # progress at all, and resuming is the one restart it has to pay anyway.
        candidates = [t for t in obs.training if t.job_class is JobClass.ELASTIC and not work.removed.get(t.job_id)
                      and not t.resizing and t.size < t.max_size
                      and (t.paused or now - last_resize.get(t.job_id, -math.inf) >= cfg.job_resize_cooldown_s)]
        # Jobs that lent come first (their accelerators come back), then higher priority.
        candidates.sort(key=lambda t: (-lent.get(t.job_id, 0), -t.priority, t.job_id))
        smallest = min((t.replica_size for t in candidates), default=0)
        open_nodes = [n for n, f in work.free.items() if smallest and f >= smallest]
        # Accelerators each type may still give to growth: what is free beyond the queue's need and
        # beyond what admitted jobs were granted and do not hold yet (Ray shows those idle).
        budget = {kind: sum(f for n, f in work.free.items() if obs.node_type.get(n) == kind)
                  - (obs.pending_training_accelerators.get(kind, 0) if cfg.reserve_for_queue else 0)
                  - queues.promised.get(kind, 0)
                  for kind in {t.accelerator_type for t in candidates}}
        for t in candidates:
            if not open_nodes:
                break
            owed = lent.get(t.job_id, 0)
            waiting = obs.pending_training_accelerators.get(t.accelerator_type, 0)
            # With jobs waiting, a job grows back to what it was lent from, or to the size it asked
            # for (it was admitted smaller only because room was short; finishing running jobs
            # first shortens mean completion time), but never beyond, which would starve the queue.
            requested = max(t.admitted_size, t.max_size if self.config.grow_to_requested else t.admitted_size)
            limit = t.max_size if waiting == 0 else min(t.max_size, max(t.size + owed, requested))
            # A job admitted through a queue grows only as far as its queue may hold; each
            # accelerator above its grant takes from its queues' shared room.
            ceiling = queues.job_to_ceiling.get(t.job_id)
            limit = limit if ceiling is None else min(limit, ceiling)
            keys, granted = queues.job_to_limits.get(t.job_id, ()), queues.job_to_granted.get(t.job_id, math.inf)
            nodes: list[str] = []
            size = t.size
            if size + t.replica_size > limit:
                continue
            # Prefer nodes the job already uses (fewer cross-node hops), then the fullest node that fits.
            mine = {n for r in t.replica_nodes for n in r}
            for node in sorted((n for n in open_nodes if work.free[n] >= t.replica_size
                                and obs.node_type.get(n) == t.accelerator_type),
                               key=lambda n: (n not in mine, work.free[n], n)):
                while (size + t.replica_size <= limit and work.free[node] >= t.replica_size
                       and budget[t.accelerator_type] >= t.replica_size):
                    over = int(max(0, min(t.replica_size, size + t.replica_size - granted)))  # above its grant
                    if any(room[k] < over for k in keys):
                        break
                    for k in keys:
                        room[k] -= over
                    work.free[node] -= t.replica_size
                    budget[t.accelerator_type] -= t.replica_size
                    size += t.replica_size
                    nodes.append(node)
                if size + t.replica_size > limit:
                    break
            if t.paused and size < t.min_size:  # it can only resume at its gang minimum: leave the room
                for node in nodes:
                    work.free[node] += t.replica_size
                    budget[t.accelerator_type] += t.replica_size
                for k in keys:
                    room[k] += int(max(0, size - max(granted, t.size)))
                nodes, size = [], t.size
            open_nodes = [n for n in open_nodes if work.free[n] >= smallest]
            if not nodes:
                continue
            returned = min(owed, size - t.size)
            lent[t.job_id] = owed - returned
            last_resize[t.job_id] = now
            why = (f"give back {returned} lent accelerator(s)" if returned else "idle accelerators, no job waiting")
            if ceiling is not None:
                why += f"; its queue {t.queue} allows it up to {ceiling}"
            out.append(GrowTraining(t.job_id, size, tuple(nodes), f"grown {t.size}->{size}: {why}"))
        return out


def queue_cap(work: FleetScratch, limits: QueueGrowthLimits, serve: ServeObservation, have: int) -> int | None:
    """Most replicas pool ``serve`` may have by its queues' limits, never below ``have`` (a lowered
    quota does not scale a serving pool down); ``None`` for a pool outside the queues.

    Example: granted 16 H100 (2 replicas of 8), ceiling 24, room 8 under its queue's limit:
    3 replicas; another pool of the queue that took the 8 first in this step leaves 2.
    """
    ceiling = limits.job_to_ceiling.get(serve.pool_key) if serve.pool_key else None
    if ceiling is None:
        return None
    per = max(1, serve.accelerators_per_replica)
    granted = limits.job_to_granted.get(serve.pool_key, 0)
    room = min((work.queue_room.get(k, 0) for k in limits.job_to_limits.get(serve.pool_key, ())), default=math.inf)
    return max(have, int(min(ceiling, granted + room) // per))


def take_queue_room(work: FleetScratch, limits: QueueGrowthLimits, serve: ServeObservation, have: int,
                    target: int) -> None:
    """Charge a pool's scale-up from ``have`` to ``target`` replicas to its queues' shared room
    (``work.queue_room``, mutated): only accelerators above its grant count."""
    if not serve.pool_key or serve.pool_key not in limits.job_to_ceiling:
        return
    per = serve.accelerators_per_replica
    above = max(limits.job_to_granted.get(serve.pool_key, 0), have * per)
    for key in limits.job_to_limits.get(serve.pool_key, ()):
        work.queue_room[key] = work.queue_room.get(key, 0) - max(0, target * per - above)
