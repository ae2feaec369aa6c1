"""Modeled costs of the simulator, in one place, each labeled with where its number comes from.

``calibrated-local``: measured on the local fleet of this project (a real multi-node Ray 2.60
cluster on one 2-core CPU machine; docs/architecture.md, "Measured on the development machine").
``assumed``: a stated assumption for a production GPU fleet, to be replaced by measurements. The
lead updates these defaults with the local fleet's measured numbers (flash snapshot, Ray Train
restart, Serve replica start) as the other issues land; keep the labels honest when doing so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from rayfleet.errors import SpecError

__all__ = ["CostModel", "HANDOVER_CALIBRATION", "write_handover_calibration"]

# Written by ``benchmarks/handover.py --calibration``: the live handover's phase p50s on the
# local fleet, mapped onto the cost model's fields (see ``write_handover_calibration``).
HANDOVER_CALIBRATION = Path(__file__).with_name("handover_calibration.json")


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

    @classmethod
    def calibrated(cls, path: str | Path = HANDOVER_CALIBRATION) -> tuple["CostModel", str]:
        """The default model with the handover costs measured live (``benchmarks/handover.py``),
        and where they come from. No file: the defaults, labelled as such."""
        path = Path(path)
        if not path.is_file():
            return cls(), "defaults (no handover calibration file; run benchmarks/handover.py --calibration)"
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        costs = data.get("costs", {})
        bad = sorted(k for k, v in costs.items() if k not in known or not (isinstance(v, (int, float)) and v >= 0))
        if bad:
            raise SpecError(f"{path}: costs", bad, "unknown field or not a non-negative number",
                            "re-write it with benchmarks/handover.py --calibration")
        return replace(cls(), **costs), f"calibrated-local: {data.get('source', path.name)}"


def write_handover_calibration(path: str | Path, phases_p50_s: dict[str, float], *, baseline_scale_up_s: float,
                               source: str) -> dict:
    """Map the live handover's phases (seconds after the ShrinkTraining decision) onto the cost
    model and write them where ``CostModel.calibrated`` reads them:

    - ``snapshot_s``: decision -> the formation let go (its last step ends, the snapshot is flushed);
    - ``teardown_s``: -> the lender holds its smaller layout (only the lent accelerator free);
    - ``model_load_median_s``: -> the lent replica serving (its start, beside the re-forming job);
    - ``restart_s``: formation let go -> the job's first step at the new size.
    """
    need = ("stopped", "placed", "serving", "job stepping")
    missing = [k for k in need if phases_p50_s.get(k) is None]
    if missing:
        raise SpecError("phases_p50_s", missing, "phases missing from the handover measurement",
                        "re-run benchmarks/handover.py until every phase is seen")
    p = phases_p50_s
    costs = {"snapshot_s": round(p["stopped"], 2), "teardown_s": round(max(0.0, p["placed"] - p["stopped"]), 2),
             "model_load_median_s": round(max(0.0, p["serving"] - p["placed"]), 2),
             "restart_s": round(max(0.0, p["job stepping"] - p["stopped"]), 2)}
    data = {"source": source, "phases_p50_s": {k: round(v, 2) for k, v in p.items()},
            "baseline_scale_up_s": round(baseline_scale_up_s, 2), "costs": costs}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data
