"""What a wide-EP pool (``ranks_per_replica > 1``) asks of the rest of a ``ServeSpec``.

One replica spans ``ranks_per_replica`` ranks (``serving.deploy.gang_replica``): attention runs
data-parallel over them and the MoE layers expert-parallel, with the experts' slots
(``num_experts + expert_balancing.num_redundant_experts``) split evenly over the ranks and live
EPLB when ``expert_balancing.enabled``. Checked once, at the edge, naming field, value and fix.
"""

from __future__ import annotations

from typing import Any

from rayfleet.errors import SpecError

__all__ = ["check_wide_ep"]


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
