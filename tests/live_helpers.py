"""What the live tiers (tests/cluster, tests/vllm) share: ``wait_until``, the token dataset their
training jobs read, and ``Burst``, the streamed OpenAI load of the autoscaler tests.

``Burst``: ``clients`` threads each stream completions, one after the other, until ``join()``; every request
is recorded (prompt, text, first-token time, error), so a test can count failures, check answers
and measure TTFT against the SLO while the autoscaler lends an accelerator. Importable as
``live_helpers`` because pyproject's pytest settings put ``tests/`` on the path.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


def wait_until(predicate, *, timeout_s: float = 30.0, interval_s: float = 0.25, what: str = "condition"):
    """``predicate()``'s first truthy value, polled every ``interval_s``; AssertionError after ``timeout_s``.

    Each wait prints how long it took (pytest shows it for a failed test, or with ``-s``): where a
    live test's time goes."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            print(f"[wait] {time.monotonic() - start:6.1f}s for {what}", flush=True)
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def stdlib_json_tokens(tmp_path_factory) -> str:
    """Token shards of Python's own ``json`` package (on every machine, no download): the live
    tiers' training data."""
    from rayfleet.storage.tokens import prepare_token_dataset

    out = str(tmp_path_factory.mktemp("tokens") / "stdlib-json")
    prepare_token_dataset([os.path.join(os.path.dirname(os.__file__), "json")], out, shard_tokens=1 << 15, seq_len=128)
    return out


class Burst:
    """``clients`` threads streaming completions of ``prompt(client, n)`` until stopped.
    ``pause()`` holds each client before its next request (one in flight finishes) until
    ``resume()``."""

    def __init__(self, base_url: str, *, clients: int, model: str, prompt: Callable[[int, int], str],
                 max_tokens: int, api_key: str | None = None, timeout_s: float = 120.0,
                 temperature: float = 0.0) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0, timeout=timeout_s)
        self.model, self.prompt, self.max_tokens, self.temperature = model, prompt, max_tokens, temperature
        self.timeout_s = timeout_s
        self.results: list[dict] = []
        self.stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> "Burst":
        for t in self.threads:
            t.start()
        return self

    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def join(self) -> None:
        self.stop.set()
        self._go.set()
        for t in self.threads:
            t.join(timeout=self.timeout_s + 60)

    def _run(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            self._go.wait()
            if self.stop.is_set():
                break
            prompt = self.prompt(index, n)
            sent, first, error, text = time.monotonic(), None, None, ""
            try:
                for chunk in self.client.completions.create(model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                                                            temperature=self.temperature, stream=True):
                    if chunk.choices and chunk.choices[0].text:
                        first = first or time.monotonic()
                        text += chunk.choices[0].text
            except Exception as exc:  # noqa: BLE001 - counted as a failed request
                error = repr(exc)
            self.results.append({"prompt": prompt, "text": text, "chars": len(text), "error": error,
                                 "end": time.monotonic(), "ttft_s": None if first is None else first - sent})
            n += 1


def greedy_reference(model: dict, engine: dict, *, max_tokens: int) -> Callable[..., list[int]]:
    """``run(prompt, max_tokens=...)``: the greedy tokens one in-process engine of ``model`` and
    ``engine`` (serve-spec dicts) gives for a completion prompt: the ground truth live apps match."""
    from rayfleet.serving.engine.loading import load_engine
    from rayfleet.serving.engine.sampling import SamplingParams
    from rayfleet.serving.openai_api.app import encode_completion_prompt
    from rayfleet.serving.spec import ServeSpec

    spec = ServeSpec.parse({"model": model, "engine": engine})
    m = spec.model
    llm = load_engine(preset_name=m.preset, seed=m.seed, checkpoint=None, dtype=m.dtype, overrides=m.overrides,
                      config=spec.engine_config())

    def run(prompt: str, max_tokens: int = max_tokens) -> list[int]:
        (result,) = llm.generate([encode_completion_prompt(prompt)],
                                 SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return list(result.output_token_ids)
    return run


def free_port() -> int:
    """A TCP port free on loopback now (an app's HTTP port in the live tiers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
