"""``RayfleetDPServer``: Ray Serve LLM's ``DPServer`` (one gang-scheduled DP rank) that also
publishes rayfleet's routing stats (``server.RayfleetLLMServer``).

Method order (``DPServer`` first): ``DPServer.__init__`` reads the rank from Serve's gang
context and hands vLLM its DP rank, address and bundles, then runs ``LLMServer.__init__``
through ``RayfleetLLMServer`` (which has none); ``get_deployment_options`` is ``DPServer``'s
(gang config, replicas x ``data_parallel_size``); ``chat``/``completions``/
``record_routing_stats`` are ``RayfleetLLMServer``'s, which wrap ``LLMServer``'s. So each rank is
one routing target of rayfleet's router, with its own load and served text blocks.
"""

from __future__ import annotations

from ray.serve.llm.deployment import DPServer

from rayfleet.serving.vllm.server import RayfleetLLMServer

__all__ = ["RayfleetDPServer"]


class RayfleetDPServer(DPServer, RayfleetLLMServer):
    """See module doc."""
