"""``deploy(spec)``: put a ``ServeSpec`` on the connected fleet; used by the CLI and the SDK.

Design decisions:
- The top of the serving ladder, beside the Serve shell (``serve_scaling_shell``): it picks the
  application by engine, the built-in one (``openai_api.serve_app``) or Ray Serve LLM's
  (``vllm.app``), so it sits above both rooms and nothing in ``serving`` imports it but the shell.
- Works from a driver already connected to the fleet (``rayfleet.connect()`` /
  ``fleet.serve(spec)``): it never calls ``ray.init`` when Ray is initialized. Otherwise it
  connects to ``address`` (or the local fleet) the way the SDK does, with token auth.
- Serve's HTTP proxy is started on ``spec.http`` (host, port), on the head node only, if Serve
  is not running yet. A running Serve keeps its own HTTP options (one proxy serves every app),
  so the returned URL uses the port that proxy really listens on, with a warning when it is
  not ``spec.http.port`` (a URL built from the spec once pointed at nothing and the deploy
  waited for a health check that could never answer); an
  app is named ``spec.name`` and routed at ``spec.http.route_prefix`` (``/`` by default, so
  OpenAI clients need no path prefix; several apps on one proxy use distinct prefixes). Deploying a spec with the same name replaces that app.
- Each pool's Serve autoscaling bounds start at the spec's ``replicas`` .. ``max_replicas``
  (``pool_scaling``), for either engine, keyed by the pool's Serve deployment
  (``pool_deployment_name``); the shared autoscaler moves them later.
- Every pool that asks for accelerators is admitted through its ``queue`` by the fleet
  controller first (``deploy.pool_admission.admit_app``, which the engines' ``app_builder`` for
  ``serve deploy`` runs too; the rules: ``platform/serve_admission.py``): a
  refused pool fails the deploy before anything is deployed, and an admitted one's Serve bounds
  never go above what its queue granted. ``ServeDeployment.shutdown`` gives the grant back.
- ``deploy`` waits until the app is RUNNING and the ingress answers ``/health`` (the engines
  have loaded and published their state), so the returned URL is usable at once; a failed
  deployment raises ``ServeDeployError`` with Serve's message.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayfleet.errors import RayfleetError
from rayfleet.platform.polling import poll_delays
from rayfleet.serving.deploy.pool_admission import PoolGrant, admit_app, controller_call, release_pools
from rayfleet.serving.spec import ServeSpec, load_serve_spec

__all__ = ["ServeDeployment", "ServeDeployError", "deploy", "pool_deployment_name"]

log = logging.getLogger(__name__)


class ServeDeployError(RayfleetError):
    """The Serve application did not come up (a replica failed to start, or a timeout)."""


@dataclass
class ServeDeployment:
    """A running served model. ``url`` is the OpenAI base URL root (``url + "/v1"``)."""

    spec: ServeSpec
    url: str
    api_key: str | None = None  # what clients send (``Authorization: Bearer``); None: auth disabled
    grants: dict[str, PoolGrant] = field(default_factory=dict)  # role -> what its queue admitted

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    def status(self) -> dict[str, Any]:
        """Serve's status of this app: ``{"status": ..., "deployments": {name: status}}``."""
        from ray import serve

        apps = serve.status().applications
        app = apps.get(self.spec.name)
        if app is None:
            return {"status": "NOT_DEPLOYED", "deployments": {}}
        return {"status": str(app.status.value if hasattr(app.status, "value") else app.status),
                "message": app.message,
                "deployments": {n: str(d.status.value if hasattr(d.status, "value") else d.status)
                                for n, d in app.deployments.items()}}

    def block_usage(self) -> dict[str, Any]:
        """Each engine replica's KV block usage (``GET /v1/block_usage``)."""
        import json
        import urllib.request

        request = urllib.request.Request(self.url + "/v1/block_usage", headers=(
            {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}))
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read())

    def shutdown(self) -> None:
        """Delete this app (other apps and Serve itself keep running)."""
        from ray import serve

        serve.delete(self.spec.name, _blocking=True)
        if any(g.job_id for g in self.grants.values()):  # its queues count it no more
            release_pools(self.grants.values(), controller_call(), "the Serve app was shut down")

    def __repr__(self) -> str:
        return f"ServeDeployment(name={self.spec.name!r}, mode={self.spec.mode!r}, url={self.url!r})"


def pool_deployment_name(spec: ServeSpec, role: str) -> str:
    """The Serve deployment of ``role``'s pool in the app of ``spec``, which keys its autoscaling
    bounds (``pool_scaling``): the role itself for the built-in engine (``deployments``), the name
    Serve LLM derives from the model for ``engine: vllm`` (``vllm.config.llm_deployment_name``)."""
    if spec.engine.kind == "vllm":
        from rayfleet.serving.vllm.config import llm_deployment_name

        return llm_deployment_name(spec, role)
    return role


def _ensure_connected(address: str | None) -> None:
    import ray

    if ray.is_initialized():
        return
    from rayfleet.platform.connection import connect

    connect(address)


def _wait_healthy(url: str, deadline: float, *, path: str = "/health", api_key: str | None = None) -> None:
    import urllib.error
    import urllib.request

    last = ""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # a vLLM app's path is guarded
    delays = poll_delays(max_s=1.0)
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(next(delays))
    raise ServeDeployError(f"the app at {url} did not report healthy engines in time ({last}). Fix: check "
                           "`serve status` and the replica logs; raise the timeout for large models")


def _proxy_host_port(spec: ServeSpec) -> tuple[str, int]:
    """Where the running Serve's HTTP proxy listens (see module doc)."""
    from rayfleet.platform.ray_compat import serve_proxy_address

    host, port = serve_proxy_address()
    if (host, port) != (spec.http.host, spec.http.port):
        log.warning("serve %r: Serve already runs its HTTP proxy on %s:%s, so http.host/http.port=%s:%s is not "
                    "used; the app is served there (to move the proxy, stop Serve first: `serve shutdown`)",
                    spec.name, host, port, spec.http.host, spec.http.port)
    return host, port


def deploy(spec: ServeSpec | dict[str, Any] | str | Path, *, address: str | None = None,
           timeout_s: float = 300.0) -> ServeDeployment:
    """Deploy ``spec`` (a ``ServeSpec``, its dict, or a serve YAML path) and wait until it
    serves. Raises ``SpecError`` for a bad spec and ``ServeDeployError`` if the app does not
    come up within ``timeout_s``."""
    spec = load_serve_spec(spec) if isinstance(spec, (str, Path)) else ServeSpec.parse(spec)
    # API keys (``api_keys``; a vLLM app's ingress is ``vllm.ingress``): a key is made
    # when none is configured.
    from rayfleet.serving.api_keys import ensure_client_key

    http, api_key = ensure_client_key(spec.http, app_name=spec.name)
    spec = spec.model_copy(update={"http": http})
    _ensure_connected(address)
    from ray import serve

    from rayfleet.serving.openai_api.serve_app import build_app
    health_path = "/health"
    if spec.engine.kind == "vllm":  # Ray Serve LLM's app (rayfleet.serving.vllm), same deploy path
        from rayfleet.serving.vllm.app import HEALTH_PATH as health_path, build_vllm_app as build_app
    deadline = time.monotonic() + timeout_s
    pools = spec.pools()
    # queue admission of every pool and its Serve bounds, before anything is deployed (the same
    # admit_app as Serve's own deploy of the app_builder config)
    admission = admit_app(spec.name, pools, deployment_name=lambda role: pool_deployment_name(spec, role),
                          deadline=deadline)
    try:
        # HeadOnly: the local fleet's nodes share one IP, so a proxy per node would fight for the port.
        serve.start(proxy_location="HeadOnly", http_options={"host": spec.http.host, "port": spec.http.port})
        served = _run_and_wait(spec, build_app, health_path, api_key, deadline)
    except BaseException:
        admission.release("the Serve app did not come up")
        raise
    admission.report_started(pools)
    served.grants = dict(admission.grants)
    return served


def _run_and_wait(spec: ServeSpec, build_app, health_path: str, api_key: str | None,
                  deadline: float) -> ServeDeployment:
    from ray import serve

    try:
        serve.run(build_app(spec), name=spec.name, route_prefix=spec.http.route_prefix, blocking=False)
    except RuntimeError as exc:  # Serve raises RuntimeError when a deployment fails to start
        raise ServeDeployError(f"serving {spec.name!r} failed: {exc}") from None
    if spec.engine.kind == "vllm":  # its ingress answers before the engines run
        from rayfleet.serving.vllm.app import wait_until_running

        problem = wait_until_running(spec.name, deadline)
        if problem:
            raise ServeDeployError(f"serving {spec.name!r} failed: {problem}. Fix: check `serve status` and the "
                                   "replica logs; raise the timeout for large models")
    host, port = _proxy_host_port(spec)
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{host}:{port}{spec.http.route_prefix.rstrip('/')}"
    _wait_healthy(url, deadline, path=health_path, api_key=api_key)
    return ServeDeployment(spec=spec, url=url, api_key=api_key)
