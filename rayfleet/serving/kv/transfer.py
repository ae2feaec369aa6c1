"""Moving a prefilled request's KV blocks from a prefill replica to a decode replica.

Design decisions:
- One small interface, ``KVTransport`` (the engine's, ``engine.kv_connector``), with the owner side (``put``, ``release``, ``expire``)
  on the prefill replica and the reader side (``fetch``) on the decode replica. What travels
  between them is a ``KVHandle``: small, picklable, and opaque to the router and the ingress.
  Implementations:
  * ``ObjectStoreTransport`` (Ray): ``put`` is one ``ray.put`` of the blocks as numpy arrays,
    the handle carries the ``ObjectRef``. On one node the decode replica maps the arrays
    zero-copy from shared memory; across nodes Ray's object transfer moves them.
  * ``LocalTransport``: one process (unit tests, ``_local_testing_mode``), a dict.
  * An NCCL/NIXL transport fits the same shape: ``put`` pins the blocks in the prefill pool and
    returns ``(owner address, block ids, layout)`` in the handle, ``fetch`` does the one-sided
    read (or a send/recv pair) into the decode replica's pre-allocated blocks, ``release``
    unpins. Nothing above this module changes (the decode side already pre-allocates blocks
    before it fetches).
- The object store copy is taken when the prefill finishes, so the prefill pool's blocks go
  back to its prefix cache at once instead of waiting for the decode side (the pool is the
  scarcer memory; the object store spills to disk when full).
- Leases: the owner pins each handed-off payload for ``lease_s`` seconds. The decode replica
  (through the ingress) releases it as soon as the KV is in its pool; a payload never picked
  up (the ingress died, the client went away, decode failed) is dropped by ``expire`` when its
  lease runs out. ``LeaseTable`` is the pure part (time is passed in), unit-tested without Ray.
  With Ray the owner dropping its reference frees the object once no reader still holds the
  handle (Ray's reference counting), so an expiry never pulls data from under a reader.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from rayfleet.errors import SpecError
from rayfleet.serving.engine.kv_connector import HandoffId, KVHandle, KVPayload, KVTransferError, KVTransport

__all__ = ["LeaseTable", "LocalTransport", "ObjectStoreTransport", "make_transport"]


class LeaseTable:
    """Which handoffs are pinned until when. Pure: callers pass ``now`` (monotonic seconds).

    Worked example (``test_kv_transfer``): grant a at t=0 and b at t=5 with ttl 10; at t=12
    ``expire`` returns [a]; ``release(b)`` at t=13 returns True, a second release False.
    """

    def __init__(self, *, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise SpecError("lease_s", ttl_s, "a lease must last some time", "pass lease_s > 0 (e.g. 30)")
        self.ttl_s = ttl_s
        self._deadline: dict[HandoffId, float] = {}

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self._deadline

    def grant(self, handoff_id: HandoffId, *, now: float) -> float:
        """Pin ``handoff_id`` until ``now + ttl_s`` (returned). Re-granting extends the lease."""
        self._deadline[handoff_id] = now + self.ttl_s
        return self._deadline[handoff_id]

    def is_live(self, handoff_id: HandoffId, *, now: float) -> bool:
        deadline = self._deadline.get(handoff_id)
        return deadline is not None and now < deadline

    def release(self, handoff_id: HandoffId) -> bool:
        """Drop a lease (the reader has the KV); False if unknown or already gone."""
        return self._deadline.pop(handoff_id, None) is not None

    def expire(self, *, now: float) -> list[HandoffId]:
        """Remove and return the leases whose deadline passed, oldest deadline first."""
        gone = sorted((d, h) for h, d in self._deadline.items() if d <= now)
        for _, h in gone:
            del self._deadline[h]
        return [h for _, h in gone]


_counter = itertools.count()


def _new_handoff_id(owner: str) -> HandoffId:
    return HandoffId(f"{owner}/{os.getpid()}/{next(_counter)}")


class _LeasedStore:
    """Payload references held under leases; shared by both implementations."""

    name = "base"

    def __init__(self, *, owner: str, lease_s: float) -> None:
        self.owner = owner
        self.leases = LeaseTable(ttl_s=lease_s)
        self._held: dict[HandoffId, Any] = {}

    def _hold(self, handoff_id: HandoffId, obj: Any, *, now: float) -> None:
        self._held[handoff_id] = obj
        self.leases.grant(handoff_id, now=now)

    def release(self, handoff_id: HandoffId) -> bool:
        self._held.pop(handoff_id, None)
        return self.leases.release(handoff_id)

    def expire(self, *, now: float) -> list[HandoffId]:
        gone = self.leases.expire(now=now)
        for h in gone:
            self._held.pop(h, None)
        return gone

    @property
    def num_leases(self) -> int:
        return len(self.leases)


class LocalTransport(_LeasedStore):
    """Both replicas in one process: the handle points at the owner's store (``ref``) and names
    a payload in it. A fetch after release or expiry raises ``KVTransferError``, as a remote
    reader would see it."""

    name = "local"

    def put(self, payload: KVPayload, *, now: float) -> KVHandle:
        handoff_id = _new_handoff_id(self.owner)
        self._hold(handoff_id, payload, now=now)
        return KVHandle(handoff_id, self.name, int(payload.k.shape[1]), payload.nbytes, self.leases.ttl_s,
                        self)

    async def fetch(self, handle: KVHandle) -> KVPayload:
        payload = handle.ref._held.get(handle.handoff_id)
        if payload is None:
            raise KVTransferError(f"KV handoff {handle.handoff_id} is gone (released or lease of "
                                  f"{handle.lease_s:g} s expired); the request must be prefilled again")
        return payload


class ObjectStoreTransport(_LeasedStore):
    """Ray object store: ``put`` is ``ray.put`` on the prefill replica (its owner); ``fetch``
    awaits the ``ObjectRef`` (zero-copy on one node). Needs a connected Ray worker."""

    name = "ray_object_store"

    def put(self, payload: KVPayload, *, now: float) -> KVHandle:
        import ray

        handoff_id = _new_handoff_id(self.owner)
        ref = ray.put(payload)
        self._hold(handoff_id, ref, now=now)
        return KVHandle(handoff_id, self.name, int(payload.k.shape[1]), payload.nbytes, self.leases.ttl_s, ref)

    async def fetch(self, handle: KVHandle) -> KVPayload:
        import ray

        try:
            return await handle.ref
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                ray.exceptions.ObjectFreedError) as exc:
            raise KVTransferError(f"KV handoff {handle.handoff_id} was lost ({type(exc).__name__}); "
                                  "the request must be prefilled again") from None


def make_transport(name: str, *, owner: str, lease_s: float) -> KVTransport:
    """The transport named in ``ServeSpec.kv_transfer.transport``. Raises ``SpecError``."""
    kinds = {"ray_object_store": ObjectStoreTransport, "local": LocalTransport}
    if name not in kinds:
        raise SpecError("kv_transfer.transport", name, "unknown KV transport",
                        f"use one of {sorted(kinds)} (NCCL/NIXL transports plug in here)")
    return kinds[name](owner=owner, lease_s=lease_s)
