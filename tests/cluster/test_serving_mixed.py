"""Serving on a mixed fleet: a disaggregated app with its prefill pool on the shared fleet's H100
nodes and its decode pool on a Kunlun P800 node (``XPU`` resources, from the catalogue), added
to the fleet for this module. Greedy tokens equal one in-process engine's; each pool's replicas
sit on nodes of their accelerator type; moving the decode pool's bounds (what the shared
autoscaler does when it lends or reclaims an accelerator) makes Serve start a second P800
replica, which serves, and drain it again. Last, the shared autoscaler itself lends a P800: an
elastic training job on the P800 node's other two XPUs shrinks by one worker under a burst,
the decode pool grows onto the freed XPU, and after the burst the job gets it back.
"""

from __future__ import annotations

import collections

import pytest
import requests

from live_helpers import Burst, free_port

from .conftest import wait_until

pytestmark = pytest.mark.cluster

MODEL = {"preset": "tiny", "seed": 5, "dtype": "float64", "overrides": {"max_seq_len": 512, "init_std": 0.1}}
ENGINE = {"block_size": 8, "num_blocks": 96, "max_num_seqs": 4, "max_num_batched_tokens": 128}
P800_NODE = "n0100"
P800_XPUS = 3  # one decode replica + an elastic job of 1..2 workers (each formation restarts its workers)


@pytest.fixture(scope="module")
def mixed_app(local_fleet):
    from ray import serve

    from rayfleet.platform.topology import NodeTopology
    from rayfleet.serving.deployer import deploy
    from rayfleet.serving.spec import HttpSpec

    # The shared fleet is all H100: one P800 node (3 XPUs) joins it for this module (and stays:
    # conftest runs this module after the fleet tests that list exact nodes).
    if all(n.accelerator_type != "P800" for n in local_fleet.fleet.topology.nodes):
        local_fleet.fleet.add_node(NodeTopology(name=P800_NODE, accelerator_type="P800", num_accelerators=P800_XPUS,
                                                rack="r09", block="b9", nvlink_domain=f"sn-{P800_NODE}"),
                                   timeout_s=300)  # a loaded 2-core machine took over 120 s to start one
    http = {"port": free_port(), "route_prefix": "/mixed"}
    if "auth" in HttpSpec.model_fields:
        http["auth"] = "disabled"
    served = deploy({"name": "test-mixed", "mode": "disaggregated", "model": MODEL, "engine": ENGINE,
                     "prefill": {"replicas": 1, "accelerator_type": "H100"},
                     "decode": {"replicas": 1, "accelerator_type": "P800"},
                     "http": http, "request_timeout_s": 30})
    try:
        yield served
    finally:
        served.shutdown()
        serve.shutdown()


def _complete(url: str, prompt: str, max_tokens: int = 10) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    resp = requests.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _reference(prompt: str, max_tokens: int = 10) -> list[int]:
    from rayfleet.serving.engine.loading import load_engine
    from rayfleet.serving.engine.sampling import SamplingParams
    from rayfleet.serving.openai_api.app import encode_completion_prompt
    from rayfleet.serving.spec import ServeSpec

    spec = ServeSpec.parse({"model": MODEL, "engine": ENGINE})
    m = spec.model
    engine = load_engine(preset_name=m.preset, seed=m.seed, checkpoint=None, dtype=m.dtype, overrides=m.overrides,
                         config=spec.engine_config())
    (result,) = engine.generate([encode_completion_prompt(prompt)],
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(result.output_token_ids)


def _pool_accelerators(app: str, pool: str) -> list[str]:
    """Accelerator type label of the node of each live replica of ``pool``."""
    import ray
    from ray.util.state import list_actors

    from rayfleet.platform import labels as L

    node_type = {n["NodeID"]: (n.get("Labels") or {}).get(L.ACCELERATOR_TYPE, "") for n in ray.nodes()}
    # This cluster's address: another Ray instance on the host makes "auto" ambiguous.
    actors = list_actors(address=ray.get_runtime_context().gcs_address,
                         filters=[("state", "=", "ALIVE"), ("class_name", "=", f"ServeReplica:{app}:{pool}")])
    return sorted(node_type.get(a.node_id, "") for a in actors)


def test_prefill_on_h100_decode_on_p800_gives_single_engine_tokens(mixed_app):
    assert _pool_accelerators("test-mixed", "prefill") == ["H100"]
    assert _pool_accelerators("test-mixed", "decode") == ["P800"]
    for prompt in ("mixed fleets serve one model", "hi"):
        assert _complete(mixed_app.url, prompt) == _reference(prompt)


def test_moving_the_decode_pool_bounds_lends_and_reclaims_a_p800(mixed_app):
    from rayfleet.serving.deploy.pool_scaling import get_pool_bounds, set_pool_bounds

    assert get_pool_bounds("test-mixed", "decode") == (1, 1)  # written by deploy from the spec
    set_pool_bounds("test-mixed", "decode", min_replicas=2, max_replicas=2)  # the autoscaler lends one
    wait_until(lambda: _pool_accelerators("test-mixed", "decode") == ["P800", "P800"], timeout_s=120, interval_s=1,
               what="Serve to start a second decode replica on the P800 node")
    wait_until(lambda: sum(n.startswith("decode/") for n in mixed_app.block_usage()) == 2, timeout_s=60,
               interval_s=1, what="the ingress's request router to see both decode replicas")
    # What the autoscaler's Serve shell reads back (its handover waits on these).
    from rayfleet.serving.deploy.gang_units import LendUnit
    from rayfleet.serving.serve_scaling_shell import _replica_nodes, _running_replicas

    wait_until(lambda: _running_replicas("test-mixed", "decode") == 2, timeout_s=60, interval_s=1,
               what="Serve's status to count two RUNNING decode replicas")
    assert _replica_nodes("test-mixed", "decode", LendUnit()) == [P800_NODE, P800_NODE]  # one-rank replicas
    prompt = "lent accelerators serve too"
    for _ in range(4):  # the new replica has the most free KV, so it takes decodes at once
        assert _complete(mixed_app.url, prompt) == _reference(prompt)
    set_pool_bounds("test-mixed", "decode", min_replicas=1, max_replicas=1)  # and reclaims it
    wait_until(lambda: _pool_accelerators("test-mixed", "decode") == ["P800"], timeout_s=120, interval_s=1,
               what="Serve to drain and stop the lent decode replica")
    assert _complete(mixed_app.url, prompt) == _reference(prompt)


GLOBAL_BATCH = 6  # divisible by 2 workers and 1
TTFT_SLO_S = 2.0


def _expected_hashes(dataset: str, spec: dict, last: int) -> dict[int, int]:
    """Each step's global batch in an uninterrupted run (the data order is a pure function)."""
    from rayfleet.jobs.data import SampleOrder, TokenSamples
    from rayfleet.jobs.loop import sample_ids_hash

    samples = TokenSamples(dataset, spec["data"]["seq_len"])
    order = SampleOrder(samples.num_samples, seed=0, chunk=samples.samples_per_shard,
                        window_chunks=max(1, samples.cached_shards // 2))
    batch = spec["global_batch_size"]
    return {step: sample_ids_hash(order.ids((step - 1) * batch, batch).tolist()) for step in range(1, last + 1)}


def _assert_control_actors_on_the_driver_node(dashboard_url: str) -> None:
    """The job's control actor (stop flag and metrics rows) lives where Ray Train's controller does
    (the driver's node), never on a worker node whose loss would orphan it from a running job; and
    it is the only helper of ours or Ray Train's besides the synchronization actor (no separate
    metrics queue, no Ray Data dataset manager: the job has no Ray Dataset; no placement-group
    cleaner: the driver removes an aborted formation's group)."""
    from ray.util.state import list_actors

    def nodes(class_name: str) -> set:
        return {a.node_id for a in list_actors(address=dashboard_url, limit=1000,
                                               filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])}

    controller = nodes("TrainController")
    assert len(controller) == 1, controller
    assert nodes("FormationControl") == controller, (nodes("FormationControl"), controller)
    absent = {name: nodes(name) for name in ("_QueueActor", "DatasetManager", "PlacementGroupCleaner")}
    assert not any(absent.values()), absent


def test_the_shared_autoscaler_lends_a_p800_from_training_to_the_decode_pool(local_fleet, mixed_app, dataset,
                                                                               tmp_path):
    """The whole loop on XPUs: a P800 job lends one accelerator to the P800 decode pool and gets it back.

    The suite's one live lend cycle on the built-in engine (the colocated pool's runs in the
    quickstart notebook, the vLLM decode pool's in tests/vllm): a bounded burst of streamed
    requests makes the controller's policy shrink the job by one DP replica (after a flash
    snapshot) and, once the job holds its new layout, the decode pool grows onto the freed XPU;
    when the burst is over and the hysteresis has passed, Serve drains one decode replica and the
    job grows back to 2 workers; the test then stops the job.

    Measured and printed: decision-to-replica-running handover time, the share of requests within
    the TTFT SLO. Asserted: no failed request and the same tokens as one engine after the cycle;
    both decisions, the handover and the removal are events with their reasons, also in
    ``rayfleet status``; the job's control actors sit on the driver's node; exact step accounting:
    every step 1..N is reported exactly once and its global batch is exactly the uninterrupted
    run's (sample-id hash per step), with finite, falling loss.
    """
    from rayfleet.platform.status_table import render_status

    sdk = local_fleet.sdk
    spec = {"name": "p800-lender", "model": {"preset": "tiny", "seed": 0}, "data": {"uri": dataset, "seq_len": 64},
            "plan": {}, "precision": "fp32", "steps": 2000, "global_batch_size": GLOBAL_BATCH,
            "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1},
            "resources": {"accelerator": "P800", "elastic": {"min_workers": 1, "max_workers": P800_XPUS - 1},
                          "host_cpu_share": 0.25},  # the lender leaves the host's CPU to the replicas
            "checkpoint": {"every_n_steps": 1, "persist_every": 1, "uri": str(tmp_path / "ckpt")}}
    shell = run = None
    try:
        sdk.start_autoscaler(interval_s=1.0, scale_down_after_s=3.0, job_resize_cooldown_s=5.0)
        shell = sdk.autoscale_serve(mixed_app, ttft_slo_s=TTFT_SLO_S, target_ongoing_requests=2, max_replicas=2,
                                    window_s=3.0, interval_s=1.0)
        run = sdk.train(spec)
        steps = lambda: [int(r["step"]) for r in run.metrics().rows]  # noqa: E731
        wait_until(lambda: len(steps()) >= 2 or run.status() in ("FAILED", "STOPPED"), timeout_s=300,
                   interval_s=0.5, what="the P800 job's first steps at 2 workers")
        assert "on 2 workers" in run.logs(), run.logs()[-3000:]
        _assert_control_actors_on_the_driver_node(local_fleet.dashboard_url)
        burst = Burst(mixed_app.openai_base_url, clients=6, api_key=mixed_app.api_key, model="tiny", max_tokens=16,
                      prompt=lambda i, n: f"def f{i}_{n}(x):\n").start()
        try:
            wait_until(lambda: any(h["running_at"] for h in shell.history()) or run.status() in ("FAILED", "STOPPED"),
                       timeout_s=300, interval_s=0.5, what="a lent P800 decode replica running")
        finally:
            burst.join()
        assert _pool_accelerators("test-mixed", "decode") == ["P800", "P800"]
        wait_until(lambda: all(h["removed_at"] for h in shell.history()), timeout_s=180, interval_s=0.5,
                   what="the lent decode replica drained and removed after the burst")
        wait_until(lambda: "formation 2 with 2 workers" in run.logs() or run.status() in ("FAILED", "STOPPED"),
                   timeout_s=300, interval_s=1.0, what="the P800 job grown back to 2 workers")
        regrown = max(steps())
        wait_until(lambda: max(steps()) >= regrown + 3 or run.status() in ("FAILED", "STOPPED"),
                   timeout_s=180, interval_s=0.5, what="steps after the grow-back")
        assert run.status() == "RUNNING", run.logs()[-4000:]
        run.cancel()
        wait_until(lambda: run.status() in ("STOPPED", "FAILED", "SUCCEEDED"), timeout_s=120, interval_s=1.0,
                   what="the job stopped")
        history, logs = shell.history(), run.logs()
        decisions = sdk.autoscaler_decisions(limit=50)
        status_text = render_status(sdk.status())
    except AssertionError as err:
        raise AssertionError(f"{err}\nhistory {shell.history() if shell else None}\n"
                             f"events {[(e.kind, e.cause) for e in sdk.events(limit=30)]}\n"
                             f"job log {run.logs()[-3000:] if run else ''}") from None
    finally:
        if run is not None:
            run.cancel()
        if shell is not None:
            shell.stop()
        sdk.stop_autoscaler()

    # -- what happened ------------------------------------------------------------------------
    failed = [r for r in burst.results if r["error"] or r["chars"] == 0]
    ttfts = sorted(r["ttft_s"] for r in burst.results if r["ttft_s"] is not None)
    within = sum(1 for t in ttfts if t <= TTFT_SLO_S) / max(1, len(ttfts))
    print(f"\nP800 lend: handover {[h['handover_s'] for h in history]}, {len(burst.results)} requests, "
          f"{len(failed)} failed; {within:.0%} within the TTFT SLO of {TTFT_SLO_S:g}s"
          + (f" (p50 {ttfts[len(ttfts) // 2]:.2f}s)" if ttfts else ""))
    for e in decisions:
        print(f"  {e.subject:<18} {e.kind:<34} {e.cause}")
    kinds = [e.kind for e in decisions]
    assert not failed, failed[:3]
    assert len(history) == 1 and history[0]["node"] == P800_NODE and history[0]["handover_s"], history
    assert "autoscaler_ShrinkTraining" in kinds and "autoscaler_GrowTraining" in kinds, kinds
    assert "autoscaler_handover" in kinds and "autoscaler_replica_removed" in kinds, kinds
    # up during the burst, down after it (the controller's log also holds earlier modules' apps)
    ours = [e.cause for e in decisions if e.kind == "autoscaler_ScaleServe" and e.subject == "test-mixed"]
    assert len(ours) == 2, [(e.subject, e.kind, e.cause) for e in decisions]
    assert "autoscaler decisions:" in status_text and "ShrinkTraining" in status_text, status_text
    # the job shrank to 1 worker and grew back to 2
    assert "formation 1 with 1 workers" in logs and "formation 2 with 2 workers" in logs, logs[-4000:]
    # exact step accounting: every step up to the last once, each with the uninterrupted run's global batch
    rows = run.metrics().rows
    counts = collections.Counter(int(r["step"]) for r in rows)
    last = max(counts)
    assert sorted(counts) == list(range(1, last + 1)) and set(counts.values()) == {1}, counts
    assert {int(r["step"]): int(r["sample_ids_hash"]) for r in rows} == _expected_hashes(dataset, spec, last)
    losses = [r["loss"] for r in sorted(rows, key=lambda r: int(r["step"]))]
    assert all(loss == loss for loss in losses) and sum(losses[-5:]) < sum(losses[:5]), losses
    prompt = "lent accelerators serve too"
    assert _complete(mixed_app.url, prompt) == _reference(prompt)  # the pool is back to one replica, still right
