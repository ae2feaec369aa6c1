"""The OpenAI-compatible HTTP API (FastAPI), served through the Serve ingress deployment.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` gives
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text).

Design decisions:
- ``build_openai_app(service, model_name)`` builds the app around an ``InferenceService``;
  the Serve ingress (``deployments``) and unit tests (Starlette's TestClient) use the same app.
- Bodies are parsed and validated here, not by FastAPI's automatic 422: OpenAI clients expect
  400 with ``{"error": {"message", "type", "param", "code"}}``; an unknown model is 404.
  A prompt that leaves no room for one token in the context (``len >= max_model_len``) is a
  400; ``max_tokens`` beyond the context ends the request with ``finish_reason="length"``.
- Tokenization is the model's ``ByteTokenizer``: a completion prompt is BOS + its UTF-8 bytes
  (or a list of token ids, used as given); a chat is BOS + ``<|role|>\\ncontent\\n`` per message
  + ``<|assistant|>\\n``. Text is decoded incrementally so a UTF-8 character split across
  tokens is emitted whole. Engines never sample ids the tokenizer cannot decode (``sampling``).
- Extensions (as in vLLM): ``top_k``, ``ignore_eos``, ``cache_salt``, and ``return_token_ids``
  (adds ``token_ids`` to each choice, used by exactness tests).
- A client that disconnects mid-stream cancels the response generator; closing the service's
  stream aborts the request on its replica, which frees its blocks.
"""

from __future__ import annotations

import codecs
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.models import ByteTokenizer
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.deploy.inference_service import Delta, InferenceService, ServiceUnavailableError

__all__ = ["build_openai_app", "encode_completion_prompt", "encode_chat", "APIError"]

_TOKENIZER = ByteTokenizer()

log = logging.getLogger(__name__)


def _internal_error(rid: str, exc: BaseException) -> "APIError":
    """An unexpected failure as an OpenAI-style 500 that names it (logged with its traceback),
    instead of Starlette's bare ``Internal Server Error`` text."""
    log.error("request %s failed unexpectedly", rid, exc_info=exc)
    return APIError(500, f"request {rid} failed: {type(exc).__name__}: {exc}", type_="internal_server_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def encode_completion_prompt(prompt: Any) -> list[int]:
    """BOS + UTF-8 bytes of a string prompt; a list of ints is used as given."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _TOKENIZER.encode(prompt, add_bos=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                   param="prompt")


def encode_chat(messages: Any) -> list[int]:
    """BOS + ``<|role|>\\ncontent\\n`` per message + ``<|assistant|>\\n`` (see module doc)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] needs a string role and content", param="messages")
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return _TOKENIZER.encode("".join(parts) + "<|assistant|>\n", add_bos=True)


def _sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens") if chat and "max_completion_tokens" in body else body.get(
        "max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if body.get("n", 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    try:
        return SamplingParams(max_tokens=int(max_tokens), temperature=float(body.get("temperature", 1.0)),
                              top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0) or 0),
                              seed=body.get("seed"), stop=tuple(_stop_list(body.get("stop"))),
                              ignore_eos=bool(body.get("ignore_eos", False)))
    except SpecError as exc:
        raise APIError(400, str(exc), param=exc.field) from None
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"bad sampling parameter: {exc}") from None


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise APIError(400, "stop must be a string or a list of strings", param="stop")


def build_openai_app(service: InferenceService, *, model_name: str):
    """The FastAPI app for ``service`` serving one model named ``model_name``."""
    app = FastAPI(title="rayfleet OpenAI-compatible API")
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _parse(request: Request, *, chat: bool) -> tuple[dict[str, Any], list[int], SamplingParams]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        if body.get("model", model_name) != model_name:
            raise APIError(404, f"model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found", type_="NotFoundError")
        prompt = encode_chat(body.get("messages")) if chat else encode_completion_prompt(body.get("prompt"))
        params = _sampling(body, chat=chat)
        max_len = await service.max_model_len()
        if len(prompt) >= max_len:
            raise APIError(400, f"the prompt has {len(prompt)} tokens but the context is {max_len} tokens "
                           "(room for at least one generated token is needed); shorten the prompt",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        bad = [t for t in prompt if not 0 <= t < _TOKENIZER.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the tokenizer's [0, {_TOKENIZER.vocab_size})",
                           param="prompt")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise APIError(400, "cache_salt must be a string", param="cache_salt")
        return body, prompt, params

    def _choice(chat: bool, text: str, finish: str | None, token_ids: list[int] | None, *, delta: bool) -> dict:
        if chat:
            key = "delta" if delta else "message"
            choice = {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    async def _handle(request: Request, *, chat: bool):
        body, prompt, params = await _parse(request, chat=chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        obj = "chat.completion" if chat else "text_completion"
        with_ids = bool(body.get("return_token_ids"))
        stream = service.stream(prompt, params, cache_salt=body.get("cache_salt"), request_id=rid)
        if body.get("stream"):
            return StreamingResponse(_sse(rid, obj + (".chunk" if chat else ""), chat, stream, with_ids, body),
                                     media_type="text/event-stream")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        tokens: list[int] = []
        last: Delta | None = None
        cached = 0  # reported by the replica that prefilled (the first delta in disaggregated mode)
        try:
            async for d in stream:
                tokens.extend(d.token_ids)
                cached = max(cached, d.num_cached_tokens)
                last = d
        except ServiceUnavailableError as exc:
            raise APIError(503, str(exc), type_="ServiceUnavailableError") from None
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged with the traceback
            raise _internal_error(rid, exc) from None
        finally:
            await stream.aclose()
        text = decoder.decode(bytes(t for t in tokens if t < 256), final=True)
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                "choices": [_choice(chat, text, last.finish_reason if last else None,
                                    tokens if with_ids else None, delta=False)],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                          "total_tokens": len(prompt) + len(tokens),
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    async def _sse(rid: str, obj: str, chat: bool, stream: AsyncIterator[Delta], with_ids: bool,
                   body: dict) -> AsyncIterator[bytes]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        num_tokens = 0
        try:
            async for d in stream:
                num_tokens += len(d.token_ids)
                text = decoder.decode(bytes(t for t in d.token_ids if t < 256), final=d.finish_reason is not None)
                chunk = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                         "choices": [_choice(chat, text, d.finish_reason, list(d.token_ids) if with_ids else None,
                                             delta=True)]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [],
                         "usage": {"completion_tokens": num_tokens}}
                yield f"data: {json.dumps(usage)}\n\n".encode()
        except (ServiceUnavailableError, RayfleetError) as exc:
            err = APIError(503, str(exc), type_="ServiceUnavailableError")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event, never a hang
            yield f"data: {json.dumps(_internal_error(rid, exc).body())}\n\n".encode()
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        max_len = await service.max_model_len()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "rayfleet", "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        states = await service.router.replica_states()
        healthy = [n for n, s in states.items() if s.snapshot.healthy]
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "starting", "replicas": sorted(healthy)},
                            status_code=status)

    @app.get("/metrics")
    async def metrics():
        states = await service.router.replica_states()
        return Response(service.metrics.render(states), media_type="text/plain; version=0.0.4")

    @app.get("/v1/block_usage")
    async def block_usage():
        """rayfleet extension: each replica's KV block usage (leak checks, dashboards)."""
        usage = await service.block_usage()
        return {name: (u.__dict__ if u is not None else None) for name, u in usage.items()}

    return app
