"""Routing inside the caller's handle vs a router deployment hop, on one live Serve pool.

What it measures: the latency of an engine call (``block_usage``: no model compute, so the
figure is the routing and transport cost) sent to a two-replica colocated pool

- ``in-handle``: routed by ``PrefixLoadRequestRouter`` inside the caller's Serve handle (what a
  deployed rayfleet app does), and
- ``router hop`` (baseline): the caller first asks a router deployment, which ranks the same
  pool with the same ``PoolRouterCore`` from the same published replica stats, then calls the
  chosen replica (pinned): the shape of the router deployment that rayfleet used before.

Both run in one caller deployment, interleaved request by request, on the same replicas, so
machine load hits both alike. Prints a table (p50/p99 ms and the ratio to in-handle) and writes
JSON with ``--json``. ``--quick``: 40 calls per path.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import Table, cpu_name, init_local_ray, record_run  # benchmarks/common.py (this script's directory is on sys.path)
from ray import serve

from rayfleet.serving.routing.router import RouteHint


@serve.deployment(ray_actor_options={"num_cpus": 0})
class RouterHop:
    """Baseline: a router deployment that ranks the pool and returns a replica id."""

    def __init__(self, pool, app_name: str) -> None:
        self.pool, self.app_name = pool, app_name

    async def route(self, hint: RouteHint) -> str:
        from rayfleet.serving.routing.router import pool_router

        router = pool_router(self.app_name, "colocated")
        if router is None or not router.replica_stats():  # this process's handle is not up yet
            await self.pool.block_usage.remote(route=RouteHint())
            router = pool_router(self.app_name, "colocated")
        stats = router.replica_stats()
        for rid, s in stats.items():
            router.core.observe(rid, s)
        return router.core.rank(sorted(stats), hint)[0][0]


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    def __init__(self, pool, hop) -> None:
        self.pool, self.hop = pool, hop

    async def measure(self, num_calls: int) -> dict[str, list[float]]:
        hint = RouteHint(block_hashes=(), num_prompt_blocks=4)
        for _ in range(5):  # warm both paths (handles, routers, first stats)
            await self.pool.block_usage.remote(route=hint)
            await self.hop.route.remote(hint)
        out: dict[str, list[float]] = {"in-handle": [], "router hop": []}
        for _ in range(num_calls):
            t0 = time.perf_counter()
            await self.pool.block_usage.remote(route=hint)
            out["in-handle"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            replica = await self.hop.route.remote(hint)
            await self.pool.block_usage.remote(route=RouteHint(replica=replica))
            out["router hop"].append(time.perf_counter() - t0)
        return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    num_calls = 40 if args.quick else args.calls

    import ray

    from rayfleet.serving.deploy.deployments import bind_pool
    from rayfleet.serving.spec import ServeSpec

    init_local_ray(num_cpus=2)  # retried: on a busy host a raylet can miss Ray's fixed 30 s start window
    try:
        spec = ServeSpec.parse({"name": "hop-bench", "model": {"preset": "tiny", "seed": 0},
                                "colocated": {"replicas": 2, "accelerators_per_replica": 0},
                                "engine": {"num_blocks": 64}})
        pool = bind_pool(spec, "colocated")
        app = Caller.bind(pool, RouterHop.bind(pool, spec.name))
        caller = serve.run(app, name=spec.name, route_prefix=None)
        samples = caller.measure.remote(num_calls).result(timeout_s=600)
    finally:
        serve.shutdown()
        ray.shutdown()
    base = _pct(samples["in-handle"], 0.5)
    rows = [{"path": name, "p50_ms": _pct(v, 0.5), "p99_ms": _pct(v, 0.99), "vs_in_handle": _pct(v, 0.5) / base}
            for name, v in samples.items()]
    print(f"\nserve routing hop: {num_calls} block_usage calls per path, 2-replica pool, "
          f"on {cpu_name()}, Ray Serve")
    print(f"{'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs in-handle':>17}")
    for r in rows:
        print(f"{r['path']:<12} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['vs_in_handle']:>16.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"calls": num_calls, "rows": rows, "samples_s": samples}, indent=1))
    # No goal is stated: the router-deployment hop is the baseline, measured in the same run.
    record_run(name="serve_routing_hop", quick=args.quick, params={"calls": num_calls}, figures={"rows": rows},
               tables={"hop": Table(["path", "p50 ms", "p99 ms", "p50 vs in-handle"],
                                    [[r["path"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['vs_in_handle']:.2f}x"]
                                     for r in rows])})


if __name__ == "__main__":
    main()
