"""Which slice of each weight a rank holds under tensor and expert parallelism (pure).

The layout is the trainer's (``rayfleet.jobs.parallel``), restated as boxes so a rank can read
only its bytes from a checkpoint before any process group exists:
- expert parallelism: EP rank r holds experts ``[r * E/ep, (r + 1) * E/ep)`` of every MoE layer;
- tensor parallelism (Megatron): ``wq wk wv`` (weights and biases) and dense ``w1 w3`` split
  their output rows, ``wo`` and dense ``w2`` their input columns, the output head its rows
  (DTensor's ``torch.chunk`` split, so a vocabulary need not divide by TP);
- everything else (embeddings, norms, routers, shared experts, latent attention) is replicated.
A worked example is in ``tests/unit/models/test_hf_sharding.py``.
"""

from __future__ import annotations

from rayfleet.errors import SpecError
from rayfleet.models.config import MoEConfig
from rayfleet.models.hf.weights import Box, ShardFn

__all__ = ["layout_shard_fn"]

_COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wq.bias",
            "attention.wk.bias", "attention.wv.bias")


def _split(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    if n % world:
        raise SpecError("parallel degree", world, f"does not divide {what}={n}",
                        "choose TP/EP degrees that divide the model's heads, widths and experts")
    per = n // world
    return rank * per, (rank + 1) * per


def _chunk(n: int, rank: int, world: int) -> tuple[int, int]:
    """DTensor's ``Shard`` split (``torch.chunk``): ceil-sized pieces, the last ones short or empty."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def layout_shard_fn(config: MoEConfig, *, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0,
                    ep: int = 1) -> ShardFn:
    """The ``ShardFn`` of rank (``tp_rank``, ``ep_rank``) in a TP x EP layout of ``config``."""
    if not (0 <= tp_rank < tp and 0 <= ep_rank < ep):
        raise SpecError("rank", (tp_rank, ep_rank), f"outside tp={tp}, ep={ep}", "pass ranks below the degrees")

    def shard(name: str, shape: tuple[int, ...]) -> Box | None:
        whole = tuple((0, n) for n in shape)
        if ".experts.w" in name:
            if ep == 1:
                return None
            return (_split(shape[0], ep_rank, ep, "num_experts"), *whole[1:])
        if tp == 1 or config.uses_mla:
            return None
        dense_ffn = ".feed_forward.w" in name and ".shared_experts." not in name
        if name.endswith(_COLWISE) or name == "output.weight" or (dense_ffn and name.endswith(("w1.weight", "w3.weight"))):
            return (_chunk(shape[0], tp_rank, tp), *whole[1:])
        if name.endswith("attention.wo.weight") or (dense_ffn and name.endswith("w2.weight")):
            return (whole[0], _chunk(shape[1], tp_rank, tp))
        return None

    return shard
