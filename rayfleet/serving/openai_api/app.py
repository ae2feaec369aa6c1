"""The OpenAI-compatible HTTP API (FastAPI), served through the Serve ingress deployment.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` gives
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (no key), ``GET /metrics`` (Prometheus text), ``GET /v1/block_usage``.

Design decisions:
- ``build_openai_app(service, model_name=..., http=...)`` builds the app around a
  ``GenerationService`` (``generation_service``: a protocol this room owns, which the request
  path's ``InferenceService`` satisfies), so the app never imports ``deploy``; the Serve
  ingress (``serve_app``), the in-process stack and unit tests (Starlette's TestClient, the
  official ``openai`` client over it) pass the service in and use the same app.
- Hardened edge, in this order: bearer key (``serving.api_keys``; every route but ``/health``), body size
  (413, read in bounded pieces, never trusted from ``Content-Length`` alone), JSON, schema
  (``schemas``: strict types and OpenAI ranges, 400 naming the parameter), parameters the
  server cannot honour (400 naming them), model (404), deployment limits (stop strings, ``n``,
  batch size), context (prompt + ``max_tokens`` beyond the context is a 400, never a silent
  clamp), then the app's bound on engine requests in flight (429 with ``Retry-After``; each
  replica bounds its own queue too). Every error has OpenAI's shape (``errors``).
- Tokenization is the served model's own tokenizer, asked of the engine replicas once
  (``GenerationService.tokenizer``; ``tokenization``): the byte tokenizer of presets and
  checkpoints, or an HF model's tokenizer and chat template. A list of token ids is used as
  given. Choices run through ``generation`` (n, batches, stop strings excluded, logprobs) and
  are shaped by ``responses``; text, logprob tokens, usage and id ranges all follow it.
- A client that disconnects mid-stream cancels the response generator, which cancels every
  choice; closing the service's streams aborts the requests on their replicas (blocks freed).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from rayfleet.errors import SpecError
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.openai_api import responses as R
from rayfleet.serving.api_keys import ApiKeyMiddleware, resolve_api_keys
from rayfleet.serving.openai_api.errors import APIError, error_response, install_error_handlers
from rayfleet.serving.openai_api.generation_service import GenerationService
from rayfleet.serving.openai_api.generation import (ChoiceEvent, ChoiceJob, ChoiceResult, choice_params, run_choices,
                                                    service_error, stream_choices)
from rayfleet.serving.openai_api.schemas import ChatCompletionRequest, CompletionRequest, first_error
from rayfleet.serving.openai_api.tokenization import BYTE, ServedTokenizer, served_tokenizer
from rayfleet.serving.spec import HttpLimitsSpec, HttpSpec

__all__ = ["build_openai_app", "encode_completion_prompt", "encode_chat", "APIError"]

def encode_completion_prompt(prompt: str | list[int], tokenizer: ServedTokenizer = BYTE) -> list[int]:
    """A string prompt encoded by ``tokenizer`` (byte tokenizer: BOS + UTF-8 bytes); a list of
    token ids is used as given."""
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    return list(prompt)


def encode_chat(messages: list[Any], tokenizer: ServedTokenizer = BYTE) -> list[int]:
    """The chat prompt as ``tokenizer`` formats it (``tokenization``). Accepts ``ChatMessage``
    models or plain dicts of the same shape."""
    return tokenizer.encode_chat(messages)


def _prompts(req: CompletionRequest, tok: ServedTokenizer) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [encode_completion_prompt(p, tok)]
    if p and isinstance(p[0], str):
        return [encode_completion_prompt(s, tok) for s in p]
    if p and isinstance(p[0], int):
        return [list(p)]
    return [list(x) for x in p]


class _Limits:
    """The deployment limits (``http.limits``) and the app's engine requests in flight."""

    def __init__(self, limits: HttpLimitsSpec) -> None:
        self.spec = limits
        self.in_flight = 0

    def check_stop(self, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        n, chars = self.spec.max_stop_sequences, self.spec.max_stop_chars
        if len(stops) > n:
            raise APIError(400, f"stop has {len(stops)} sequences; at most {n} are allowed", param="stop")
        if any(len(s) > chars for s in stops):
            raise APIError(400, f"a stop sequence is longer than {chars} characters", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "a stop sequence is empty (it would stop at once); remove it", param="stop")
        return stops

    def admit(self, num: int, *, reserve: bool = True) -> None:
        """Count ``num`` engine requests in (``reserve``; a stream counts itself once its body
        starts, so a client gone before that leaks nothing); 429 when the app is full."""
        limit = self.spec.max_concurrent_requests
        if num > limit:
            raise APIError(400, f"the request asks for {num} generations (prompts x n); at most {limit}",
                           param="n")
        if self.in_flight + num > limit:
            raise APIError(429, f"the server is busy ({self.in_flight} generations in flight, limit {limit}); "
                                "retry after a short wait", code="overloaded",
                           headers={"Retry-After": str(self.spec.retry_after_s)})
        if reserve:
            self.in_flight += num


def _sampling(req: CompletionRequest | ChatCompletionRequest, stops: tuple[str, ...], max_tokens: int,
              num_logprobs: int | None, *, vocab_size: int) -> SamplingParams:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(400, f"logit_bias key {key[:20]!r} is not a token id in [0, {vocab_size})",
                           param="logit_bias")
        bias[int(key)] = value
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0), seed=req.seed,
            stop=stops, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias, logprobs=num_logprobs)
    except SpecError as exc:
        raise APIError(400, str(exc), param=exc.field) from None


def build_openai_app(service: GenerationService, *, model_name: str, http: HttpSpec | None = None) -> Any:
    """The ASGI app for ``service`` serving one model named ``model_name``; ``http`` gives the
    keys and limits (default ``HttpSpec()``: keys required, read from ``RAYFLEET_API_KEY``)."""
    http = http or HttpSpec()
    app = FastAPI(title="rayfleet OpenAI-compatible API")
    install_error_handlers(app)
    completions = _Completions(service, model_name=model_name, http=http)
    _routes(app, service, model_name, int(time.time()), completions.handle)
    keys = resolve_api_keys(auth=http.auth, env_names=http.api_keys.env, file=http.api_keys.file)
    if keys is not None:  # outermost: a request without a key reaches nothing, not even a 404
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    return app


class _Completions:
    """``POST /v1/completions`` and ``/v1/chat/completions``: the checks of the module doc in
    order, then the choices (``generation``) shaped by ``_Response``."""

    def __init__(self, service: GenerationService, *, model_name: str, http: HttpSpec) -> None:
        self.service, self.model_name, self.http = service, model_name, http
        self.limits = _Limits(http.limits)
        self._tokenizer: ServedTokenizer | None = None

    async def tokenizer(self) -> ServedTokenizer:
        """The served model's tokenizer, from the engine replicas (asked once)."""
        if self._tokenizer is None:
            self._tokenizer = served_tokenizer(await self.service.tokenizer())
        return self._tokenizer

    async def _read_json(self, request: Request) -> dict[str, Any]:
        cap = self.http.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise APIError(413, f"the body has {declared} bytes; at most {cap} are accepted", code="body_too_large")
        data, size = [], 0
        async for part in request.stream():  # counted as read: Content-Length may be absent or wrong
            size += len(part)
            if size > cap:
                raise APIError(413, f"the body exceeds {cap} bytes", code="body_too_large")
            data.append(part)
        try:
            body = json.loads(b"".join(data))
        except (ValueError, RecursionError):
            raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        try:  # JSON may escape lone UTF-16 surrogates ("\\ud800"), which no UTF-8 text can hold
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the body contains a lone surrogate escape (\\ud800-\\udfff), which is not "
                                "valid Unicode text", code="invalid_unicode") from None
        return body

    async def read_body(self, request: Request, schema: type) -> Any:
        """The validated request model; APIError 413/400/404 otherwise."""
        body = await self._read_json(request)
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            param, message = first_error(exc)
            raise APIError(400, message, param=param) from None
        refusal = req.refusals()
        if refusal is not None:
            raise APIError(400, refusal[1], param=refusal[0], code="unsupported_parameter")
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model[:100]!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        return req

    async def plan(self, req: Any, prompts: list[list[int]], *, chat: bool, rid: str,
                   num_logprobs: int | None, vocab_size: int) -> list[ChoiceJob]:
        """One ``ChoiceJob`` per (prompt, choice), after the deployment limits and the context."""
        lim = self.http.limits
        n = req.n or 1
        if n > lim.max_n:
            raise APIError(400, f"n={n} is above this server's limit of {lim.max_n}", param="n")
        if len(prompts) > lim.max_batch_prompts:
            raise APIError(400, f"{len(prompts)} prompts in one request; at most {lim.max_batch_prompts}",
                           param="prompt")
        stops = self.limits.check_stop(req.stop)
        ctx = await self.service.max_model_len()
        asked = req.effective_max_tokens if chat else req.max_tokens
        jobs = []
        for p, prompt in enumerate(prompts):
            room = _room(prompt, ctx, asked, chat=chat, vocab_size=vocab_size, max_param="max_completion_tokens"
                         if chat and req.max_completion_tokens else "max_tokens")
            max_tokens = asked if asked is not None else (room if chat else min(16, room))
            params = _sampling(req, stops, max_tokens, num_logprobs, vocab_size=vocab_size)
            jobs += [ChoiceJob(p * n + i, p, prompt, choice_params(params, i), f"{rid}-{p * n + i}") for i in range(n)]
        return jobs

    async def handle(self, request: Request, *, chat: bool) -> Any:
        req = await self.read_body(request, ChatCompletionRequest if chat else CompletionRequest)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        num_lp = (req.top_logprobs or 0) if chat and req.logprobs else (None if chat else req.logprobs)
        retry = self.http.limits.retry_after_s
        try:  # e.g. no replica has given its tokenizer or reported its context yet
            tok = await self.tokenizer()
            prompts = [encode_chat(req.messages, tok)] if chat else _prompts(req, tok)
            jobs = await self.plan(req, prompts, chat=chat, rid=rid, num_logprobs=num_lp, vocab_size=tok.vocab_size)
        except Exception as exc:  # noqa: BLE001
            raise service_error(exc, rid, retry_after_s=retry) from None
        self.limits.admit(len(jobs), reserve=not req.stream)
        ctx = _Response(rid, self.model_name, chat, req, prompts, sum(len(p) for p in prompts), tok)
        if req.stream:
            return StreamingResponse(self.sse(ctx, jobs), media_type="text/event-stream")
        try:
            results = await run_choices(self.service, jobs, cache_salt=req.cache_salt, tokenizer=tok)
        except Exception as exc:  # noqa: BLE001 - mapped to a status; internals logged, not sent
            raise service_error(exc, rid, retry_after_s=retry) from None
        finally:
            self.limits.in_flight -= len(jobs)
        return ctx.body(results)

    async def sse(self, ctx: "_Response", jobs: list[ChoiceJob]) -> AsyncIterator[bytes]:
        """The stream's body; counts its jobs in flight from its first byte to its end."""
        self.limits.in_flight += len(jobs)
        stream = stream_choices(self.service, jobs, cache_salt=ctx.req.cache_salt, tokenizer=ctx.tok)
        try:
            async for item in stream:
                if isinstance(item, ChoiceEvent):
                    yield R.sse(ctx.chunk(item))
                elif ctx.include_usage:
                    yield R.sse(ctx.usage_chunk(item))
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event, never a hang
            yield R.sse(service_error(exc, ctx.rid, retry_after_s=self.http.limits.retry_after_s).body())
        finally:
            self.limits.in_flight -= len(jobs)
            await stream.aclose()
        yield b"data: [DONE]\n\n"


def _room(prompt: list[int], ctx: int, asked: int | None, *, chat: bool, vocab_size: int, max_param: str) -> int:
    """Tokens left for the completion; 400 for ids outside the served tokenizer, a prompt that
    fills the context, or ``max_tokens`` beyond it (never a silent clamp)."""
    param = "messages" if chat else "prompt"
    if any(not 0 <= t < vocab_size for t in prompt):
        raise APIError(400, f"token ids must be in [0, {vocab_size})", param=param)
    if len(prompt) >= ctx:
        raise APIError(400, f"the prompt has {len(prompt)} tokens but the context is {ctx} tokens (room for "
                            "at least one generated token is needed); shorten the prompt",
                       param=param, code="context_length_exceeded")
    room = ctx - len(prompt)
    if asked is not None and asked > room:
        raise APIError(400, f"this model's context is {ctx} tokens; you asked for {len(prompt)} prompt + "
                            f"{asked} completion tokens; lower {max_param} to at most {room}",
                       param=max_param, code="context_length_exceeded")
    return room


def _routes(app: FastAPI, service: GenerationService, model_name: str, created: int, handle: Any) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "rayfleet",
                "max_model_len": await service.max_model_len()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [await card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error_response(APIError(404, f"the model {model_id[:100]!r} does not exist", param="model",
                                           code="model_not_found"))
        return await card()

    @app.get("/health")
    async def health():
        states = await service.replica_states()
        healthy = [n for n, s in states.items() if s.snapshot.healthy]
        return JSONResponse({"status": "ok" if healthy else "starting", "replicas": sorted(healthy)},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(await service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/block_usage")
    async def block_usage():
        """rayfleet extension: each replica's KV block usage (leak checks, dashboards)."""
        usage = await service.block_usage()
        return {name: (u.__dict__ if u is not None else None) for name, u in usage.items()}


class _Response:
    """Shapes one request's response bodies and stream chunks (see ``responses``)."""

    def __init__(self, rid: str, model: str, chat: bool, req: Any, prompts: list[list[int]], num_prompt: int,
                 tok: ServedTokenizer) -> None:
        self.rid, self.model, self.chat, self.req, self.prompts, self.tok = rid, model, chat, req, prompts, tok
        self.num_prompt = num_prompt
        self.created = int(time.time())
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.continuous_usage_stats)
        self.with_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        self.with_ids = bool(req.return_token_ids)
        self._offsets: dict[int, int] = {}
        self._started: set[int] = set()
        self._generated = 0

    def _head(self) -> dict[str, Any]:
        obj = ("chat.completion" if self.chat else "text_completion")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, ids: list[int], lps: list) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        if self.chat:
            return R.chat_logprobs(ids, lps, tokenizer=self.tok)
        offset = self._offsets.get(index, 0)
        out = R.completion_logprobs(ids, lps, offset=offset, tokenizer=self.tok)
        self._offsets[index] = offset + sum(self.tok.text_len(t) for t in ids)
        return out

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any]:
        rel = ev.released
        self._generated += len(rel.token_ids)
        choice: dict[str, Any] = {"index": ev.index, "logprobs": self._logprobs(ev.index, rel.token_ids, rel.logprobs),
                                  "finish_reason": ev.finish_reason, "stop_reason": ev.stop_reason}
        if self.chat:
            delta: dict[str, Any] = {"content": rel.text}
            if ev.index not in self._started:
                delta = {"role": "assistant", **delta}
                self._started.add(ev.index)
            choice["delta"] = delta
        else:
            choice["text"] = rel.text
        if self.with_ids:
            choice["token_ids"] = rel.token_ids
        head = self._head()
        head["object"] += ".chunk" if self.chat else ""
        out = {**head, "choices": [choice]}
        if self.include_usage:
            out["usage"] = R.usage(self.num_prompt, self._generated) if self.continuous else None
        return out

    def usage_chunk(self, results: list[ChoiceResult]) -> dict[str, Any]:
        head = self._head()
        head["object"] += ".chunk" if self.chat else ""
        return {**head, "choices": [], "usage": R.usage(self.num_prompt, sum(r.num_generated for r in results))}

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            text = r.text
            if not self.chat and self.req.echo:
                text = self.tok.decode(self.prompts[r.prompt_index]) + text
            c: dict[str, Any] = {"index": r.index, "logprobs": self._logprobs(r.index, r.token_ids, r.logprobs),
                                 "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
            if self.chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            if self.with_ids:
                c["token_ids"] = r.token_ids
            choices.append(c)
        cached = sum(max((r.num_cached_tokens for r in results if r.prompt_index == p), default=0)
                     for p in range(len(self.prompts)))
        return {**self._head(), "choices": choices,
                "usage": R.usage(self.num_prompt, sum(r.num_generated for r in results), cached)}
