"""The parallelisms added for issue 28 run as live Ray Train jobs on the shared fleet.

Interleaved 1F1B (PP2 x VP2), DualPipeV (PP2), context parallelism (CP2) and expert-tensor
parallelism inside expert parallelism (EP2 x ETP2 over DP4 with ZeRO-2, 4 workers: each expert's
hidden units split over two ranks after the EP dispatch; gradients and optimizer states sharded,
parameters kept whole between steps) each train the same 4-layer tiny MoE for a few steps
from the same seed on the same data order, submitted through the SDK like any job, all at once
against a plain DP2 reference run on local gloo ranks (``conftest.local_reference``: the same
``train_worker``, without a fifth Ray job's start; a new kind adds a job, not a fleet start).
Asserted: every job SUCCEEDED with one metrics row per step, its log names the plan it ran, and
every step's loss equals the reference's (fp32; the gloo parity tests in tests/unit/jobs check
gradients, this checks the path users run). Checked against a broken ETP (the reduce-scatter of
partial expert outputs left out, ``etp_control="no_reduce"`` made the default): the etp job's
step-2 loss was 6.0282 against the reference's 6.0199 and the test failed.
"""

from __future__ import annotations

import math

import pytest

from .conftest import local_reference

pytestmark = pytest.mark.cluster

STEPS = 3
REFERENCE_PLAN = {"dp": 2, "ep": 1}
KINDS = {
    "interleaved": ({"pp": 2, "vpp": 2, "dp": 1, "ep": 1, "micro_batch_size": 1}, "PP2 VP2"),
    "dualpipev": ({"pp": 2, "dualpipe": True, "dp": 1, "ep": 1, "micro_batch_size": 1}, "DualPipeV"),
    "cp": ({"cp": 2, "dp": 1, "ep": 1}, "CP2"),
    "etp": ({"dp": 4, "ep": 2, "etp": 2, "zero_stage": 2}, "EP2 ETP2", "ZeRO-2"),
}


def _spec(dataset: str, kind: str) -> dict:
    plan = REFERENCE_PLAN if kind == "reference" else KINDS[kind][0]
    workers = plan.get("tp", 1) * plan.get("cp", 1) * plan.get("pp", 1) * plan["dp"]
    return {"name": f"kinds-{kind}", "model": {"preset": "tiny", "seed": 0, "config": {"num_layers": 4}},
            "data": {"uri": dataset, "seq_len": 64}, "plan": plan, "precision": "fp32", "steps": STEPS,
            "global_batch_size": 4, "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1},
            "resources": {"accelerator": "H100", "num_workers": workers}}


def test_interleaved_dualpipev_cp_and_etp_jobs_train_like_the_dp_reference(local_fleet, dataset):
    sdk = local_fleet.sdk
    runs = {kind: sdk.train(_spec(dataset, kind)) for kind in KINDS}  # all at once: their start-ups overlap
    by_step, _ = local_reference(_spec(dataset, "reference"))  # while they start
    losses = {}
    for kind, run in runs.items():
        status = run.wait(timeout_s=600)
        logs = run.logs()
        assert status == "SUCCEEDED", f"{kind}: {status}\n{logs[-3000:]}"
        for marker in KINDS[kind][1:]:
            assert marker in logs, f"{kind}: the log does not name the plan's {marker!r}\n{logs[-2000:]}"
        table = run.metrics()
        assert list(table["step"]) == list(range(1, STEPS + 1)), kind
        losses[kind] = [float(x) for x in table["loss"]]
        assert all(math.isfinite(x) for x in losses[kind]), (kind, losses[kind])
    reference = [by_step[step] for step in range(1, STEPS + 1)]
    for kind, values in losses.items():
        assert values == pytest.approx(reference, rel=1e-4), (kind, values, reference)
