"""A torch.distributed rendezvous whose port is held from the moment it is chosen.

Design decisions:
- The usual recipe (bind port 0, read the port, close the socket, hand the number to rank 0,
  which binds it again in ``init_process_group``) leaves a window in which any process on the
  host may take the port: an outgoing connection's ephemeral port, another job's free-port
  probe. CI lost a whole three-rank test to it (rank 0 exited from ``init_process_group``, its
  peers waited out the deadline). Here the store is created first, on port 0, and only the
  port of a store that is already listening is handed out: there is no window.
- Whoever hosts the store keeps the object alive for as long as the group may need it (a
  launcher for its ranks' lifetime, or the rank that becomes rank 0).
- Ranks join with a client store and ``init_process_group(store=...)``. Ranks that must use
  ``env://`` (scripts that own their process group from the first line) get
  :func:`agent_store_env`: torch then makes every rank, rank 0 included, a client of the store
  at ``MASTER_ADDR:MASTER_PORT`` (the same mechanism torchrun's agent uses).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["host_store", "join_group", "agent_store_env"]

DEFAULT_TIMEOUT_S = 300.0


def host_store(world_size: int, *, host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A listening ``TCPStore`` on a port the OS chose (``.port``); keep it alive while ranks use it.

    ``host`` is the address the ranks will dial; the store listens on all of the host's
    addresses (that is how ``TCPStore`` binds).
    """
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def join_group(backend: str, *, host: str, port: int, rank: int, world_size: int,
               timeout_s: float = DEFAULT_TIMEOUT_S, store: Any = None) -> None:
    """Initialize the default process group through the store at ``host:port``.

    ``store``: the hosting rank passes the store it hosts (a second client of its own store
    would work too, but costs a connection); every other rank passes ``None`` and dials in.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def agent_store_env(store: Any, *, host: str = "127.0.0.1") -> dict[str, str]:
    """The environment with which ``init_process_group()`` (``env://``) joins a hosted store."""
    return {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
