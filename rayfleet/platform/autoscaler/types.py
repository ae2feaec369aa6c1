"""What the shared autoscaler sees and decides: observations, decisions, config and state.

Every type here is a frozen dataclass with no Ray, clock or I/O behind it: the pure policy
(:mod:`rayfleet.platform.autoscaler.policy`) maps observations to decisions, the fleet controller
and the simulator feed it, and the shells (training, Serve) receive the *same decision objects*
across the Ray boundary (they pickle) and dispatch on their type with ``match``. Only the event
log flattens a decision into a JSON-able dict (``decision_detail``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Union

from rayfleet.platform.queues import JobClass

__all__ = [
    "ServeObservation", "TrainingObservation", "QueueGrowthLimits", "FleetObservation", "AutoscalerConfig",
    "AutoscalerState", "ShrinkTraining", "GrowTraining", "ScaleServe", "RequestNodes", "Decision", "PolicyResult",
    "InboxEntry", "decision_detail", "decision_subject",
]


@dataclass(frozen=True)
class ServeObservation:
    deployment: str
    accelerator_type: str
    accelerators_per_replica: int
    running_replicas: int
    desired_replicas: int  # what Serve's own autoscaler asks for at its target load
    pending_replicas: int = 0  # decided, not yet running (model loading)
    replica_nodes: tuple[str, ...] = ()  # node of each replica: running ones first, then pending
    min_replicas: int = 1
    max_replicas: int = 1 << 30
    queue_depth: float = 0.0  # requests waiting, all replicas
    ttft_p95_s: float = 0.0
    ttft_slo_s: float = 1.0
    kv_usage: float = 0.0  # 0..1, max over replicas
    # Nodes of decided replicas that do not hold their accelerators yet (a shell starts a replica
    # once the freed accelerator is really free). Their room is kept: nothing else grows into it.
    unplaced_nodes: tuple[str, ...] = ()
    # The pool's admission record name (``serve_admission.pool_key``) when it was admitted through
    # a queue: its key in ``QueueGrowthLimits``. Empty: the pool runs outside the queues.
    pool_key: str = ""
    # How old the load figures may be when observed (seconds): a pool whose load comes from
    # exported metrics (vLLM's, through Ray's agent) reads its state up to an export interval
    # plus the scrape's cache late. A scale-up's fresh period is judged on the figures' own time.
    load_age_s: float = 0.0


@dataclass(frozen=True)
class TrainingObservation:
    job_id: str
    queue: str
    accelerator_type: str
    job_class: JobClass
    size: int
    min_size: int
    max_size: int
    replica_size: int  # accelerators per DP replica
    replica_nodes: tuple[tuple[str, ...], ...]  # nodes of each DP replica (split evenly)
    priority: int = 0
    admitted_size: int = 0  # size it was started at (growth beyond needs an empty queue)
    last_snapshot_step: int = 0
    last_snapshot_at_s: float = 0.0
    # Stopping or re-forming: its accelerators look free for a while but are spoken for, and
    # it has no replicas to lend. The policy neither shrinks nor grows it until it runs again.
    # A job preempted whole and waiting (``paused``: size 0, not resizing) holds nothing and
    # re-forms only when grown, so it is not resizing.
    resizing: bool = False

    @property
    def paused(self) -> bool:
        """Preempted whole and waiting for accelerators (holds none, re-forms only when grown)."""
        return self.size == 0 and not self.resizing


@dataclass(frozen=True)
class QueueGrowthLimits:
    """How far the training jobs admitted through queues may grow, as the queues' rules allow.

    Computed outside the policy (:func:`rayfleet.platform.admission.growth_limits`, from the queue
    tree and the admission records, with ``queues.py``'s own functions), so the policy applies the
    queues' rules without a copy of them. Keys are the jobs' autoscaler ids (their names) and the
    Serve pools' ``pool_key``.

    - ``job_to_ceiling``: the most a governed job may hold if nothing else grows (0 for one that
      waits in its queue: only admission may start it again). A job not named here runs outside
      the queues and grows as before.
    - ``job_to_granted``: what admission counts the job as holding now; growth above it takes
      from the shared limits.
    - ``job_to_limits`` / ``limit_to_room``: the limits a job's growth counts against (each queue
      on its path with a borrow limit, the roots' governed quota, a guaranteed job's leaf quota)
      and how many more accelerators each still allows. Shared, so two jobs of one queue growing
      in one step do not together pass what the queue may hold.
    - ``promised``: accelerator type -> accelerators admitted jobs were granted and do not hold
      yet. Ray shows them idle; they are spoken for.
    """

    job_to_ceiling: Mapping[str, int] = field(default_factory=dict)
    job_to_granted: Mapping[str, int] = field(default_factory=dict)
    job_to_limits: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    limit_to_room: Mapping[str, int] = field(default_factory=dict)
    promised: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetObservation:
    now_s: float
    free_by_node: Mapping[str, int]
    node_type: Mapping[str, str]  # node -> accelerator type
    serve: tuple[ServeObservation, ...] = ()
    training: tuple[TrainingObservation, ...] = ()
    pending_training_accelerators: Mapping[str, int] = field(default_factory=dict)  # gang minimums waiting
    queue_limits: QueueGrowthLimits = field(default_factory=QueueGrowthLimits)  # empty: no job in a queue


@dataclass(frozen=True)
class ShrinkTraining:
    job_id: str
    new_size: int  # 0: preempted whole (opportunistic)
    replicas: tuple[int, ...]  # indices into replica_nodes that go away
    freed_by_node: Mapping[str, int]
    reason: str
    snapshot_first: bool = True

    @property
    def preempted(self) -> bool:
        return self.new_size == 0


@dataclass(frozen=True)
class GrowTraining:
    job_id: str
    new_size: int
    nodes: tuple[str, ...]  # one node per added DP replica
    reason: str


@dataclass(frozen=True)
class ScaleServe:
    deployment: str
    target_replicas: int
    add_on_nodes: tuple[str, ...]  # one node per added replica
    remove_from_nodes: tuple[str, ...]  # one node per removed replica
    reason: str
    # Training jobs that re-form around the accelerators this replica takes (shrunk, not
    # preempted whole, by this decision, or already re-forming): while they re-form all their
    # accelerators look free, so the shell starts the replica only once they hold their new
    # layout. Empty: nothing re-forms (free room, or lenders paused whole), start at once.
    reforming: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestNodes:
    accelerator_type: str
    num_accelerators: int
    bundle_size: int  # accelerators per bundle (one Serve replica or one DP replica)
    reason: str


Decision = Union[ShrinkTraining, GrowTraining, ScaleServe, RequestNodes]


@dataclass(frozen=True)
class AutoscalerConfig:
    ttft_risk_ratio: float = 0.8  # p95 TTFT above this share of the SLO = at risk
    queue_per_replica_risk: float = 8.0
    kv_usage_risk: float = 0.92
    low_ttft_ratio: float = 0.5  # load counts as low only while TTFT p95 is below this share
    scale_down_after_s: float = 900.0  # hysteresis window
    # How long a scale-up stays fresh after its replicas run (no low-load window starts before);
    # None: one ``scale_down_after_s``. Simulated (1,024 accelerators, 900 s window): fewer
    # resizes and preemptions, but lent accelerators go back later (mean JCT +5% at 80% load).
    fresh_after_scale_up_s: float | None = None
    # A scale-up within this long of the same deployment's scale-down (or within one hysteresis
    # window, if longer) reverses it: the lend that follows never preempts an elastic job whole
    # (see the policy's module doc). It covers the drain of the replica scaled down (the Serve
    # shell's ``drain_timeout_s``, 120 s), whose accelerator comes back on its own.
    reversal_guard_s: float = 120.0
    # A scale-up counts as on its way until a report shows it, for at most this long: the Serve
    # shell takes decisions on its own tick and reports after, so the next policy step may still
    # see the old report (seen live at load 80: the same lend decided twice, 1 s apart).
    report_lag_s: float = 30.0
    job_resize_cooldown_s: float = 600.0  # a resized job is not grown again sooner
    request_nodes_cooldown_s: float = 600.0
    restart_cost_s: float = 20.0  # modeled stop/restart of a resized job (for cost ranking)
    grow_training: bool = True
    lend: bool = True  # False: never shrink training for Serve (static split)
    # When shrinking elastic jobs to their minimum and preempting opportunistic ones is not
    # enough, preempt an elastic job at its minimum whole (after a flash snapshot) and requeue it.
    preempt_elastic_last_resort: bool = True
    # Jobs admitted below their requested size grow to it before queued jobs are admitted.
    grow_to_requested: bool = False
    # Free accelerators the queued training needs (its gang minimums) are left to admission:
    # training grows, lent accelerators included, only with what is free beyond them. Off (the
    # earlier rule: lenders first), arrivals waited behind give-backs; simulated at 60% offered
    # load, 1,024 accelerators, a week: mean/p95 JCT 2.6/16.4 h against Kueue's 1.7/4.1 h.
    reserve_for_queue: bool = True


@dataclass(frozen=True)
class AutoscalerState:
    low_since: Mapping[str, float] = field(default_factory=dict)
    last_resize_at: Mapping[str, float] = field(default_factory=dict)
    lent: Mapping[str, int] = field(default_factory=dict)  # job -> accelerators lent to Serve
    last_request_at: float = -math.inf
    # deployment -> until when its load readings cannot start a low-load window (a scale-up
    # on its way, then one window after its replicas run)
    fresh_until: Mapping[str, float] = field(default_factory=dict)
    scaled_down_at: Mapping[str, float] = field(default_factory=dict)  # deployment -> last scale-down
    # deployment -> (replicas a scale-up decided, when) until a report shows them
    scaling_to: Mapping[str, tuple[int, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyResult:
    state: AutoscalerState
    decisions: tuple[Decision, ...]



@dataclass(frozen=True)
class InboxEntry:
    """A decision waiting in a shell's inbox at the controller, with when it was taken
    (wall time: the shells measure decision-to-running handover from it)."""

    decision: Decision
    decided_at_s: float


def decision_subject(decision: Decision) -> str:
    """Whom a decision is about: the job id, the deployment, or the accelerator type asked for."""
    match decision:
        case ShrinkTraining(job_id=job) | GrowTraining(job_id=job):
            return job
        case ScaleServe(deployment=deployment):
            return deployment
        case RequestNodes(accelerator_type=kind):
            return kind
    raise TypeError(f"not an autoscaler decision: {decision!r}")


def decision_detail(decision: Decision) -> dict:
    """JSON-able fields of a decision, with its type's name (for the event log only)."""
    out = {"type": type(decision).__name__}
    for name in decision.__dataclass_fields__:
        value = getattr(decision, name)
        out[name] = dict(value) if isinstance(value, Mapping) else list(value) if isinstance(value, tuple) else value
    return out
