"""Bearer API keys for every HTTP face of a served model: the built-in OpenAI app and the vLLM ingress.

Design decisions:
- Below every room (it imports nothing of ``serving``), so that ``openai_api`` and ``vllm``,
  sibling rooms at the top of the ladder, share one check without importing each other, and
  ``deployer`` makes a client key before either app exists.
- Keys come from environment variables (by name) and/or a file of one key per line, read
  where the ingress runs (``resolve_api_keys``); the spec holds only their names and path, so
  a logged or dumped spec never carries a key.
- Every route but ``/health`` needs ``Authorization: Bearer <key>`` (``/metrics`` included:
  Prometheus sends a bearer token). Keys compare in constant time.
- Fail closed: with ``auth: api_key`` and no key found, every guarded request is a 401 that
  says how to configure one. Only ``auth: disabled`` (explicit) turns the check off.
- A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: it wraps streaming responses
  without buffering them.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from rayfleet.errors import SpecError

__all__ = ["resolve_api_keys", "ApiKeyMiddleware", "OPEN_PATHS", "ensure_client_key"]

OPEN_PATHS = frozenset({"/health"})


def resolve_api_keys(*, auth: str, env_names: Collection[str], file: str | None,
                     environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The accepted keys, or ``None`` when ``auth == "disabled"``. Raises ``SpecError`` when
    ``file`` is given but unreadable (a typo must not silently lock everyone out)."""
    if auth == "disabled":
        return None
    environ = os.environ if environ is None else environ
    keys = {environ[n].strip() for n in env_names if environ.get(n, "").strip()}
    if file:
        path = Path(file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise SpecError("http.api_keys.file", file, f"cannot be read ({exc.strerror})",
                            "point it at a readable file with one API key per line") from None
        keys |= {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    return frozenset(keys)


def _unauthorized(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    """Refuses HTTP requests without a valid bearer key (401, OpenAI error shape)."""

    def __init__(self, app: Any, *, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """None when authorized, else the 401 message."""
        if not self.keys:
            return ("no API key is configured on this server: set the environment variable named in "
                    "http.api_keys.env (default RAYFLEET_API_KEY) or http.api_keys.file where the "
                    "ingress runs, or disable auth explicitly with http.auth: disabled")
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        # Compare against every key (no early exit) so timing says nothing about which matched.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        return None if ok else "incorrect API key provided"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path.rstrip("/") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        message = self._authorized(scope.get("headers", []))
        if message is None:
            await self.app(scope, receive, send)
            return
        body = _unauthorized(message)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def ensure_client_key(http: Any, *, app_name: str, key_dir: str | Path | None = None,
                      environ: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """``(http spec to deploy, key a client should send)`` for a deploy from this process.

    ``auth: disabled`` gives ``(http, None)``. A key found in the spec's sources here is used as
    is. With none, a fresh random key is written (mode 0600) to ``<key_dir>/<app_name>.key``
    (default ``~/.rayfleet/api-keys``) and the returned spec reads it from there: auth stays on
    without anyone choosing a key, and the spec carries the file's path, never the key. The
    ingress must be able to read that path (a local fleet shares this machine's files; on a
    cluster, give the key through the nodes' environment or a shared file instead).
    """
    if http.auth == "disabled":
        return http, None
    keys = resolve_api_keys(auth=http.auth, env_names=http.api_keys.env, file=http.api_keys.file, environ=environ)
    if keys:
        return http, sorted(keys)[0]
    directory = Path(key_dir).expanduser() if key_dir else Path.home() / ".rayfleet" / "api-keys"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{app_name}.key"
    key = "rf-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
    api_keys = http.api_keys.model_copy(update={"file": str(path)})
    return http.model_copy(update={"api_keys": api_keys}), key
