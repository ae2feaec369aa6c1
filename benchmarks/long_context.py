"""Long-context prefill benchmark: TTFT of long prompts on one prefill replica vs split over two.

    python benchmarks/long_context.py            # ~2-4 min on 2 cores
    python benchmarks/long_context.py --quick    # shorter prompts, fewer repeats

Starts its own local Ray cluster (``ray.init(address="local")``, never an existing one) with two
engine-replica actors (one process each, one torch thread each, like the Serve replicas), each an
``AsyncEngine`` with the ``ObjectStoreTransport`` the deployments use, plus the replica side of
``split_prefill``. The driver plays the ingress.

For each prompt length (random byte tokens, a fresh prompt per run so no prefix cache helps):
- single: ``prefill`` on replica 0 (the whole prompt in one engine step:
  ``max_num_batched_tokens`` is the prompt length), TTFT = call to first token + KV handle;
- split: ``split_prefill`` over both replicas with the spans the router's
  ``LongPrefillPolicy`` plans for idle replicas (``key_cost`` from the model shape), same measure.
Both first tokens are compared (greedy; they must be equal). Also reported: engine-thread compute
seconds per replica in the split run, and what is left of the split TTFT beyond the busier
replica's compute (coordination: one actor call per span-layer, per-layer KV through the
object store). The ideal speed-up of the layer wavefront with C spans and L layers is
``C * L / (C + L - 1)`` (equal spans, free transfers).

Writes ``benchmarks/results/long_context.json`` (``--json``); prints a table last. Two replicas
on a 2-core machine shared with other work: the ratio is bounded by the free cores, not by the
scheme.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Table, init_local_ray, record_run  # noqa: E402  (benchmarks/common.py, beside this script)

RESULTS = Path(__file__).resolve().parent / "results"


def _replica_class():
    import ray

    @ray.remote(num_cpus=1)
    class ReplicaActor:
        def __init__(self, name: str, preset_name: str, max_len: int) -> None:
            import torch

            from rayfleet.serving.engine.engine_config import EngineConfig
            from rayfleet.serving.engine.llm_engine import LLMEngine
            from rayfleet.serving.engine.async_engine import AsyncEngine
            from rayfleet.serving.kv.transfer import ObjectStoreTransport
            from rayfleet.serving.routing.split_prefill import SpanPrefillWorker

            torch.set_num_threads(1)
            config = EngineConfig(block_size=16, num_blocks=max_len // 16 + 8, max_num_seqs=4,
                                  max_num_batched_tokens=max_len, enable_prefix_caching=False)
            engine = LLMEngine.from_preset(preset_name, config, seed=0, max_seq_len=max_len + 128)
            self.engine = AsyncEngine(engine, name=name, transport=ObjectStoreTransport(owner=name, lease_s=120))
            self.spans = SpanPrefillWorker(self.engine)

        def num_layers(self) -> int:
            return self.engine.engine.model.config.num_layers

        async def prefill(self, rid, prompt, params):
            reply = await self.engine.prefill(rid, prompt, params)
            if reply.handle is not None:
                self.engine.release_kv(reply.handle.handoff_id)
            return reply.first_token_id

        async def prefill_span(self, work):
            return await self.spans.run(work)

        async def release_span(self, job_id):
            return self.spans.release(job_id)

        async def release_kv(self, handoff_id):
            return self.engine.release_kv(handoff_id)

    return ReplicaActor


class ActorClient:
    """The two calls ``split_prefill`` makes, over a Ray actor handle."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def prefill_span(self, work):
        return await self.actor.prefill_span.remote(work)

    async def release_span(self, job_id):
        return await self.actor.release_span.remote(job_id)


async def measure(actors, *, lengths, repeats, preset_name) -> list[dict]:
    import torch

    from rayfleet.models import preset
    from rayfleet.serving.routing.long_prefill import LongPrefillPolicy, key_cost_for
    from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
    from rayfleet.serving.engine.sampling import SamplingParams
    from rayfleet.serving.routing.split_prefill import split_prefill

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    names = [f"prefill-{i}" for i in range(len(actors))]
    clients = {n: ActorClient(a) for n, a in zip(names, actors)}
    policy = LongPrefillPolicy(threshold_tokens=256, max_replicas=len(actors), min_span_tokens=128,
                               key_cost=key_cost_for(preset(preset_name)))
    idle = [ReplicaSnapshot(ReplicaId(n), 1 << 20, 1 << 20, 0) for n in names]
    gen = torch.Generator().manual_seed(0)
    rows = []
    # Warm-up: first forwards pay allocation and lazy imports in each process.
    warm = torch.randint(0, 256, (512,), generator=gen).tolist()
    await asyncio.gather(*(a.prefill.remote(f"warm-{i}", warm, params) for i, a in enumerate(actors)))
    for n in lengths:
        plan = policy.plan(n, idle, block_size=16)
        single_s, split_s, busy_s = [], [], []
        for r in range(repeats):
            prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
            t0 = time.perf_counter()
            single_token = await actors[0].prefill.remote(f"single-{n}-{r}", prompt, params)
            single_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reply, busy = await split_prefill(clients, plan.spans, job_id=f"split-{n}-{r}", prompt=prompt,
                                              params=params, timeout_s=600)
            split_s.append(time.perf_counter() - t0)
            busy_s.append(busy)
            if reply.handle is not None:
                await clients[plan.spans[-1].replica_id].actor.release_kv.remote(reply.handle.handoff_id)
            assert reply.first_token_id == single_token, (n, reply.first_token_id, single_token)
        single, split = statistics.median(single_s), statistics.median(split_s)
        busy_med = {name: statistics.median(b[name] for b in busy_s) for name in busy_s[0]}
        rows.append({"prompt_tokens": n, "spans": [(s.replica_id, s.start, s.end) for s in plan.spans],
                     "single_ttft_s": single, "split_ttft_s": split, "speedup": single / split,
                     "split_compute_s": busy_med, "split_overhead_s": split - max(busy_med.values()),
                     "single_runs_s": single_s, "split_runs_s": split_s})
        print(f"  {n} tokens: single {single:.2f} s, split {split:.2f} s ({single / split:.2f}x); "
              f"compute per replica {', '.join(f'{v:.2f}' for v in busy_med.values())} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--json", type=Path, default=RESULTS / "long_context.json", help="where the results go")
    args = parser.parse_args()
    lengths = [1024, 2048] if args.quick else [1024, 2048, 3072]
    repeats = 2 if args.quick else 3

    import ray

    from rayfleet.models import preset

    num_layers = preset(args.preset).num_layers
    init_local_ray(num_cpus=4)
    try:
        replica = _replica_class()
        actors = [replica.remote(f"prefill-{i}", args.preset, max(lengths)) for i in range(2)]
        ray.get([a.num_layers.remote() for a in actors])
        started = time.time()
        rows = asyncio.run(measure(actors, lengths=lengths, repeats=repeats, preset_name=args.preset))
        elapsed = time.time() - started
    finally:
        ray.shutdown()
    ideal = 2 * num_layers / (2 + num_layers - 1)
    meta = {"when": datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "preset": args.preset,
            "num_layers": num_layers, "replicas": 2, "threads_per_replica": 1, "repeats": repeats,
            "ideal_speedup": ideal, "elapsed_s": elapsed}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nLong-context prefill, preset {args.preset} ({num_layers} layers), 2 replica processes x 1 thread, "
          f"{os.cpu_count()} cores (load avg {meta['load_avg_1m']:.1f}); median of {repeats} runs")
    print(f"{'prompt':>7} {'spans':>22} {'single TTFT':>12} {'split TTFT':>11} {'speed-up':>9} {'ideal':>6} "
          f"{'compute/replica':>16} {'overhead':>9}")
    for row in rows:
        spans = " ".join(f"{e - s}" for _, s, e in row["spans"])
        compute = "/".join(f"{v:.2f}" for v in row["split_compute_s"].values())
        print(f"{row['prompt_tokens']:>7} {spans:>22} {row['single_ttft_s']:>11.2f}s {row['split_ttft_s']:>10.2f}s "
              f"{row['speedup']:>8.2f}x {ideal:>5.2f}x {compute:>15}s {row['split_overhead_s']:>8.2f}s")
    table = Table(["prompt", "spans", "single TTFT s", "split TTFT s", "speed-up", "ideal", "compute/replica s", "overhead s"],
                  [[str(row["prompt_tokens"]), " ".join(f"{e - s}" for _, s, e in row["spans"]),
                    f"{row['single_ttft_s']:.2f}", f"{row['split_ttft_s']:.2f}", f"{row['speedup']:.2f}x", f"{ideal:.2f}x",
                    "/".join(f"{v:.2f}" for v in row["split_compute_s"].values()), f"{row['split_overhead_s']:.2f}"]
                   for row in rows])
    # No goal is stated: the split is compared with a single replica and with the pipeline's ideal.
    record_run(name="long_context", quick=args.quick, params={"preset": args.preset, "lengths": lengths, "repeats": repeats},
               figures={"meta": meta, "rows": [{k: v for k, v in r.items() if k not in ("single_runs_s", "split_runs_s")}
                                               for r in rows]},
               tables={"prefill_split": table})


if __name__ == "__main__":
    main()
