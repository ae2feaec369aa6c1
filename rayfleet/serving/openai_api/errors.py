"""Every HTTP error in OpenAI's shape, and no internal text leaving the server.

Design decisions:
- One body for every status (400/401/404/405/413/422/429/500/503):
  ``{"error": {"message", "type", "param", "code"}}``, which the official client turns into
  its typed exceptions (``BadRequestError``, ``AuthenticationError``, ``RateLimitError``...).
- Starlette's own 404/405 and FastAPI's 422 (``{"detail": ...}``) are re-shaped here; an
  unexpected exception is logged with a request id and its traceback, and the client gets
  only that id (``internal_error``), never the exception's text.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "internal_error", "error_response", "install_error_handlers"]

log = logging.getLogger("rayfleet.serving.openai_api")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_exceeded", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answer: ``status``, a message for the client, the ``param`` at fault, a ``code``.
    ``headers`` (e.g. ``Retry-After``) go on the response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """An unexpected failure: logged here with a request id and its traceback; the client gets
    the id to quote, not the exception's text."""
    rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
    log.error("request %s failed unexpectedly", rid, exc_info=exc)
    return APIError(500, f"the server failed to process request {rid}; quote this id to the operator "
                         "(the server log has the details)", code="internal_error")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app or the framework raises through ``APIError``'s shape."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}; see GET /v1/models, "
                                "POST /v1/completions, POST /v1/chat/completions", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(APIError(422, f"{param}: {first.get('msg', 'invalid value')}", param=param))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        return error_response(internal_error(exc))
