"""The engine's KV connector: how an engine reaches KV outside its own pool, as protocols it owns.

Design decisions:
- The engine defines what it needs and ``kv/`` implements it, so the engine never imports
  ``kv/`` (the vLLM v1 ``KVConnector`` shape, in our words). Two seams:
  * ``KVTierHooks``: lower tiers (host memory, disk, peers) behind the block pool.
    ``LLMEngine`` calls ``attach`` once and ``before_schedule`` before every ``schedule()``;
    ``kv.tier_connector.KVTierConnector`` is the implementation.
  * ``KVTransport``: the prefill -> decode handoff. ``AsyncEngine.prefill`` puts a
    ``KVPayload`` and returns its ``KVHandle``; ``AsyncEngine.decode`` fetches it.
    ``kv.transfer`` has the implementations (``LocalTransport``, ``ObjectStoreTransport``).
- The handoff's value types (``HandoffId``, ``KVPayload``, ``KVHandle``) and its error live here
  too: the engine produces and consumes them, the router, split prefill and the request path
  only carry them. They pickle (they cross Ray between replicas and the ingress).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NewType, Protocol

import numpy as np

if TYPE_CHECKING:  # torch loads with the first tensor moved: the ingress imports the handles only
    import torch

from rayfleet.errors import RayfleetError

if TYPE_CHECKING:
    from rayfleet.models import PagedKVCache
    from rayfleet.serving.engine.block_pool import BlockPool
    from rayfleet.serving.engine.request import Request

__all__ = ["HandoffId", "KVPayload", "KVHandle", "KVTransport", "KVTransferError", "KVTierHooks"]

HandoffId = NewType("HandoffId", str)


class KVTransferError(RayfleetError):
    """The KV of a handoff cannot be read: its lease expired, it was released, or its owner died."""


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    import torch

    # numpy has no bfloat16: ship its bits as int16 and view them back on arrival.
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).removeprefix("torch.")


def _from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():  # zero-copy arrays from the object store are read-only
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


@dataclass(frozen=True)
class KVPayload:
    """What a decode replica needs to continue a request: prompt KV, first token, RNG state.

    ``k``/``v``: ``[num_layers, num_blocks, block_size, kv_heads, head_dim]`` as numpy (``dtype``
    names the torch dtype, bfloat16 travels as int16 bits).
    """

    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    k: np.ndarray
    v: np.ndarray
    dtype: str
    generator_state: bytes | None = None

    @classmethod
    def from_tensors(cls, *, prompt_token_ids: Iterable[int], first_token_id: int, k: torch.Tensor,
                     v: torch.Tensor, generator_state: torch.Tensor | None = None) -> "KVPayload":
        k_np, dtype = _to_numpy(k)
        v_np, _ = _to_numpy(v)
        state = bytes(generator_state.numpy().tobytes()) if generator_state is not None else None
        return cls(tuple(int(t) for t in prompt_token_ids), int(first_token_id), k_np, v_np, dtype, state)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _from_numpy(self.k, self.dtype), _from_numpy(self.v, self.dtype)

    def generator_tensor(self) -> torch.Tensor | None:
        import torch

        if self.generator_state is None:
            return None
        return torch.frombuffer(bytearray(self.generator_state), dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


@dataclass(frozen=True)
class KVHandle:
    """A claim ticket for one handoff. ``ref`` is transport-specific (an ``ObjectRef`` for Ray)."""

    handoff_id: HandoffId
    transport: str
    num_blocks: int
    nbytes: int
    lease_s: float
    ref: Any = field(default=None, compare=False)


class KVTransport(Protocol):
    """Owner side: ``put``/``release``/``expire``; reader side: ``fetch``. See the module doc."""

    name: str

    def put(self, payload: KVPayload, *, now: float) -> KVHandle: ...

    async def fetch(self, handle: KVHandle) -> KVPayload: ...

    def release(self, handoff_id: HandoffId) -> bool: ...

    def expire(self, *, now: float) -> list[HandoffId]: ...

    @property
    def num_leases(self) -> int: ...


class KVTierHooks(Protocol):
    """Lower KV tiers behind one engine's block pool (``kv.tier_connector.KVTierConnector``).

    Both calls run on the engine thread, between steps."""

    def attach(self, *, block_pool: BlockPool, kv_cache: PagedKVCache, block_size: int) -> None:
        """Hook into the engine's pool and KV tensors (once, at engine construction)."""
        ...

    def before_schedule(self, waiting: Sequence[Request], *, admit_window: int, num_reserved_blocks: int) -> None:
        """Load queued requests' blocks from lower tiers into the pool as cached blocks, so
        ``schedule()``'s prefix lookup hits them; ``num_reserved_blocks`` must stay free."""
        ...
