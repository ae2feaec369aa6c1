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
  over): neither says the replica is not needed. Seen live (1 s ticks, 3 s window): a low
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
- Every decision carries a human-readable ``reason``; the controller records it as an event.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict

from rayfleet.platform.autoscaler_types import (
    AutoscalerConfig, AutoscalerState, Decision, FleetObservation, GrowTraining, PolicyResult, RequestNodes,
    ScaleServe, ServeObservation, ShrinkTraining, TrainingObservation,
)
from rayfleet.platform.queues import JobClass

# The policy's vocabulary is re-exported: callers (the simulator, the shells) import it from here.
__all__ = [
    "ServeObservation", "TrainingObservation", "FleetObservation", "AutoscalerConfig", "AutoscalerState",
    "ShrinkTraining", "GrowTraining", "ScaleServe", "RequestNodes", "Decision", "PolicyResult",
    "AutoscalerPolicy",
]


_CLASS_RANK = {JobClass.ELASTIC: 0, JobClass.OPPORTUNISTIC: 1}  # 2: elastic preempted whole


class _Work:
    """Mutable scratch copy of the fleet for one ``decide`` call (never escapes it)."""

    def __init__(self, obs: FleetObservation) -> None:
        self.free = dict(obs.free_by_node)
        for serve in obs.serve:
            for node in serve.unplaced_nodes:
                self.free[node] = max(0, self.free.get(node, 0) - serve.accelerators_per_replica)
        self.node_type = obs.node_type
        self.reasons: dict[str, str] = {}
        self.jobs = {t.job_id: t for t in obs.training}
        self.size = {t.job_id: t.size for t in obs.training}
        self.removed: dict[str, list[int]] = defaultdict(list)
        self.freed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.whole_elastic = True  # the lend under way may preempt an elastic job whole (last resort)
        self._by_node: dict[str, list[tuple[str, int]]] | None = None

    @property
    def by_node(self) -> dict[str, list[tuple[str, int]]]:
        """node -> lendable (job, replica index); built only when lending is needed."""
        if self._by_node is None:
            self._by_node = defaultdict(list)
            for t in self.jobs.values():
                if t.job_class is JobClass.GUARANTEED:
                    continue
                for index, nodes in enumerate(t.replica_nodes):
                    for node in nodes:
                        self._by_node[node].append((t.job_id, index))
        return self._by_node


class AutoscalerPolicy:
    """Pure policy; one instance is shared by the controller loop and the simulator."""

    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config or AutoscalerConfig()
        fresh = self.config.fresh_after_scale_up_s
        self._fresh_s = self.config.scale_down_after_s if fresh is None else fresh

    # -- entry point -----------------------------------------------------------------------
    def decide(self, state: AutoscalerState, obs: FleetObservation) -> PolicyResult:
        cfg, now = self.config, obs.now_s
        work = _Work(obs)
        low_since, last_resize, lent = dict(state.low_since), dict(state.last_resize_at), dict(state.lent)
        fresh_until = {d: t for d, t in state.fresh_until.items() if t > now}
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
            busy = busy or at_risk or want > have or unreported
            if want > have:
                low_since.pop(serve.deployment, None)
                trigger = why or f"Serve wants {serve.desired_replicas} replicas, has {have}"
                # Reversing a scale-down: never by preempting an elastic job whole (module doc).
                work.whole_elastic = cfg.preempt_elastic_last_resort and serve.deployment not in scaled_down_at
                decision = self._scale_up(work, serve, have, want - have, now, trigger, last_resize, lent, unmet)
                if decision is not None:
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
        decisions.extend(self._shrink_decisions(work, now))
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

    def _scale_up(self, work: _Work, serve: ServeObservation, have: int, count: int, now: float, trigger: str,
                  last_resize: dict, lent: dict, unmet: dict) -> ScaleServe | None:
        """Free accelerators first, then lent ones; what neither covers is ``unmet`` (mutated)."""
        nodes = self._place_on_free(work, serve, count)
        if len(nodes) < count and self.config.lend:
            nodes += self._lend(work, serve, count - len(nodes), now, trigger, last_resize, lent)
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
        if not low or serve.pending_replicas or now < fresh_until.get(serve.deployment, -math.inf):
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

    def _request_nodes(self, work: _Work, obs: FleetObservation, unmet: dict,
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
    def _place_on_free(work: _Work, serve: ServeObservation, count: int) -> list[str]:
        per = serve.accelerators_per_replica
        nodes: list[str] = []
        # Best fit: fill the fullest node that still takes a whole replica, keep empty nodes whole.
        fits = sorted((n for n, f in work.free.items() if f >= per and _type_ok(work, n, serve)),
                      key=lambda n: (work.free[n], n))
        for node in fits:
            while len(nodes) < count and work.free[node] >= per:
                work.free[node] -= per
                nodes.append(node)
            if len(nodes) == count:
                break
        return nodes

    # -- lending: shrink training --------------------------------------------------------------
    def _job_cost(self, t: TrainingObservation, now: float, whole: bool) -> tuple:
        age = max(0.0, now - t.last_snapshot_at_s)
        if whole and t.job_class is JobClass.ELASTIC:  # last resort: snapshot, stop, requeue
            return (t.priority, 2, t.size * self.config.restart_cost_s)
        if whole:  # preempted: the work since the last snapshot is lost, then a restart
            lost = t.size * (age + self.config.restart_cost_s)
        else:  # flash snapshot first: only the survivors' restart is lost (plus exposure to a stale snapshot)
            lost = (t.size - t.replica_size) * self.config.restart_cost_s + 0.01 * age * t.size
        return (t.priority, _CLASS_RANK[t.job_class], lost)

    def _node_plan(self, work: _Work, node: str, deficit: int, now: float) -> tuple[tuple, list[tuple[str, int]]] | None:
        """Cheapest units on ``node`` freeing >= ``deficit`` there, with the plan's cost.

        A unit is one DP replica of an elastic job (kept >= its minimum) or a whole
        opportunistic job (index -1). Cost = (worst priority/class taken, total lost work).
        """
        units, seen = [], set()
        for job_id, index in work.by_node.get(node, ()):
            if index in work.removed[job_id]:
                continue
            t = work.jobs[job_id]
            whole = t.job_class is JobClass.OPPORTUNISTIC or (
                work.whole_elastic and work.size[job_id] - t.replica_size < t.min_size)
            if whole:
                if job_id in seen:
                    continue
                seen.add(job_id)
                here = sum(t.replica_size // len(n) for i, n in enumerate(t.replica_nodes)
                           if node in n and i not in work.removed[job_id])
                units.append((self._job_cost(t, now, True), job_id, -1, here))
            else:
                units.append((self._job_cost(t, now, False), job_id, index, t.replica_size // len(t.replica_nodes[index])))
        units.sort()
        got, taken, sizes, worst, total = 0, [], {}, (-math.inf,), 0.0
        for cost, job_id, index, here in units:
            if got >= deficit:
                break
            t = work.jobs[job_id]
            if index >= 0:
                left = sizes.get(job_id, work.size[job_id])
                if left - t.replica_size < t.min_size:
                    continue
                sizes[job_id] = left - t.replica_size
            taken.append((job_id, index))
            got += here
            worst = max(worst, cost[:2])
            total += cost[2]
        if got < deficit:
            return None
        return (worst + (total,), taken)

    def _lend(self, work: _Work, serve: ServeObservation, count: int, now: float, trigger: str,
              last_resize: dict, lent: dict) -> list[str]:
        per = serve.accelerators_per_replica
        placed: list[str] = []
        heap = []
        for node, holders in work.by_node.items():
            if holders and _type_ok(work, node, serve) and per > work.free.get(node, 0):
                plan = self._node_plan(work, node, per - work.free.get(node, 0), now)
                if plan:
                    heap.append((plan[0], node))
        heapq.heapify(heap)
        while len(placed) < count and heap:
            # Lazy re-evaluation: a plan may have gone stale when an earlier pick shrank the same job.
            cost, node = heapq.heappop(heap)
            deficit = per - work.free.get(node, 0)
            plan = self._node_plan(work, node, deficit, now) if deficit > 0 else ((), [])
            if plan is None:
                continue
            if plan[0] != cost and heap and plan[0] > heap[0][0]:
                heapq.heappush(heap, (plan[0], node))
                continue
            taken = plan[1]
            touched: set[str] = set()
            for job_id, index in taken:
                t = work.jobs[job_id]
                indices = range(len(t.replica_nodes)) if index < 0 else [index]
                for i in indices:
                    if i in work.removed[job_id]:
                        continue
                    work.removed[job_id].append(i)
                    for n in t.replica_nodes[i]:
                        share = t.replica_size // len(t.replica_nodes[i])
                        work.free[n] = work.free.get(n, 0) + share
                        work.freed[job_id][n] += share
                        if n != node and work.free[n] >= per and _type_ok(work, n, serve):
                            heapq.heappush(heap, ((), n))  # a whole preemption freed room elsewhere
                    work.size[job_id] -= t.replica_size
                last_resize[job_id] = now
                lent[job_id] = lent.get(job_id, 0) + (t.size if index < 0 else t.replica_size)
                touched.update(n for r in t.replica_nodes for n in r)
                work.reasons[job_id] = f"lend to {serve.deployment} ({trigger}) on {node}"
            assert work.free[node] >= per
            work.free[node] -= per
            placed.append(node)
            # The shrunk jobs' other nodes now offer different plans (e.g. a job at its minimum
            # can only go whole): re-price them, and this node for a further replica.
            for n in touched | {node}:
                deficit = per - work.free.get(n, 0)
                again = self._node_plan(work, n, deficit, now) if deficit > 0 else ((), [])
                if again is not None and _type_ok(work, n, serve):
                    heapq.heappush(heap, (again[0], n))
        return placed

    def _shrink_decisions(self, work: _Work, now: float) -> list[ShrinkTraining]:
        out = []
        reasons = work.reasons
        for job_id, indices in work.removed.items():
            if not indices:
                continue
            t = work.jobs[job_id]
            freed = dict(work.freed[job_id])
            new_size = max(0, work.size[job_id])
            verb = (f"preempted whole ({t.job_class.value}"
                    + (", last resort: at its minimum, snapshot first)" if t.job_class is JobClass.ELASTIC else ")")
                    if new_size == 0 else
                    f"shrunk {t.size}->{new_size} by {len(indices)} DP replica(s) after a flash snapshot")
            out.append(ShrinkTraining(job_id, new_size, tuple(sorted(indices)), freed,
                                      f"{verb}: {reasons.get(job_id, 'lend to Serve')}",
                                      snapshot_first=t.job_class is JobClass.ELASTIC))
        return out

    # -- giving back: grow training ---------------------------------------------------------------
    def _grow(self, work: _Work, obs: FleetObservation, now: float, last_resize: dict, lent: dict) -> list[GrowTraining]:
        out = []
        cfg = self.config
        # The cooldown bounds restarts of a running job; a paused one (preempted whole) makes no
        # progress at all, and resuming is the one restart it has to pay anyway.
        candidates = [t for t in obs.training if t.job_class is JobClass.ELASTIC and not work.removed.get(t.job_id)
                      and not t.resizing and t.size < t.max_size
                      and (t.paused or now - last_resize.get(t.job_id, -math.inf) >= cfg.job_resize_cooldown_s)]
        # Jobs that lent come first (their accelerators come back), then higher priority.
        candidates.sort(key=lambda t: (-lent.get(t.job_id, 0), -t.priority, t.job_id))
        smallest = min((t.replica_size for t in candidates), default=0)
        open_nodes = [n for n, f in work.free.items() if smallest and f >= smallest]
        # Accelerators each type may still give to growth: what is free beyond the queue's need.
        budget = {kind: sum(f for n, f in work.free.items() if obs.node_type.get(n) == kind)
                  - (obs.pending_training_accelerators.get(kind, 0) if cfg.reserve_for_queue else 0)
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
                nodes, size = [], t.size
            open_nodes = [n for n in open_nodes if work.free[n] >= smallest]
            if not nodes:
                continue
            returned = min(owed, size - t.size)
            lent[t.job_id] = owed - returned
            last_resize[t.job_id] = now
            why = (f"give back {returned} lent accelerator(s)" if returned else "idle accelerators, no job waiting")
            out.append(GrowTraining(t.job_id, size, tuple(nodes), f"grown {t.size}->{size}: {why}"))
        return out


def _type_ok(work: _Work, node: str, serve: ServeObservation) -> bool:
    return work.node_type.get(node, serve.accelerator_type) == serve.accelerator_type
