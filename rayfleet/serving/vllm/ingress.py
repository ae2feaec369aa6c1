"""``RayfleetOpenAiIngress``: Serve LLM's OpenAI ingress behind rayfleet's API keys.

A vLLM app is Serve LLM's own app (``build_openai_app`` / ``build_pd_openai_app``); its ingress
class comes from ``ingress_cls_config``, so ``config.vllm_app_args`` names this subclass there
and passes the spec's ``http`` auth settings (``auth``, the key environment variables' names and
the key file's path, never a key) as ``rayfleet_auth``.

Design decisions:
- The same check as the built-in app (``serving.api_keys.ApiKeyMiddleware``: bearer keys,
  constant-time compare, fail closed, 401 in OpenAI's error shape), added to the ingress's
  FastAPI app before it starts. Serve's ``@serve.ingress`` wrapper sets the app through
  ``ASGIAppReplicaWrapper._set_asgi_app`` after this class's ``__init__`` ran; this class comes
  before that wrapper in the MRO, so overriding ``_set_asgi_app`` sees the app first. The app
  stays the FastAPI object (``add_middleware``, not a wrapper around it), so Serve's route
  names and docs keep working.
- Keys are read where the ingress runs (``resolve_api_keys``), as for the built-in app.
- Only ``/health`` is open; Serve LLM's ingress has none, so deploy's readiness check sends
  the key to ``/v1/models``.
"""

from __future__ import annotations

from typing import Any

from ray.serve.llm.ingress import OpenAiIngress

from rayfleet.serving.api_keys import ApiKeyMiddleware, resolve_api_keys

__all__ = ["RayfleetOpenAiIngress"]


class RayfleetOpenAiIngress(OpenAiIngress):
    """See module doc. ``rayfleet_auth``: ``{"auth", "env", "file"}`` from the spec's ``http``."""

    def __init__(self, *args: Any, rayfleet_auth: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        auth = rayfleet_auth or {}
        self._rf_keys = resolve_api_keys(auth=auth.get("auth", "api_key"), env_names=auth.get("env", ()),
                                         file=auth.get("file"))

    def _set_asgi_app(self, app: Any) -> None:
        if self._rf_keys is not None:  # None: auth disabled explicitly in the spec
            app.add_middleware(ApiKeyMiddleware, keys=self._rf_keys)
        super()._set_asgi_app(app)
