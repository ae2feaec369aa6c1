"""What the plan search may choose (:class:`SearchSpace`) and what the job asks of it (:class:`JobGoal`).

Design decisions:
- Job size is a decision, not a given: a plan takes ``tp * cp * pp * dp`` accelerators, anywhere
  from ``JobGoal.min_accelerators`` to the free fleet (or ``max_accelerators``). Filling a fleet
  regardless of the batch leads to absurd plans (PP25 at 1.5% MFU on 100,000 H100s), so the
  default objective is the *fastest step that keeps at least ``min_scaling_efficiency`` of the
  best throughput per accelerator any plan reaches* -- how experts size a job: scale out while
  it still pays. ``objective="throughput"`` maximises tokens/s per accelerator instead.
- The shapes experts run: TP within the scale-up domain, CP at any power of two that leaves
  each rank ``min_tokens_per_cp_rank`` tokens, PP at divisors of the layer count and powers of
  two (uneven splits are balanced), interleaved virtual stages, EP with expert-TP 1 or TP,
  DP with ZeRO-1/2/3, recompute none/selective/full, micro-batch sizes, FP32 or BF16 Adam moments,
  BF16 or FP8 cached activations.

Units: accelerators, sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Literal

from rayfleet.errors import SpecError
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.plan import RECOMPUTE_OPTIONS

__all__ = ["SearchSpace", "JobGoal", "Objective", "CoreShape", "divisors", "core_shapes", "pipeline_degrees",
           "data_parallel_degrees", "context_parallel_degrees"]

Objective = Literal["fastest", "throughput"]


@dataclass(frozen=True)
class SearchSpace:
    """Which choices the search may make (defaults follow common practice).

    ``zero_stage`` (one stage) is kept for callers that pin it; otherwise ``zero_stages`` lists
    the stages searched, cheapest communication first. ``optimality_gap``: a candidate is
    skipped once its lower bound times ``1 + gap`` reaches the k-th best, so every plan returned
    is within that factor of the cost model's optimum (0 = exact, as the brute force).
    """

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = RECOMPUTE_OPTIONS
    max_pp: int = 64
    context_parallel: tuple[int, ...] | None = None  # None: powers of two, see min_tokens_per_cp_rank
    min_tokens_per_cp_rank: int = 1024
    zero_stage: int | None = None
    zero_stages: tuple[int, ...] = (1, 2, 3)
    virtual_stages: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    # BF16 moments change the numerics, so they are searched only when asked (--bf16-moments);
    # the trainer keeps FP32 states
    optimizer_dtypes: tuple[str, ...] = ("fp32",)
    # FP8 activation caching (DeepSeek-V3) also changes numerics: searched only when asked
    # (--fp8-activations), and only for FP8 models
    activation_dtypes: tuple[str, ...] = ("bf16",)
    expert_tp_options: str = "1_or_tp"  # "1_or_tp": etp in {1, tp}; "1": etp = 1 only
    min_expert_width_per_etp_rank: int = 1024
    optimality_gap: float = 0.05  # branch and bound stops within this relative gap of the optimum
    # What the training runtime offers (ParallelPlan.ep_overlap / ep_dedup / tp_overlap): on for
    # GPU fleets; the calibration ranks a published plan under the options its run had.
    ep_overlap: bool = True
    ep_dedup: bool = True
    tp_overlap: bool = True
    # DeepSeek's DualPipe schedule (DualPipeV layout) for pipelines; Megatron-Core has no such
    # schedule, so it is searched only when asked (--dualpipe)
    dualpipe: bool = False

    def runtime(self) -> dict[str, bool]:
        """The runtime options as ParallelPlan fields."""
        return {"ep_overlap": self.ep_overlap, "ep_dedup": self.ep_dedup, "tp_overlap": self.tp_overlap}

    @property
    def zero_ladder(self) -> tuple[int, ...]:
        return (self.zero_stage,) if self.zero_stage is not None else tuple(sorted(self.zero_stages))


@dataclass(frozen=True)
class JobGoal:
    """What the job wants from the fleet.

    Attributes:
        objective: "fastest" (shortest step) or "throughput" (most tokens/s per accelerator).
        min_accelerators / max_accelerators: bounds on the plan's size (``None`` = the free fleet).
        min_mfu: plans below this model-FLOPs utilisation are not taken (0 = no floor).
        min_scaling_efficiency: with "fastest", plans whose tokens/s per accelerator fall below
            this share of the best plan's are not taken (0 = fastest at any cost).
        fill_fleet: take every free accelerator (what a launcher given N workers needs).
    """

    objective: Objective = "fastest"
    min_accelerators: int = 1
    max_accelerators: int | None = None
    min_mfu: float = 0.0
    min_scaling_efficiency: float = 0.8
    fill_fleet: bool = False

    def __post_init__(self) -> None:
        if self.objective not in ("fastest", "throughput"):
            raise SpecError("objective", self.objective, "unknown objective", "use 'fastest' or 'throughput'")
        if self.min_accelerators < 1:
            raise SpecError("min_accelerators", self.min_accelerators, "must be at least 1", "pass 1 or more")
        if self.max_accelerators is not None and self.max_accelerators < self.min_accelerators:
            raise SpecError("max_accelerators", self.max_accelerators,
                            f"is below min_accelerators={self.min_accelerators}", "raise --max-accelerators")
        if not 0.0 <= self.min_mfu < 1.0:
            raise SpecError("min_mfu", self.min_mfu, "must lie in [0, 1)", "pass e.g. --min-mfu 0.3")
        if not 0.0 <= self.min_scaling_efficiency <= 1.0:
            raise SpecError("min_scaling_efficiency", self.min_scaling_efficiency, "must lie in [0, 1]",
                            "pass e.g. 0.8 (keep 80% of the best tokens/s per accelerator)")

    @classmethod
    def exactly(cls, num_accelerators: int) -> "JobGoal":
        """The fastest plan on exactly ``num_accelerators`` (calibration, fixed-size jobs)."""
        return cls(min_accelerators=num_accelerators, max_accelerators=num_accelerators, min_scaling_efficiency=0.0)

    def size_range(self, free: int) -> tuple[int, int]:
        """(fewest, most) accelerators a plan may take out of ``free``."""
        if self.fill_fleet:
            return free, free
        return self.min_accelerators, min(free, self.max_accelerators or free)


@dataclass(frozen=True)
class CoreShape:
    """The degrees that decide per-micro-batch work: (tp, cp, ep, etp). ``pp`` and ``dp`` only
    spread that work over stages and replicas, so bounds are computed once per core."""

    tp: int
    cp: int
    ep: int
    etp: int


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:  # the search asks for the same batch's divisors per shape
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def context_parallel_degrees(model: ModelSpec, space: SearchSpace) -> tuple[int, ...]:
    if space.context_parallel is not None:
        return space.context_parallel
    out, cp = [], 1
    while model.seq_len % cp == 0 and (cp == 1 or model.seq_len // cp >= space.min_tokens_per_cp_rank):
        out.append(cp)
        cp *= 2
    return tuple(out)


def core_shapes(model: ModelSpec, domain: int, space: SearchSpace) -> Iterator[CoreShape]:
    tps = [t for t in divisors(domain) if model.num_heads % t == 0]
    eps = divisors(model.num_experts) if model.is_moe else [1]
    for tp in tps:
        for cp in context_parallel_degrees(model, space):
            for ep in eps:
                # expert-TP only where experts stay wide once split (Mixtral's 14336, not
                # DeepSeek's 2048): narrow GEMMs run below peak, and ETP=1 is the fine-grained norm
                wide = model.moe_ffn_hidden_size // tp >= space.min_expert_width_per_etp_rank
                etps = sorted({1, tp}) if space.expert_tp_options == "1_or_tp" and model.is_moe and wide else [1]
                for etp in etps:
                    yield CoreShape(tp, cp, ep, etp)


def pipeline_degrees(model: ModelSpec, space: SearchSpace, *, exact_world: int | None = None,
                     replica_width: int = 1) -> list[int]:
    """Stage counts worth trying: divisors of the layer count and powers of two (uneven splits
    are balanced by the cost model); for an exact size, every degree that divides it."""
    top = min(model.num_layers, space.max_pp)
    if exact_world is not None:
        if exact_world % replica_width:
            return []
        return [p for p in divisors(exact_world // replica_width) if p <= top]
    powers = {1 << i for i in range(top.bit_length()) if 1 << i <= top}
    return sorted(powers | {d for d in divisors(model.num_layers) if d <= top})


def data_parallel_degrees(model: ModelSpec, core: CoreShape, pp: int, lo: int, hi: int,
                          space: SearchSpace) -> list[int]:
    """DP degrees whose plan size lies in [lo, hi], with a micro-batch size that divides the batch
    and expert groups that fold into a stage's ranks (``ep * etp | tp * cp * dp``)."""
    width = core.tp * core.cp * pp
    mbs_min = min(space.micro_batch_sizes)
    gbs = model.global_batch_sequences
    out = []
    for dp in divisors(gbs // mbs_min) if gbs % mbs_min == 0 else []:
        if lo <= width * dp <= hi and (core.tp * core.cp * dp) % (core.ep * core.etp) == 0:
            out.append(dp)
    return out

