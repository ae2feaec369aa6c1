"""The shared autoscaler on the local fleet: training lends an accelerator to Serve and gets it back.

Two small 2-accelerator nodes hold everything (the big nodes are cordoned): a colocated Serve
deployment's base replica takes one accelerator, an elastic training job (2..4 workers) the other
three. A bounded burst of streamed requests makes the controller's policy shrink the job by one DP
replica (after a flash snapshot) and, once the job holds its new layout, Serve's pool grows onto
the freed accelerator; when the burst is over and the hysteresis has passed, Serve scales down
(draining the replica it picks) and the job grows back to 3 workers. The test then stops the job.

Measured and printed: decision-to-replica-running handover time, the share of requests within
the TTFT SLO, failed requests. Asserted: no failed request, both decisions and the handover
happened with their reasons in `rayfleet status`, and exact step accounting: every step 1..N is
reported exactly once and its global batch is exactly the uninterrupted run's (sample-id hash
per step), with finite, falling loss.
"""

from __future__ import annotations

import collections
import socket
import time

import pytest

from live_helpers import Burst

from .conftest import wait_until

pytestmark = pytest.mark.cluster

# The job runs until the test has seen the whole cycle (shrink, lend, drain, grow back) and a few
# steps after it, then the test stops it: its length is a ceiling, not a timing bet (a step takes
# 0.1-3 s on 2 cores depending on the burst; 40 steps ended before the grow-back, 200 steps were
# still running 10 min in on CI).
STEPS = 2000
GLOBAL_BATCH = 12  # divisible by 4, 3 and 2 workers
TTFT_SLO_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expected_hashes(dataset: str, spec: dict, last: int) -> dict[int, int]:
    """Each step's global batch in an uninterrupted run (the data order is a pure function)."""
    from rayfleet.jobs.data import SampleOrder, TokenSamples
    from rayfleet.jobs.loop import sample_ids_hash

    samples = TokenSamples(dataset, spec["data"]["seq_len"])
    order = SampleOrder(samples.num_samples, seed=0, chunk=samples.samples_per_shard,
                        window_chunks=max(1, samples.cached_shards // 2))
    return {step: sample_ids_hash(order.ids((step - 1) * GLOBAL_BATCH, GLOBAL_BATCH).tolist())
            for step in range(1, last + 1)}


def _assert_control_actors_on_the_driver_node(dashboard_url: str) -> None:
    """The job's elastic signal and metrics queue live where Ray Train's controller does (the
    driver's node), never on a worker node whose loss would orphan them from a running job."""
    from ray.util.state import list_actors

    def nodes(class_name: str) -> set:
        return {a.node_id for a in list_actors(address=dashboard_url, limit=1000,
                                               filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])}

    controller = nodes("TrainController")
    assert len(controller) == 1, controller
    assert nodes("ElasticSignal") == controller and nodes("_QueueActor") == controller, \
        (nodes("ElasticSignal"), nodes("_QueueActor"), controller)


def test_burst_lends_an_accelerator_from_training_to_serve_and_back(local_fleet, dataset, tmp_path):
    from ray import serve

    from rayfleet.platform.status_table import render_status
    from rayfleet.platform.topology import NodeTopology

    sdk, fleet = local_fleet.sdk, local_fleet.fleet
    served = None
    small = [NodeTopology(name=f"n{7 - i:04d}", accelerator_type="H100", num_accelerators=2, rack="r07",
                          block="b7", nvlink_domain=f"nvl-n{7 - i:04d}") for i in range(2)]
    big = [n.name for n in local_fleet.topology.nodes]
    shell = None
    spec = {"name": "tiny-lender", "model": {"preset": "tiny", "seed": 0}, "data": {"uri": dataset, "seq_len": 64},
            "plan": {}, "precision": "fp32", "steps": STEPS, "global_batch_size": GLOBAL_BATCH,
            "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1},
            "resources": {"accelerator": "H100", "elastic": {"min_workers": 2, "max_workers": 4}},
            "checkpoint": {"every_n_steps": 1, "persist_every": 1, "uri": str(tmp_path / "ckpt")}}
    try:
        for node in small:
            fleet.add_node(node)
        for name in big:  # Serve and training only on the small nodes
            sdk.cordon(name, "test: the autoscaler works on the small nodes")
        # The base replica takes one of the 4 small accelerators and the job the other 3. Serve picks
        # which replica it stops when it scales down: with every replica on the small nodes, the
        # accelerator it frees is one the job can grow back onto (a freed one on a cordoned node is
        # held by the cordon).
        served = sdk.serve({"name": "burst", "mode": "colocated", "model": {"preset": "tiny", "seed": 0},
                            "colocated": {"replicas": 1, "accelerators_per_replica": 1, "accelerator_type": "H100"},
                            "engine": {"num_blocks": 128, "max_num_seqs": 8}, "http": {"port": _free_port()}})
        sdk.start_autoscaler(interval_s=1.0, scale_down_after_s=3.0, job_resize_cooldown_s=5.0)
        shell = sdk.autoscale_serve(served, ttft_slo_s=TTFT_SLO_S, target_ongoing_requests=2, max_replicas=2,
                                    window_s=3.0, interval_s=1.0)
        run = sdk.train(spec)
        steps = lambda: [int(r["step"]) for r in run.metrics().rows]  # noqa: E731
        wait_until(lambda: len(steps()) >= 2 or run.status() in ("FAILED", "STOPPED"), timeout_s=300,
                   interval_s=0.5, what="the job's first steps at 3 workers")
        assert "on 3 workers" in run.logs(), run.logs()[-3000:]
        _assert_control_actors_on_the_driver_node(local_fleet.dashboard_url)

        burst = Burst(served.openai_base_url, clients=6, api_key=served.api_key, model="tiny", max_tokens=16,
                      prompt=lambda i, n: f"def f{i}_{n}(x):\n").start()
        try:
            try:
                # A deadline, not the goal: on 2 loaded cores the replica's process start competes
                # with the job's re-formation (66 s measured on the dev machine; CI runs slower).
                wait_until(lambda: any(h["running_at"] for h in shell.history()) or run.status() in ("FAILED", "STOPPED"),
                           timeout_s=300, interval_s=0.5, what="a lent Serve replica running")
            except AssertionError as err:
                raise AssertionError(f"{err}\nshell saw {shell.observation()}\nhistory {shell.history()}\n"
                                     f"events {[(e.kind, e.cause) for e in sdk.events(limit=30)]}\n"
                                     f"job log {run.logs()[-3000:]}") from None
            lent_at = time.monotonic()
            time.sleep(6)  # the burst goes on against two replicas
        finally:
            burst.join()
        served_by_two = sum(1 for r in burst.results if r["end"] > lent_at)
        wait_until(lambda: all(h["removed_at"] for h in shell.history()), timeout_s=180, interval_s=0.5,
                   what="the lent replica drained and removed after the burst")
        try:
            wait_until(lambda: "formation 2 with 3 workers" in run.logs() or run.status() in ("FAILED", "STOPPED"),
                       timeout_s=300, interval_s=1.0, what="the job grown back to 3 workers")
            regrown = max(steps())
            wait_until(lambda: max(steps()) >= regrown + 3 or run.status() in ("FAILED", "STOPPED"),
                       timeout_s=180, interval_s=0.5, what="steps after the grow-back")
        except AssertionError as err:
            raise AssertionError(f"{err}\nhistory {shell.history()}\n"
                                 f"events {[(e.kind, e.cause) for e in sdk.events(limit=30)]}\n"
                                 f"job log {run.logs()[-3000:]}") from None
        assert run.status() == "RUNNING", run.logs()[-4000:]
        run.cancel()
        wait_until(lambda: run.status() in ("STOPPED", "FAILED", "SUCCEEDED"), timeout_s=120, interval_s=1.0,
                   what="the job stopped")
        logs = run.logs()
        history = shell.history()
        decisions = sdk.autoscaler_decisions(limit=50)
        status_text = render_status(sdk.status())
    finally:
        if shell is not None:
            shell.stop()
        sdk.stop_autoscaler()
        if served is not None:
            served.shutdown()
        for app in list(serve.status().applications):
            if app.startswith("burst--"):
                serve.delete(app)
        serve.shutdown()  # leave the fleet as we found it: the next module starts Serve on its own port
        for name in big:
            sdk.uncordon(name)
        for node in small:
            try:
                fleet.kill_node(node.name)
            except Exception:  # noqa: BLE001 - already dead
                pass

    # -- what happened ------------------------------------------------------------------------
    results = burst.results
    failed = [r for r in results if r["error"] or r["chars"] == 0]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    within = sum(1 for t in ttfts if t <= TTFT_SLO_S) / max(1, len(ttfts))
    handover = [h["handover_s"] for h in history if h["handover_s"] is not None]
    print(f"\nautoscaler burst: {len(results)} requests ({served_by_two} after the handover), {len(failed)} failed; "
          f"{within:.0%} within the TTFT SLO of {TTFT_SLO_S:g}s (p50 {sorted(ttfts)[len(ttfts) // 2]:.2f}s)")
    print(f"handover (decision -> lent replica serving): {', '.join(f'{h:.1f}s' for h in handover)}")
    for e in decisions:
        print(f"  {e.subject:<18} {e.kind:<34} {e.cause}")
    kinds = [e.kind for e in decisions]

    assert not failed, failed[:3]
    assert len(history) == 1 and handover, history  # one accelerator lent, not a cascade
    assert "autoscaler_ShrinkTraining" in kinds and "autoscaler_GrowTraining" in kinds, kinds
    # up during the burst, down after it (the controller's log also holds earlier modules' apps)
    ours = [e.cause for e in decisions if e.kind == "autoscaler_ScaleServe" and e.subject == "burst"]
    assert len(ours) == 2, [(e.subject, e.kind, e.cause) for e in decisions]
    assert "autoscaler_handover" in kinds and "autoscaler_replica_removed" in kinds, kinds
    assert "autoscaler decisions:" in status_text and "ShrinkTraining" in status_text
    assert history[0]["node"] in {n.name for n in small}
    # the job shrank to 2 workers and grew back to 3
    assert "formation 1 with 2 workers" in logs and "formation 2 with 3 workers" in logs, logs[-4000:]
    # exact step accounting: every step up to the last once, each with the uninterrupted run's global batch
    rows = run.metrics().rows
    counts = collections.Counter(int(r["step"]) for r in rows)
    last = max(counts)
    assert sorted(counts) == list(range(1, last + 1)) and set(counts.values()) == {1}, counts
    expected = _expected_hashes(dataset, spec, last)
    assert {int(r["step"]): int(r["sample_ids_hash"]) for r in rows} == expected
    losses = [r["loss"] for r in sorted(rows, key=lambda r: int(r["step"]))]
    assert all(loss == loss for loss in losses) and sum(losses[-5:]) < sum(losses[:5])
