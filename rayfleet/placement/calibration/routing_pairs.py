"""The measurement behind :data:`rayfleet.placement.cost_params.DROPLESS_EXPERT_LOAD_CV`: published
pairs of runs that differ only in their routing (forced balance vs dropless), and the per-expert
load spread that makes the cost model's dropless/forced step-time ratio match each pair's.

Design decisions:
- Only the *ratio* of a pair is used (same plan, code, hardware and FLOP count: the TFLOP/s
  ratio is the step-time ratio), so the GEMM and attention efficiencies mostly cancel; what
  remains is the routed experts' share of the step, which the cost model prices.
- Each pair gives its own ``cv`` (bisection on the model); the constant is their median and the
  spread across sequence lengths (the MoE share falls from ~40% at 16K to ~15% at 128K) is the
  check that the model's MoE share is right. A single ``cv`` for every pair is the claim.
- All pairs are Qwen3-235B at EP8 (16 local experts): how the skew scales to other EP sizes
  (``1/sqrt(local experts)``) is the model's assumption (:mod:`rayfleet.placement.moe_load`), not
  measured here.

Units: sequence length in tokens, TFLOP/s per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import median

from rayfleet.placement.calibration.predict import predict_run
from rayfleet.placement.calibration.runs import PublishedRun
from rayfleet.placement.cost_params import CostParams
from rayfleet.placement.model_spec import preset
from rayfleet.placement.plan import ParallelPlan

__all__ = ["RoutingPair", "ROUTING_PAIRS", "ROUTING_PAIRS_SOURCE", "pair_cv", "measured_dropless_cv"]

ROUTING_PAIRS_SOURCE = ("Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (github.com/yanring/Megatron-MoE-ModelZoo "
                        "@ c1ad0b5c), Long Context: Qwen3-235B-A22B, 32 nodes of 8 H100, BF16, DeepEP, TP4 PP8 VPP4 "
                        "EP8, GBS 256, A2A_OVERLAP=0, TFLOP/s per GPU 'forced balance / dropless'")


@dataclass(frozen=True)
class RoutingPair:
    """One published plan measured with forced balance and dropless routing (TFLOP/s per GPU)."""

    seq_len: int
    cp: int
    forced_balance_tflops: float
    dropless_tflops: float

    @property
    def measured_ratio(self) -> float:
        """Dropless step time over forced-balance step time."""
        return self.forced_balance_tflops / self.dropless_tflops

    def run(self, routing: str) -> PublishedRun:
        model = preset("qwen3-235b-a22b", seq_len=self.seq_len, global_batch_sequences=256, precision="bf16",
                       moe_routing=routing)
        plan = ParallelPlan(tp=4, pp=8, vpp=4, cp=self.cp, ep=8, dp=8 // self.cp, micro_batch_size=1,
                            zero_stage=1, ep_overlap=False, tp_overlap=False)
        return PublishedRun(f"modelzoo-qwen3-235b-{self.seq_len}-{routing}", ROUTING_PAIRS_SOURCE, "H100", model,
                            plan, 1.0, False, routing)


ROUTING_PAIRS: tuple[RoutingPair, ...] = (
    RoutingPair(16384, 1, 295, 237),
    RoutingPair(32768, 2, 335, 277),
    RoutingPair(65536, 4, 368, 320),
    RoutingPair(131072, 8, 389, 357),
)


def model_ratio(pair: RoutingPair, params: CostParams) -> float:
    """The cost model's dropless / forced-balance step time for ``pair`` under ``params``."""
    forced = predict_run(pair.run("forced_balance"), params).cost.step_time_s
    return predict_run(pair.run("dropless"), params).cost.step_time_s / forced


def pair_cv(pair: RoutingPair, params: CostParams = CostParams(), *, high: float = 4.0, steps: int = 30) -> float:
    """The ``dropless_expert_load_cv`` at which the model's ratio equals the pair's (bisection;
    the ratio grows with ``cv``). ``high`` if even that falls short."""
    low = 0.0
    for _ in range(steps):
        mid = (low + high) / 2
        if model_ratio(pair, replace(params, dropless_expert_load_cv=mid)) < pair.measured_ratio:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def measured_dropless_cv(params: CostParams = CostParams()) -> tuple[float, tuple[float, ...]]:
    """The median of :func:`pair_cv` over :data:`ROUTING_PAIRS`, and each pair's value."""
    values = tuple(pair_cv(p, params) for p in ROUTING_PAIRS)
    return median(values), values
