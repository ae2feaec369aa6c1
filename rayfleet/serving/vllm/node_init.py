"""Serve LLM's node initialization, skipped where there is nothing to download.

Before each engine start, Serve LLM (Ray 2.60, ``VLLMEngine.start``) runs ``initialize_node``: one
Ray task per node of the replica's placement group that "downloads" the model there. For a model
that is a directory already on the node that task downloads nothing and returns the path it was
given, yet it is a worker process of its own (the replica's runtime env) that imports torch,
transformers and Serve LLM's configs: about 14 CPU s per engine start on a 2-core host, on the
start's critical path (measured: 71 CPU s over the vLLM test tier's five engine starts).

``LocalModelCallback`` (``LLMConfig.callback_config``, Serve LLM's public hook for node
initialization) turns it off when, in the replica, the model source is an existing local
directory and every bundle of the placement group sits on the replica's own node. Otherwise (a
hub id, a cloud URI, a group spanning nodes) Serve LLM initializes every node as before. It keeps
the one side effect the download step has for a local path: torch's hub ``kernels`` directory
exists afterwards (Serve LLM's workaround for a torch issue).
"""

from __future__ import annotations

import os
from typing import Any

from rayfleet.platform.ray_compat import serve_llm_callback_base

__all__ = ["LocalModelCallback", "CALLBACK_CLASS", "skips_node_init"]

CALLBACK_CLASS = f"{__name__}.LocalModelCallback"


def skips_node_init(model_source: str, bundle_nodes: list[str], this_node: str) -> bool:
    """Whether a replica on ``this_node`` may skip node initialization for ``model_source``, its
    placement group's bundles being on ``bundle_nodes``."""
    return bool(bundle_nodes) and set(bundle_nodes) == {this_node} and os.path.isdir(model_source)


class LocalModelCallback(serve_llm_callback_base()):
    """See module doc."""

    async def on_before_node_init(self) -> None:
        import ray

        source = self.llm_config.get_engine_config().actual_hf_model_id
        group: Any = self.ctx.placement_group
        nodes = list(ray.util.placement_group_table(group)["bundles_to_node_id"].values()) if group else []
        if skips_node_init(source, nodes, ray.get_runtime_context().get_node_id()):
            import torch

            os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
            self.ctx.run_init_node = False
