"""How the router and the ingress talk to one engine replica, in-process or through Serve.

Design decisions:
- One small async interface (``ReplicaClient``) with two implementations: ``ServeReplicaClient``
  wraps a Serve ``DeploymentHandle`` (``.remote()``, ``stream=True`` for token streams) and
  ``LocalReplicaClient`` calls an ``AsyncEngine`` in the same process (unit tests and
  benchmarks of the policies without Ray). The ingress and the router are written once
  against the interface.
- A replica that is gone (actor died, Serve has no running replica, or a local replica that
  was stopped) surfaces as ``ReplicaUnavailableError``, the one error the ingress retries or
  resumes on; user errors (``SpecError``) and lost KV (``KVTransferError``) keep their types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from rayfleet.errors import RayfleetError
from rayfleet.serving.errors import ReplicaUnavailableError
from rayfleet.serving.engine.replica_output import GenerationChunk, PrefillReply
from rayfleet.serving.engine.replica_state import BlockUsage, ReplicaState
from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle, KVTransferError
from rayfleet.serving.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the engine (torch) is the caller's: the ingress imports the clients only
    from rayfleet.serving.engine.async_engine import AsyncEngine

__all__ = ["ReplicaClient", "ReplicaUnavailableError", "LocalReplicaClient", "ServeReplicaClient"]


class ReplicaClient(Protocol):
    name: str

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 cache_salt: str | None) -> AsyncIterator[GenerationChunk]: ...

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      cache_salt: str | None) -> PrefillReply: ...

    def decode(self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams,
               handle: KVHandle, cache_salt: str | None) -> AsyncIterator[GenerationChunk]: ...

    async def release_kv(self, handoff_id: HandoffId) -> bool: ...

    async def abort(self, request_id: str) -> None: ...

    async def block_usage(self) -> BlockUsage: ...

    async def poll_state(self) -> ReplicaState: ...

    async def tokenizer(self) -> Any: ...  # the served model's tokenizer (``AsyncEngine.tokenizer``)

    # Split prefill of long prompts (``split_prefill``): one layer of one span per call.
    async def prefill_span(self, work: Any) -> Any: ...

    async def release_span(self, job_id: str) -> int: ...


class LocalReplicaClient:
    """An ``AsyncEngine`` in this process. ``stop()`` makes it behave like a dead replica:
    calls and in-flight streams raise ``ReplicaUnavailableError``."""

    def __init__(self, engine: AsyncEngine) -> None:
        from rayfleet.serving.routing.split_prefill import SpanPrefillWorker

        self.engine = engine
        self.name = engine.name
        self.stopped = False
        self.spans = SpanPrefillWorker(engine)

    def _check(self) -> None:
        if self.stopped:
            raise ReplicaUnavailableError(self.name, "stopped")

    def stop(self) -> None:
        self.stopped = True

    async def _stream(self, gen: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        try:
            async for chunk in gen:
                self._check()
                yield chunk
        finally:
            await gen.aclose()

    def generate(self, request_id, prompt, params, cache_salt):
        self._check()
        return self._stream(self.engine.generate(request_id, prompt, params, cache_salt=cache_salt))

    async def prefill(self, request_id, prompt, params, cache_salt):
        self._check()
        reply = await self.engine.prefill(request_id, prompt, params, cache_salt=cache_salt)
        self._check()
        return reply

    def decode(self, request_id, prompt, first_token_id, params, handle, cache_salt):
        self._check()
        return self._stream(self.engine.decode(request_id, prompt, first_token_id, params, handle,
                                               self.engine.transport, cache_salt=cache_salt))

    async def release_kv(self, handoff_id):
        return self.engine.release_kv(handoff_id)

    async def abort(self, request_id):
        await self.engine.abort(request_id)

    async def block_usage(self):
        return await self.engine.block_usage()

    async def poll_state(self):
        self._check()
        return await self.engine.poll_state()

    async def tokenizer(self):
        self._check()
        return self.engine.tokenizer()

    async def prefill_span(self, work):
        self._check()
        reply = await self.spans.run(work)
        self._check()
        return reply

    async def release_span(self, job_id):
        return self.spans.release(job_id)


def _is_replica_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a Serve handle call) means the replica is gone or unreachable.

    Serve surfaces a dead replica in several shapes: Ray's actor errors (also wrapped in a
    ``RayTaskError`` or chained as the cause of a ``RayServeException``), its own
    ``ReplicaUnavailableError`` when a chosen replica left the set before dispatch, and
    ``DeploymentUnavailableError`` when the deployment has no running replica."""
    import ray

    failures: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
    try:
        from ray.serve.exceptions import DeploymentUnavailableError
        from ray.serve.exceptions import ReplicaUnavailableError as ServeReplicaUnavailableError

        failures += (DeploymentUnavailableError, ServeReplicaUnavailableError)
    except ImportError:  # older Serve
        pass
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, failures):
            return True
        cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return False


class ServeReplicaClient:
    """One engine replica deployment (``EngineReplica``) through its Serve handle."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle

    def _translate(self, exc: BaseException) -> BaseException:
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError):  # an error raised inside the replica
            cause = exc.as_instanceof_cause()
            if isinstance(cause, (RayfleetError, KVTransferError)):
                return cause
        if _is_replica_failure(exc):
            return ReplicaUnavailableError(self.name, type(exc).__name__)
        return exc

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - translated, then re-raised
            raise self._translate(exc) from None

    async def _stream(self, method: str, *args: Any) -> AsyncIterator[GenerationChunk]:
        gen = getattr(self.handle.options(stream=True), method).remote(*args)
        try:
            async for chunk in gen:
                yield chunk
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc) from None
        finally:
            gen.cancel()  # no-op when finished; cancels (aborts) the replica's request otherwise

    def generate(self, request_id, prompt, params, cache_salt):
        return self._stream("generate", request_id, prompt, params, cache_salt)

    async def prefill(self, request_id, prompt, params, cache_salt):
        return await self._call("prefill", request_id, prompt, params, cache_salt)

    def decode(self, request_id, prompt, first_token_id, params, handle, cache_salt):
        return self._stream("decode", request_id, prompt, first_token_id, params, handle, cache_salt)

    async def release_kv(self, handoff_id):
        return await self._call("release_kv", handoff_id)

    async def abort(self, request_id):
        await self._call("abort", request_id)

    async def block_usage(self):
        return await self._call("block_usage")

    async def poll_state(self):
        return await self._call("poll_state")

    async def tokenizer(self):
        return await self._call("tokenizer")

    async def prefill_span(self, work):
        return await self._call("prefill_span", work)

    async def release_span(self, job_id):
        return await self._call("release_span", job_id)
