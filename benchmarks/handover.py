"""Live handover: the shared autoscaler lends an elastic job's accelerator to Serve; each phase timed.

A local fleet of two 2-accelerator nodes: a colocated Serve pool's base replica holds one
accelerator, an elastic training job (2..3 workers) the other three. Each run starts the job, sends
a burst of streamed requests until the autoscaler lends one accelerator (ShrinkTraining +
ScaleServe), lets the burst end, waits for the accelerator to come back (the job grows back), and
stops the job. Phases, from the fleet's events and the Serve shell's history (wall clock, seconds
after the ShrinkTraining decision):

  stopped      the job's formation ended (all ranks after the same step; flash snapshot flushed)
  re-formed    the next formation was sized and its placement group asked for
  placed       nothing but the lent accelerator was free: the pool's bounds were raised
  serving      the lent replica RUNNING in Serve (the handover)
  job stepping the job's first step at the smaller size

Baseline, measured in the same run on the same fleet: the pool grows by one replica onto an
accelerator that is already free (no lending): what a handover would cost if training gave its
accelerator back instantly. ``--calibration FILE`` writes the phase p50s in the form the simulator
reads (``rayfleet.platform.sim.costs.CostModel.calibrated``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Goal, Table, cpu_name, record_run  # noqa: E402

SPEC_NAME = "bench-handover"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str, poll_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(poll_s)
    raise RuntimeError(f"handover benchmark: timed out after {timeout_s:g}s waiting for {what}")


def _burst(base_url: str, api_key: str | None, stop: threading.Event, clients: int = 6) -> list[threading.Thread]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0, timeout=120)

    def run(index: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                for _ in client.completions.create(model="tiny", prompt=f"def f{index}_{n}(x):\n", max_tokens=16,
                                                   temperature=0, stream=True):
                    pass
            except Exception:  # noqa: BLE001 - the benchmark times phases; the cluster test counts failures
                time.sleep(0.2)
            n += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def baseline_scale_up(app: str, role: str) -> float:
    """Seconds for the pool to grow 1 -> 2 replicas onto a free accelerator, then back to 1."""
    from rayfleet.serving.serve_scaling_shell import _running_replicas
    from rayfleet.serving.deploy.pool_scaling import set_pool_bounds

    started = time.time()
    set_pool_bounds(app, role, min_replicas=2, max_replicas=2)
    _wait(lambda: _running_replicas(app, role) == 2, 300, "the baseline replica")
    took = time.time() - started
    set_pool_bounds(app, role, min_replicas=1, max_replicas=1)
    _wait(lambda: _running_replicas(app, role) == 1, 300, "the baseline replica removed")
    return took


def phases_of(events: list, shell_history: list[dict], job: str) -> dict[str, float]:
    """Seconds after the ShrinkTraining decision for each phase (see module doc); pure."""
    subject = f"job:{job}"
    shrink = [e for e in events if e.kind == "autoscaler_ShrinkTraining"]
    if not shrink:
        raise RuntimeError(f"no ShrinkTraining decision among {[e.kind for e in events]}")
    t0 = shrink[0].ts
    after = [e for e in events if e.ts >= t0 and e.subject == subject]

    def first(kind: str) -> float | None:
        hits = [e.ts for e in after if e.kind == kind]
        return min(hits) - t0 if hits else None

    lent = [h for h in shell_history if h.get("running_at")]
    resized = [e for e in after if e.kind == "autoscaler_training_resized"]
    return {"stopped": first("formation_stopped"), "re-formed": first("elastic_reform"),
            "placed": (lent[0]["placed_at"] - t0) if lent and lent[0].get("placed_at") else None,
            "serving": (lent[0]["running_at"] - t0) if lent else None,
            "job stepping": (resized[0].ts - t0) if resized else None}


def one_run(sdk, served, shell, dataset: str, ckpt: str, index: int, *, give_back: bool = True) -> dict[str, float]:
    """One lend; ``give_back``: also wait for the replica's removal and the job's grow-back (the
    next run needs the accelerator back; a last run can stop the job right away)."""
    spec = {"name": f"{SPEC_NAME}-{index}", "model": {"preset": "tiny", "seed": 0},
            "data": {"uri": dataset, "seq_len": 64}, "plan": {}, "precision": "fp32", "steps": 5000,
            "global_batch_size": 12, "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1},
            "resources": {"accelerator": "H100", "elastic": {"min_workers": 2, "max_workers": 3}},
            "checkpoint": {"every_n_steps": 1, "persist_every": 1, "uri": os.path.join(ckpt, str(index))}}
    Path(ckpt).mkdir(parents=True, exist_ok=True)
    history_before = len(shell.history())
    run = sdk.train(spec)
    try:
        _wait(lambda: len(run.metrics()) >= 2 or run.status() in ("FAILED", "STOPPED"), 300, "the job's first steps")
        if "on 3 workers" not in run.logs():
            raise RuntimeError(f"the job should start on 3 workers:\n{run.logs()[-2000:]}")
        stop = threading.Event()
        threads = _burst(served.openai_base_url, served.api_key, stop)
        try:
            _wait(lambda: any(h["running_at"] for h in shell.history()[history_before:])
                  or run.status() in ("FAILED", "STOPPED"), 300, "a lent replica serving")
            time.sleep(6)  # the burst goes on against two replicas, then ends (as in the cluster test)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        _wait(lambda: "autoscaler_training_resized" in {e.kind for e in sdk.events(limit=60)
                                                        if e.subject == f"job:{spec['name']}"}, 300,
              "the job's first step at the smaller size")
        history = shell.history()[history_before:]
        if give_back:
            _wait(lambda: all(h["removed_at"] for h in shell.history()[history_before:]), 180,
                  "the lent replica removed")
            _wait(lambda: "with 3 workers" in run.logs().split("formation 1", 1)[-1] or run.status() != "RUNNING",
                  300, "the job grown back")
        events = [e for e in sdk.events(limit=400) if e.ts >= run_started(run)]
        Path(ckpt, f"job-{index}.log").write_text(run.logs())  # for a look at where the time went
        return phases_of(events, history, spec["name"])
    finally:
        run.cancel()
        _wait(lambda: run.status() in ("STOPPED", "FAILED", "SUCCEEDED"), 120, "the job stopped")


def run_started(run) -> float:
    info = run.info()
    start_ms = getattr(info, "start_time", None) or 0
    return start_ms / 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run (default: 3)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/handover.json"))
    parser.add_argument("--calibration", type=Path, default=None,
                        help="also write the phase p50s for the simulator (rayfleet/platform/sim/handover_calibration.json)")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)

    from ray import serve

    from rayfleet.platform.launcher import LocalFleet
    from rayfleet.platform.topology import build_topology
    from rayfleet.sdk import connect
    from rayfleet.storage.tokens import prepare_token_dataset

    work = tempfile.mkdtemp(prefix="rayfleet-handover-")
    print(f"work directory (job logs): {work}", flush=True)
    dataset = os.path.join(work, "tokens")
    prepare_token_dataset([os.path.join(os.path.dirname(os.__file__), "json")], dataset, shard_tokens=1 << 15,
                          seq_len=128)
    topology = build_topology(num_nodes=2, accelerator="H100", accelerators_per_node=2)
    local = LocalFleet.up(topology, home=os.path.join(work, "home"))
    rows, shell, served, load = [], None, None, os.getloadavg()[0]
    try:
        sdk = connect(local.address)
        _wait(lambda: len(sdk.status().nodes) == 2 and all(r.health == "healthy" for r in sdk.status().nodes), 120,
              "healthy agents")
        served = sdk.serve({"name": "handover", "mode": "colocated", "model": {"preset": "tiny", "seed": 0},
                            "colocated": {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"},
                            "engine": {"num_blocks": 128, "max_num_seqs": 8}, "http": {"port": _free_port()}})
        baseline = baseline_scale_up(served.spec.name, "colocated")
        print(f"baseline: the pool grows onto a free accelerator in {baseline:.1f}s", flush=True)
        sdk.start_autoscaler(interval_s=1.0, scale_down_after_s=3.0, job_resize_cooldown_s=5.0)
        shell = sdk.autoscale_serve(served, ttft_slo_s=2.0, target_ongoing_requests=2, max_replicas=2,
                                    window_s=3.0, interval_s=1.0)
        for i in range(runs):
            rows.append(one_run(sdk, served, shell, dataset, os.path.join(work, "ckpt"), i, give_back=i < runs - 1))
            print(f"run {i + 1}/{runs}: " + ", ".join(f"{k} {v:.1f}s" for k, v in rows[-1].items() if v is not None),
                  flush=True)
    finally:
        if shell is not None:
            shell.stop()
        if served is not None:
            served.shutdown()
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001 - the fleet goes down next anyway
            pass
        local.down()
    p50 = {k: statistics.median([r[k] for r in rows if r.get(k) is not None])
           for k in rows[0] if any(r.get(k) is not None for r in rows)}
    print(f"\nlive handover on a local fleet ({cpu_name()}, {os.cpu_count()} cores, load {load:.1f} at start), "
          f"{runs} run(s); seconds after the ShrinkTraining decision:")
    print(f"{'phase':<14}" + "".join(f"{'run ' + str(i + 1):>9}" for i in range(runs)) + f"{'p50':>9}")
    for k in p50:
        print(f"{k:<14}" + "".join(f"{r[k]:>9.1f}" if r.get(k) is not None else f"{'-':>9}" for r in rows)
              + f"{p50[k]:>9.1f}")
    print(f"{'baseline':<14}{'':>{9 * runs}}{baseline:>9.1f}   (a replica onto an already free accelerator)")
    print(f"handover p50 {p50.get('serving', float('nan')):.1f}s (goal <= 30 s); lending adds "
          f"{p50.get('serving', float('nan')) - baseline:.1f}s over the baseline")
    result = {"runs": rows, "p50": p50, "baseline_scale_up_s": baseline, "cpu": cpu_name(),
              "cores": os.cpu_count(), "load_at_start": load}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    if args.calibration:
        from rayfleet.platform.sim.costs import write_handover_calibration

        write_handover_calibration(args.calibration, p50, baseline_scale_up_s=baseline,
                                   source=f"benchmarks/handover.py, {runs} run(s), {cpu_name()}, "
                                          f"{time.strftime('%Y-%m-%d')}")
        print(f"calibration for the simulator written to {args.calibration}")
    phases = Table(["phase", *(f"run {i + 1}" for i in range(runs)), "p50"],
                   [[k, *(f"{r[k]:.1f}" if r.get(k) is not None else "-" for r in rows), f"{p50[k]:.1f}"] for k in p50]
                   + [["baseline: a replica onto a free accelerator", *([""] * runs), f"{baseline:.1f}"]])
    record_run(name="handover", quick=args.quick, params={"runs": runs},
               figures={"runs": rows, "p50": p50, "baseline_scale_up_s": baseline},
               goals=[Goal("handover p50 s (decision to lent replica serving)", "<=", 30, p50.get("serving"))],
               tables={"phases": phases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
