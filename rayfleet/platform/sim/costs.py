"""Modeled costs of the simulator, in one place, each labeled with where its number comes from.

``calibrated-local``: measured on the local fleet of this project (a real multi-node Ray 2.60
cluster on one 2-core CPU machine; docs/architecture.md, "Measured on the development machine").
``assumed``: a stated assumption for a production GPU fleet, to be replaced by measurements. The
lead updates these defaults with the local fleet's measured numbers (flash snapshot, Ray Train
restart, Serve replica start) as the other issues land; keep the labels honest when doing so.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    # -- training -------------------------------------------------------------------------
    # calibrated-local: Ray Train v2 resizes by a full worker-group restart from the latest
    # checkpoint; kill -> next step measured 9.7-11.5 s, fit() -> first step 18-22 s. A resize
    # stops every worker of the job for this long (all its accelerators lose this time).
    restart_s: float = 20.0
    # assumed: flash snapshot into node-local shared memory blocks the step for the copy only;
    # issue 6's goal is <= 0.1 s/GiB; a 70 GiB per-rank shard at that rate is ~7 s.
    snapshot_s: float = 7.0
    # assumed: workers of the shrunk replicas stop and release their accelerators (process exit,
    # CUDA context teardown) after the snapshot.
    teardown_s: float = 5.0
    # assumed: training takes a flash snapshot every 5 minutes (so a preemption that is not
    # preceded by a snapshot loses on average half of it, and the whole of it at worst).
    snapshot_interval_s: float = 300.0
    # assumed: a preempted job re-enters its queue and, once re-admitted, restarts (same as restart_s).

    # -- serving --------------------------------------------------------------------------
    # assumed: a Serve replica starts (actor + engine) and loads weights from node-local host
    # memory or NVMe. Median 15 s, lognormal spread sigma 0.5 (p99 ~ 48 s). The local fleet's
    # measured ``serve.run`` of a 4-deployment app was ~9 s (calibrated-local lower bound).
    model_load_median_s: float = 15.0
    model_load_sigma: float = 0.5
    # assumed: p95 TTFT of one replica = ttft_base_s / (1 - utilization) (an M/M/1-like curve);
    # the SLO is met while utilization stays below slo_utilization.
    ttft_base_s: float = 0.15
    ttft_slo_s: float = 1.0
    # Serve's own autoscaler aims at this utilization per replica (target ongoing requests).
    target_utilization: float = 0.7

    @property
    def slo_utilization(self) -> float:
        """Utilization at which p95 TTFT reaches the SLO under the model above."""
        return 1.0 - self.ttft_base_s / self.ttft_slo_s
