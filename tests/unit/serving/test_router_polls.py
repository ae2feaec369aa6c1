"""The router's poll loop: a replica that misses poll deadlines is slow, not failed, until it
misses ``POLL_MISSES_UNHEALTHY`` in a row; a poll that fails outright makes it unhealthy at once.

Seen in a full unit run at load 30: one missed 2 s poll deadline made the only replica unhealthy
and the fuzz test's normal canary request got a 503 ("no healthy replica")."""

from __future__ import annotations

import asyncio
import types

from rayfleet.serving.routing.router import POLL_MISSES_UNHEALTHY, Router


class _Core:
    block_size, model_id = 4, "tiny"

    def __init__(self) -> None:
        self.unhealthy: list[str] = []
        self.observed: list[str] = []

    def mark_unhealthy(self, name: str) -> None:
        self.unhealthy.append(name)

    def observe(self, name, snapshot, events, *, now_s) -> None:
        self.observed.append(name)


class _Replica:
    def __init__(self, answers: list) -> None:
        self.answers = answers

    async def poll_state(self):
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _state():
    return types.SimpleNamespace(snapshot=object(), events=())


def test_missed_poll_deadlines_make_a_replica_unhealthy_only_in_a_row():
    assert POLL_MISSES_UNHEALTHY >= 2
    misses = [asyncio.TimeoutError() for _ in range(POLL_MISSES_UNHEALTHY - 1)]
    slow = _Replica([*misses, _state(), *misses, asyncio.TimeoutError()])
    core = _Core()
    router = Router({"slow": slow}, core)

    async def polls(n: int) -> None:
        for _ in range(n):
            await router.poll_once()

    asyncio.run(polls(POLL_MISSES_UNHEALTHY - 1))
    assert core.unhealthy == []  # slow, not failed
    asyncio.run(polls(1))
    assert core.observed == ["slow"] and "slow" in router.states  # an answer resets the count
    asyncio.run(polls(POLL_MISSES_UNHEALTHY - 1))
    assert core.unhealthy == [] and "slow" in router.states  # its last state stands meanwhile
    asyncio.run(polls(1))
    assert core.unhealthy == ["slow"] and "slow" not in router.states


def test_a_failed_poll_makes_a_replica_unhealthy_at_once():
    core = _Core()
    router = Router({"dead": _Replica([RuntimeError("actor died")])}, core)
    asyncio.run(router.poll_once())
    assert core.unhealthy == ["dead"]


def test_a_polled_snapshot_that_names_its_replica_otherwise_still_routes():
    """A replica's engine names itself ``role/replica`` while the router knows it as ``replica``:
    after a poll, plans must still name replicas by the router's keys (a full unit run saw a split
    prefill plan name ``prefill/<id>`` and fail with KeyError)."""
    from rayfleet.serving.engine.replica_state import ReplicaId, ReplicaSnapshot
    from rayfleet.serving.routing.router import RouterCore

    core = RouterCore(roles={"colocated": ["r1", "r2"]}, block_size=4, model_id="m", num_blocks_hint=64)
    for name in ("r1", "r2"):
        core.observe(name, ReplicaSnapshot(replica_id=ReplicaId(f"colocated/{name}"), num_total_blocks=64,
                                           num_free_blocks=64, num_active_blocks=0))
    plan = core.route(list(range(12)), max_tokens=4)
    assert plan.first and plan.first[0] in {"r1", "r2"}, plan
