"""A wide-EP vLLM pool (``data_parallel_size`` > 1) -> Ray Serve LLM's data-parallel deployment (pure).

Ray Serve LLM 2.60 has the pattern (``ray.serve.llm.build_dp_openai_app`` /
``build_dp_deployment``, server class ``DPServer``): one Serve replica per DP rank; the
deployment's ``gang_scheduling_config`` (``gang_size = data_parallel_size``, PACK,
RESTART_GANG) makes Serve reserve one placement group per gang, the per-rank bundles repeated
``data_parallel_size`` times with their label selectors; rank 0 publishes its address for the
others. rayfleet asks for it and adds only its own parts around it:
- the per-rank placement group and one ``rayfleet.io/accelerator-type`` selector per bundle
  (``config.placement_group_config``), which Serve repeats onto every bundle of the gang;
- vLLM's DP/EP engine arguments (this module);
- rayfleet's router: it reads routing stats that ``server.RayfleetLLMServer`` publishes, so a
  DP pool under it runs ``dp_server.RayfleetDPServer`` (``DPServer`` + those stats; one rank is
  one routing target, which is how vLLM's own DP front end balances too) through
  ``build_openai_app`` (which builds ``LLMConfig.server_cls``'s deployment; ``build_dp_openai_app``
  always takes Ray's own ``DPServer``). Under Serve's routers the pool is ``build_dp_openai_app``'s.
- the API-key ingress either way (``ingress_cls_config``).

Whether the model is MoE is read from its ``config.json`` when ``model.hf`` is a local directory
(vLLM 0.32 refuses external data parallelism for a dense model, minutes into engine start).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.serving.spec import PoolSpec

__all__ = ["RAYFLEET_DP_SERVER", "RAY_DP_SERVER", "dp_engine_kwargs", "check_moe_model", "MOE_CONFIG_KEYS"]

RAYFLEET_DP_SERVER = "rayfleet.serving.vllm.dp_server.RayfleetDPServer"
RAY_DP_SERVER = "DPServer"  # the class name build_dp_openai_app's deployment is named after

# config.json keys that give an MoE model's routed experts (Qwen/OLMoE, Mixtral, DeepSeek, ERNIE)
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def dp_engine_kwargs(pool: PoolSpec) -> dict[str, Any]:
    """vLLM engine arguments of a wide-EP pool (empty for a plain one). ``DPServer`` adds each
    rank's ``data_parallel_rank``, address and RPC port when the rank starts.

    >>> dp_engine_kwargs(PoolSpec(data_parallel_size=4, accelerators_per_replica=4, enable_expert_parallel=True))
    {'data_parallel_size': 4, 'enable_expert_parallel': True}
    """
    kwargs: dict[str, Any] = {}
    if pool.is_data_parallel:
        kwargs["data_parallel_size"] = pool.data_parallel_size
    if pool.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if pool.enable_eplb:
        kwargs["enable_eplb"] = True
    return kwargs


def check_moe_model(model_source: Any, *, role: str, pool: PoolSpec) -> None:
    """Raise ``SpecError`` when ``pool`` is wide-EP and ``model_source`` is a local model directory
    whose ``config.json`` names no routed experts (a dense model). A hub id or a URI is not read
    here: vLLM checks it when the engine starts."""
    if not (pool.is_data_parallel or pool.enable_expert_parallel) or not isinstance(model_source, str):
        return
    config = Path(model_source) / "config.json"
    if not config.is_file():
        return
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # vLLM's own loader names what is wrong with the file
    experts = max((int(fields.get(k) or 0) for k in MOE_CONFIG_KEYS if isinstance(fields.get(k) or 0, int)), default=0)
    if experts > 1:
        return
    name = "data_parallel_size" if pool.is_data_parallel else "enable_expert_parallel"
    raise SpecError(f"{role}.{name}", getattr(pool, name),
                    f"{model_source} is a dense model (its config.json has none of {', '.join(MOE_CONFIG_KEYS)}); "
                    "vLLM runs data-parallel attention with expert parallelism for MoE models only",
                    f"set {role}.data_parallel_size: 1 and enable_expert_parallel: false, and scale with "
                    f"{role}.replicas (or serve an MoE model)")
