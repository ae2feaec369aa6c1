"""How the ingress reaches a pool deployment: ``PoolClient`` (one pool) and ``PoolRouter``.

Design decisions:
- A pool (colocated, prefill or decode) is one Serve deployment. ``PoolClient`` speaks the
  ``ReplicaClient`` interface over its handle and attaches a ``RouteHint`` to every call: the
  prompt's block hashes (computed once per call, here) and the blocks a decode needs. Serve's
  ``PrefixLoadRequestRouter``, running inside this process's handle, picks the replica; no
  router deployment sits in the request path.
- Calls that must reach one replica pin it (``RouteHint.replica``): releasing the prefill's KV
  lease goes to the replica that granted it, an abort to the replica running the request, a
  split-prefill span to its planned replica. Replicas name themselves in their answers (the
  prefill reply, the first chunk of a stream), and the client remembers request/handoff ->
  replica (bounded maps: a forgotten entry costs a lease that expires on its own).
- P/D pairing: the ingress calls the prefill pool, receives the first token, the KV handle and
  the prefill replica's id, then calls the decode pool with that handle; the decode replica
  pulls the KV and says ``committed``, and the release goes to the paired prefill replica.
- A replica that fails a call (dead actor, or no longer the pinned one) is avoided for
  ``avoid_s`` by every pool client of this ingress (``FailedReplicas``), so a resumed request
  does not land on it again before Serve notices it is gone.
- ``PoolRouter`` is the ``RouterLike`` the ``InferenceService`` asks: its plans name pools (the
  prefill pool once per allowed retry: each try is routed afresh), and its replica states come
  from the routing stats Serve hands this process's request routers.
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rayfleet.serving.deploy.replica_client import ServeReplicaClient
from rayfleet.serving.engine.replica_state import ReplicaState
from rayfleet.serving.engine.replica_output import GenerationChunk
from rayfleet.serving.routing.prompt_hashes import PromptHashCache
from rayfleet.serving.errors import ReplicaUnavailableError
from rayfleet.serving.routing.router import RoutePlan, RouteHint

__all__ = ["FailedReplicas", "PoolClient", "PinnedClient", "PoolRouter"]

_MAX_REMEMBERED = 65536


class FailedReplicas:
    """Replica ids that failed a call recently (shared by the pool clients of one ingress)."""

    def __init__(self, avoid_s: float = 30.0, clock=time.monotonic) -> None:
        self.avoid_s = avoid_s
        self.clock = clock
        self._at: dict[str, float] = {}

    def add(self, replica: str) -> None:
        self._at[replica] = self.clock()

    def current(self) -> tuple[str, ...]:
        now = self.clock()
        for r in [r for r, t in self._at.items() if now - t > self.avoid_s]:
            del self._at[r]
        return tuple(self._at)


class _Remembered(collections.OrderedDict):
    def remember(self, key: Any, value: str) -> None:
        self[key] = value
        if len(self) > _MAX_REMEMBERED:
            self.popitem(last=False)


class PoolClient(ServeReplicaClient):
    """One pool deployment through its Serve handle (see module doc). ``name`` is the pool."""

    def __init__(self, name: str, handle: Any, *, block_size: int, model_id: str,
                 failed: FailedReplicas | None = None, app_name: str | None = None) -> None:
        super().__init__(name, handle)
        self.block_size = block_size
        self.model_id = model_id
        self.app_name = app_name
        self.failed = failed or FailedReplicas()
        self.request_to_replica = _Remembered()
        self.handoff_to_replica = _Remembered()
        self.hash_cache = PromptHashCache(block_size=block_size, model_id=model_id)

    # -- hints and calls -----------------------------------------------------------------------
    def prompt_hint(self, prompt: list[int], cache_salt: str | None, max_tokens: int = 0) -> RouteHint:
        hashes = self.hash_cache.hashes(prompt, cache_salt)  # once per prompt (``routing.prompt_hashes``)
        return RouteHint(block_hashes=hashes, num_prompt_blocks=-(-len(prompt) // self.block_size),
                         num_blocks_needed=-(-(len(prompt) + max_tokens) // self.block_size),
                         avoid=self.failed.current())

    def _failure(self, exc: BaseException, replica: str | None) -> BaseException:
        err = self._translate(exc)
        if isinstance(err, ReplicaUnavailableError):
            target = replica if err.replica == self.name and replica else err.replica
            self.failed.add(target)
            if target != err.replica:
                err = ReplicaUnavailableError(target, str(err))
        return err

    async def call(self, method: str, *args: Any, route: RouteHint) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args, route=route)
        except Exception as exc:  # noqa: BLE001 - translated, then re-raised
            raise self._failure(exc, route.replica) from None

    async def stream(self, method: str, request_id: str, *args: Any,
                     route: RouteHint) -> AsyncIterator[GenerationChunk]:
        gen = getattr(self.handle.options(stream=True), method).remote(request_id, *args, route=route)
        replica = route.replica
        try:
            async for chunk in gen:
                if chunk.replica and replica is None:
                    replica = chunk.replica
                    self.request_to_replica.remember(request_id, replica)
                yield chunk
        except Exception as exc:  # noqa: BLE001
            raise self._failure(exc, replica) from None
        finally:
            gen.cancel()  # no-op when finished; cancels (aborts) the replica's request otherwise
            self.request_to_replica.pop(request_id, None)

    def pinned(self, replica: str) -> "PinnedClient":
        return PinnedClient(self, replica)

    # -- ReplicaClient ---------------------------------------------------------------------------
    def generate(self, request_id, prompt, params, cache_salt):
        return self.stream("generate", request_id, prompt, params, cache_salt,
                           route=self.prompt_hint(prompt, cache_salt, params.max_tokens))

    async def prefill(self, request_id, prompt, params, cache_salt):
        reply, replica = await self.call("prefill", request_id, prompt, params, cache_salt,
                                         route=self.prompt_hint(prompt, cache_salt))
        self.request_to_replica.remember(request_id, replica)
        if reply.handle is not None:
            self.handoff_to_replica.remember(reply.handle.handoff_id, replica)
        return reply

    def decode(self, request_id, prompt, first_token_id, params, handle, cache_salt):
        needed = -(-(len(prompt) + params.max_tokens) // self.block_size)
        return self.stream("decode", request_id, prompt, first_token_id, params, handle, cache_salt,
                           route=RouteHint(num_blocks_needed=needed, avoid=self.failed.current()))

    async def release_kv(self, handoff_id):
        replica = self.handoff_to_replica.pop(handoff_id, None)
        if replica is None:
            return False  # not granted through this client (its lease expires on its own)
        return await self.call("release_kv", handoff_id, route=RouteHint(replica=replica))

    async def abort(self, request_id):
        replica = self.request_to_replica.pop(request_id, None)
        if replica is not None:
            await self.call("abort", request_id, route=RouteHint(replica=replica))

    def replica_ids(self) -> list[str]:
        """Running replicas of the pool as this process's request router sees them."""
        router = self._router()
        return sorted(router.replica_stats()) if router is not None else []

    def _router(self):
        from rayfleet.serving.routing.request_router import PrefixLoadRequestRouter

        return PrefixLoadRequestRouter.for_deployment(self.app_name or "", self.name) if self.app_name else None

    async def block_usage(self):
        _, usage = await self.call("block_usage", route=RouteHint())
        return usage

    async def block_usage_by_replica(self) -> dict[str, Any]:
        """Every replica's ``BlockUsage`` (pinned calls), keyed ``<pool>/<replica id>``."""
        ids = self.replica_ids()
        if not ids:  # no request router in this process yet (or local testing mode): any replica
            replica, usage = await self.call("block_usage", route=RouteHint())
            return {f"{self.name}/{replica}": usage}
        out = {}
        for replica in ids:
            try:
                _, out[f"{self.name}/{replica}"] = await self.call("block_usage", route=RouteHint(replica=replica))
            except ReplicaUnavailableError:
                out[f"{self.name}/{replica}"] = None
        return out

    async def replica_states(self) -> dict[str, ReplicaState]:
        router = self._router()
        states = {}
        if router is not None:
            for replica, stats in router.replica_stats().items():
                if isinstance(stats.get("state"), ReplicaState):
                    states[f"{self.name}/{replica}"] = stats["state"]
        if not states:  # nothing published yet: ask any replica once
            replica, state = await self.call("replica_state", route=RouteHint())
            states[f"{self.name}/{replica}"] = state
        return states

    async def poll_state(self):
        _, state = await self.call("replica_state", route=RouteHint())
        return state

    async def tokenizer(self):
        return await self.call("tokenizer", route=RouteHint())

    async def prefill_span(self, work):
        raise ReplicaUnavailableError(self.name, "a span must be pinned to its planned replica (use pinned())")

    async def release_span(self, job_id):
        return 0


class PinnedClient:
    """``ReplicaClient`` for one replica of a pool: every call is pinned to it (spans, and the
    colocated decode after a split prefill)."""

    def __init__(self, pool: PoolClient, replica: str) -> None:
        self.pool = pool
        self.replica = replica
        self.name = replica

    def _hint(self) -> RouteHint:
        return RouteHint(replica=self.replica)

    def generate(self, request_id, prompt, params, cache_salt):
        return self.pool.stream("generate", request_id, prompt, params, cache_salt, route=self._hint())

    async def prefill(self, request_id, prompt, params, cache_salt):
        reply, _ = await self.pool.call("prefill", request_id, prompt, params, cache_salt, route=self._hint())
        return reply

    def decode(self, request_id, prompt, first_token_id, params, handle, cache_salt):
        return self.pool.stream("decode", request_id, prompt, first_token_id, params, handle, cache_salt,
                                route=self._hint())

    async def release_kv(self, handoff_id):
        return await self.pool.call("release_kv", handoff_id, route=self._hint())

    async def abort(self, request_id):
        await self.pool.call("abort", request_id, route=self._hint())

    async def block_usage(self):
        _, usage = await self.pool.call("block_usage", route=self._hint())
        return usage

    async def poll_state(self):
        _, state = await self.pool.call("replica_state", route=self._hint())
        return state

    async def prefill_span(self, work):
        return await self.pool.call("prefill_span", work, route=self._hint())

    async def release_span(self, job_id):
        return await self.pool.call("release_span", job_id, route=self._hint())


class PoolRouter:
    """``RouterLike`` over pool deployments (see module doc). ``service`` is set by the ingress
    so that split-prefill spans find a pinned client under their replica id."""

    def __init__(self, pools: Mapping[str, PoolClient], *, mode: str, max_prefill_retries: int,
                 long_prefill: Any = None, block_size: int = 16) -> None:
        self.pools = dict(pools)
        self.first_role = "colocated" if mode == "colocated" else "prefill"
        self.max_prefill_retries = max_prefill_retries
        self.long_prefill = long_prefill
        self.block_size = block_size
        self.service: Any = None

    async def route(self, prompt_token_ids: list[int], max_tokens: int, cache_salt: str | None = None,
                    exclude: tuple[str, ...] = ()) -> RoutePlan:
        spans: tuple = ()
        if self.long_prefill is not None:
            try:
                spans = self._spans(prompt_token_ids, cache_salt, exclude)
            except RuntimeError:  # the request router's state changed under us (its own thread): no split
                spans = ()
        decode = ("decode",) if "decode" in self.pools else ()
        return RoutePlan(first=(self.first_role,) * (self.max_prefill_retries + 1), decode=decode,
                         reason="Serve request router (prefix + load)", spans=spans)

    def _spans(self, prompt: list[int], cache_salt: str | None, exclude: tuple[str, ...]):
        pool = self.pools[self.first_role]
        router = pool._router()
        if router is None or self.service is None:
            return ()
        core = router.core
        avoid = set(exclude) | set(pool.failed.current())
        snaps = [s for rid, s in core.snapshots.items() if rid not in avoid and s.healthy]
        hashes = pool.prompt_hint(prompt, cache_salt).block_hashes
        hit = max(core.index.match_prefix(list(hashes)).values(), default=0)
        split = self.long_prefill.plan(len(prompt), snaps, block_size=self.block_size,
                                       num_uncached_tokens=len(prompt) - hit * self.block_size)
        if split is None:
            return ()
        for span in split.spans:
            self.service.add_client(span.replica_id, pool.pinned(span.replica_id))
        return split.spans

    async def report_failure(self, replica: str) -> None:
        if replica not in self.pools:  # a pool name says nothing about which replica failed
            next(iter(self.pools.values())).failed.add(replica)

    async def replica_states(self) -> dict[str, ReplicaState]:
        out: dict[str, ReplicaState] = {}
        for pool in self.pools.values():
            try:
                out.update(await pool.replica_states())
            except ReplicaUnavailableError:
                pass
        return out
