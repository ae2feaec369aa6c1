"""The OpenAI app over a ``GenerationService`` that is not ``InferenceService``.

``openai_api.app`` owns the protocol it needs (``generation_service``) and never imports
``deploy``; this fake has only the protocol's methods (no ``router``, no ``metrics``), so an app
that reached past the protocol into the request path's attributes fails here. It also checks that
the engine's ``GenerationChunk`` is what reaches the app, frozen and pickleable (it crosses Ray).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from rayfleet.models import ByteTokenizer
from rayfleet.serving.engine.replica_output import GenerationChunk
from rayfleet.serving.engine.sampling import TokenLogprobs
from rayfleet.serving.openai_api.app import build_openai_app
from rayfleet.serving.spec import HttpSpec

ANSWER = tuple(b"ladder")  # byte tokenizer: ids 0..255 are the bytes


class ScriptedService:
    """Answers every request with ``ANSWER``, two tokens per chunk, then ``length``."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def stream(self, prompt, params, *, cache_salt=None, request_id=None):
        self.prompts.append(list(prompt))
        tokens = ANSWER[:params.max_tokens]
        for i in range(0, len(tokens), 2):
            last = i + 2 >= len(tokens)
            yield GenerationChunk(token_ids=tokens[i:i + 2], finished=last, finish_reason="length" if last else None,
                                  num_prompt_tokens=len(prompt), replica="fake/0")

    async def tokenizer(self):
        return ByteTokenizer()

    async def max_model_len(self) -> int:
        return 128

    async def replica_states(self):
        return {}

    async def metrics_text(self) -> bytes:
        return b"# scripted\n"

    async def block_usage(self):
        return {}


@pytest.fixture()
def client():
    service = ScriptedService()
    app = build_openai_app(service, model_name="m", http=HttpSpec(auth="disabled"))
    with TestClient(app) as http:
        yield http, service


def test_the_app_serves_completions_and_streams_from_any_generation_service(client):
    http, service = client
    body = {"model": "m", "prompt": "hi", "max_tokens": len(ANSWER), "temperature": 0}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ladder", "length")
    assert service.prompts[-1] == ByteTokenizer().encode("hi", add_bos=True)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "ladder"
    assert http.get("/metrics").text == "# scripted\n"
    assert http.get("/health").status_code == 503  # no replica has reported


def test_a_generation_chunk_is_frozen_and_pickles():
    chunk = GenerationChunk(token_ids=(1, 2), finished=True, finish_reason="stop", stop_reason=2,
                            logprobs=(TokenLogprobs(-0.5, ((1, -0.5),)), TokenLogprobs(-0.1)), replica="r/0")
    assert pickle.loads(pickle.dumps(chunk)) == chunk
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.token_ids = ()  # type: ignore[misc]


def test_the_openai_app_and_its_choices_never_import_deploy():
    """Only the rooms that wire the service in (``serve_app``, ``in_process``) may."""
    root = Path(__file__).resolve().parents[3] / "rayfleet" / "serving" / "openai_api"
    for name in ("app", "generation", "generation_service", "responses", "text_stream", "tokenization"):
        tree = ast.parse((root / f"{name}.py").read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.startswith("rayfleet.serving.deploy")], name
