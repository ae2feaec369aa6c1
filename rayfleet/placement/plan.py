"""``ParallelPlan``: how a model is split over accelerators, and its validation.

Design decisions:
- MoE "parallel folding" (Megatron-Core): attention layers use the grid TP x CP x DP x PP, MoE
  layers use ETP x EP x EDP x PP with the *same* PP stages and the same ranks, so
  ``etp * ep * edp == tp * cp * dp``. EP may therefore exceed DP (it folds into TP/CP ranks).
- Rank order, innermost first, is ``tp, cp, dp, pp`` (Megatron's default ``tp-cp-dp-pp``); the
  expert grid over the same ranks is ``etp, ep, edp``. :mod:`rayfleet.placement.layout` and the
  training launcher both read coordinates from :meth:`ParallelPlan.coords`.
- Stage boundaries are explicit (``stage_starts``), so a dynamic split (MoE and dense layers of
  different cost) is just a plan field; ``None`` means an even split and then the layer count
  must divide.
- Heterogeneous TP: ``layer_tp`` gives each layer's attention/dense-MLP TP degree, a divisor of
  ``tp``; a layer with a smaller degree is replicated over ``tp / layer_tp`` sub-groups, which
  split its tokens between them.
- Mixed fleets: ``replica_accelerators`` names the accelerator type of each DP replica and
  ``replica_microbatches`` how many micro-batches each gets (in proportion to speed).

Validation raises :class:`rayfleet.errors.SpecError` naming the field, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Literal, NamedTuple

from rayfleet.errors import SpecError
from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.pipeline_chunks import VirtualStage, num_chunks, virtual_stages

__all__ = ["ParallelPlan", "RankCoords", "Recompute", "validate_plan", "even_stage_starts"]

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_OPTIONS: tuple[Recompute, ...] = ("none", "selective", "full")
OptimizerDtype = Literal["fp32", "bf16"]
ActivationDtype = Literal["bf16", "fp8"]


class RankCoords(NamedTuple):
    """A rank's position in both grids. ``ep``/``etp``/``edp`` index the expert grid."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class ParallelPlan:
    """A complete parallel configuration.

    Attributes:
        tp, cp, dp, pp: attention-grid degrees (tensor, context, data, pipeline parallel).
        ep, etp: expert parallel and expert tensor parallel degrees (MoE layers).
        micro_batch_size: sequences per micro-batch per DP replica.
        recompute: activation recomputation: "none", "selective" (RMSNorm outputs, MLA q/k/v
            up-projections and the SwiGLU output: DeepSeek-V3's set), "full".
        stage_starts: first layer of each pipeline stage (length ``pp``, starts with 0);
            ``None`` = even split.
        zero_stage: optimizer sharding over DP: 0 none, 1 optimizer states, 2 + gradients,
            3 + parameters (FSDP).
        layer_tp: per-layer TP degree for attention and dense MLPs (heterogeneous TP), or None.
        replica_accelerators: accelerator type of each DP replica (mixed fleets), or None.
        replica_microbatches: micro-batches per step of each DP replica, or None (= equal).
        vpp: virtual pipeline stages per rank (Megatron's interleaved 1F1B): each rank holds
            ``vpp`` non-adjacent chunks of layers, which divides the fill/drain bubble by ``vpp``
            at the cost of ``vpp`` times the stage-to-stage sends.
        optimizer_dtype: dtype of Adam's moments: "fp32", or "bf16" (DeepSeek-V3, Megatron's
            precision-aware optimizer) -- 4 bytes a parameter less; the master copy stays FP32.
        activation_dtype: dtype of the activations GEMMs save for backward: "bf16", or "fp8"
            (FP8 models only; DeepSeek-V3 section 3.3: the inputs of Linear operators and of the
            MoE SwiGLU are cached in FP8) -- residual streams and MLA latents stay BF16.
        ep_overlap: the schedule hides one micro-batch's EP all-to-all behind another's compute
            (Megatron-Core's ``overlap_moe_expert_parallel_comm``, DeepSeek's DualPipe idea); it
            takes effect only where the schedule allows it (see
            :func:`rayfleet.placement.step_time_model.ep_overlap_possible`). The planner always
            uses it; published runs that ran without it say so.
        ep_dedup: the EP dispatcher sends a token once per remote scale-up domain and fans it
            out inside over the scale-up link (DeepEP / HybridEP, Megatron's flex dispatcher),
            instead of one copy per routed expert (Megatron's ``alltoall`` dispatcher).
        tp_overlap: TP all-gathers / reduce-scatters overlap the GEMMs (Transformer Engine
            userbuffers, ``tp_comm_overlap``); False = they run exposed.
        dualpipe: DeepSeek's DualPipe schedule in its DualPipeV layout: each rank holds two
            chunks (stage ``i`` and ``2*pp-1-i``, no duplicated weights) and runs a forward
            and a backward chunk of two micro-batches together, which hides the EP all-to-all
            and the pipeline sends and halves the fill/drain, at 1F1B's activation memory.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    recompute: Recompute = "none"
    stage_starts: tuple[int, ...] | None = None
    zero_stage: int = 1
    layer_tp: tuple[int, ...] | None = None
    replica_accelerators: tuple[str, ...] | None = None
    replica_microbatches: tuple[int, ...] | None = None
    vpp: int = 1
    optimizer_dtype: OptimizerDtype = "fp32"
    activation_dtype: ActivationDtype = "bf16"
    ep_overlap: bool = True
    ep_dedup: bool = True
    tp_overlap: bool = True
    dualpipe: bool = False

    def but(self, **changes) -> "ParallelPlan":
        """``dataclasses.replace(self, **changes)`` without its per-field introspection (the
        planner derives tens of thousands of plans); ``changes`` must name fields."""
        unknown = set(changes) - _FIELDS
        if unknown:
            raise TypeError(f"ParallelPlan has no field(s) {sorted(unknown)}")
        new = object.__new__(ParallelPlan)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelPlan":
        """The plan ``dataclasses.asdict(plan)`` came from (JSON turned its tuples into lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree (replicas of each expert shard within a stage)."""
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)

    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(tp, cp, pp, dp, ep, etp): the parallel shape, without batch/recompute choices."""
        return (self.tp, self.cp, self.pp, self.dp, self.ep, self.etp)

    def num_microbatches(self, global_batch_sequences: int) -> int:
        """Micro-batches per step of a (homogeneous) DP replica."""
        return global_batch_sequences // (self.dp * self.micro_batch_size)

    def stage_ranges(self, num_layers: int) -> tuple[range, ...]:
        """Layer range of each stage."""
        return _stage_ranges(self.stage_starts or even_stage_starts(num_layers, self.pp), num_layers)

    def virtual_stages(self, num_layers: int) -> tuple[VirtualStage, ...]:
        """Every virtual stage (layers and pipeline rank), in the model's order: ``pp`` of them for
        1F1B, ``pp * vpp`` interleaved, ``2 * pp`` for DualPipeV (see ``pipeline_chunks``)."""
        counts = [len(r) for r in self.stage_ranges(num_layers)]
        return virtual_stages(counts, chunks=num_chunks(vpp=self.vpp, dualpipe=self.dualpipe), dualpipe=self.dualpipe)

    @property
    def loss_pp_rank(self) -> int:
        """The pipeline rank running the last virtual stage (the head and the loss): rank 0 for
        DualPipeV, whose V comes back, else the last rank."""
        return 0 if self.dualpipe else self.pp - 1

    def tp_of_layer(self, layer: int) -> int:
        return self.layer_tp[layer] if self.layer_tp is not None else self.tp

    def coords(self, rank: int) -> RankCoords:
        """Grid coordinates of ``rank`` (order tp, cp, dp, pp innermost first)."""
        tp_i = rank % self.tp
        cp_i = rank // self.tp % self.cp
        dp_i = rank // (self.tp * self.cp) % self.dp
        pp_i = rank // (self.tp * self.cp * self.dp)
        in_stage = rank % (self.tp * self.cp * self.dp)
        return RankCoords(tp_i, cp_i, dp_i, pp_i, in_stage % self.etp, in_stage // self.etp % self.ep,
                          in_stage // (self.etp * self.ep))

    def describe(self) -> str:
        schedule = f" VP{self.vpp}" if self.vpp > 1 else " DualPipeV" if self.dualpipe else ""
        parts = [f"TP{self.tp}", f"PP{self.pp}" + schedule, f"DP{self.dp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1 or self.etp > 1:
            parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append(f"ZeRO-{self.zero_stage}")
        if self.optimizer_dtype != "fp32":
            parts.append(f"adam:{self.optimizer_dtype}")
        if self.activation_dtype != "bf16":
            parts.append(f"act:{self.activation_dtype}")
        if self.recompute != "none":
            parts.append(f"rc:{self.recompute}")
        if self.ep > 1 and not self.ep_overlap:
            parts.append("a2a:serial")
        if self.ep > 1 and not self.ep_dedup:
            parts.append("a2a:per-copy")
        if self.tp > 1 and not self.tp_overlap:
            parts.append("tp:serial")
        return " ".join(parts)


_FIELDS = frozenset(f.name for f in fields(ParallelPlan))


@lru_cache(maxsize=4096)
def _stage_ranges(starts: tuple[int, ...], num_layers: int) -> tuple[range, ...]:
    # cached: the cost model asks for the same split once per stage
    ends = tuple(starts[1:]) + (num_layers,)
    return tuple(range(a, b) for a, b in zip(starts, ends))


def even_stage_starts(num_layers: int, pp: int) -> tuple[int, ...]:
    return tuple(i * (num_layers // pp) for i in range(pp))


def _divides(a: int, b: int) -> bool:
    return a > 0 and b % a == 0


def validate_plan(plan: ParallelPlan, model: ModelSpec, *, world_size: int | None = None,
                  scaleup_domain_size: int | None = None) -> None:
    """Raise :class:`SpecError` when ``plan`` cannot run ``model``; return None when it can.

    ``world_size`` (accelerators the plan must fill) and ``scaleup_domain_size`` (largest NVLink
    domain / super-node) are checked when given.
    """
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch_size", "vpp"):
        if getattr(plan, name) < 1:
            raise SpecError(f"plan.{name}", getattr(plan, name), "must be at least 1", f"set plan.{name} >= 1")
    if world_size is not None and plan.world_size != world_size:
        raise SpecError("plan", plan.describe(),
                        f"tp*cp*dp*pp = {plan.world_size} but the fleet gives {world_size} accelerators",
                        f"choose degrees whose product is {world_size}, or change the fleet")
    _check_tensor_parallel(plan, model, scaleup_domain_size)
    if plan.cp > 1 and not _divides(2 * plan.cp, model.seq_len):  # the trainer's load-balanced 2*cp chunks
        raise SpecError("plan.cp", plan.cp, f"2*cp does not divide seq_len={model.seq_len}",
                        "use a context-parallel degree with 2*cp dividing the sequence length")
    _check_experts(plan, model, scaleup_domain_size)
    _check_stages(plan, model)
    _check_batch(plan, model)
    if plan.recompute not in RECOMPUTE_OPTIONS:
        raise SpecError("plan.recompute", plan.recompute, "unknown recompute mode", f"use one of {RECOMPUTE_OPTIONS}")
    if plan.zero_stage not in (0, 1, 2, 3):
        raise SpecError("plan.zero_stage", plan.zero_stage, "unknown ZeRO stage", "use 0, 1, 2 or 3")
    if plan.optimizer_dtype not in ("fp32", "bf16"):
        raise SpecError("plan.optimizer_dtype", plan.optimizer_dtype, "unknown optimizer state dtype",
                        "use 'fp32' or 'bf16'")
    if plan.activation_dtype not in ("bf16", "fp8"):
        raise SpecError("plan.activation_dtype", plan.activation_dtype, "unknown activation dtype",
                        "use 'bf16' or 'fp8'")
    if plan.activation_dtype == "fp8" and model.precision != "fp8":
        raise SpecError("plan.activation_dtype", plan.activation_dtype,
                        f"FP8 activation caching needs FP8 GEMMs (the model's precision is {model.precision})",
                        "use activation_dtype 'bf16' or an FP8 model")


def _check_tensor_parallel(plan: ParallelPlan, model: ModelSpec, domain: int | None) -> None:
    degrees = set(plan.layer_tp or ()) | {plan.tp}
    if plan.layer_tp is not None:
        if len(plan.layer_tp) != model.num_layers:
            raise SpecError("plan.layer_tp", len(plan.layer_tp), f"needs one TP degree per layer ({model.num_layers})",
                            "give one entry per layer, or leave layer_tp unset")
        bad = [d for d in plan.layer_tp if not _divides(d, plan.tp)]
        if bad:
            raise SpecError("plan.layer_tp", bad[0], f"does not divide the TP group size tp={plan.tp}",
                            "use per-layer degrees that divide tp")
    for degree in sorted(degrees):
        if not _divides(degree, model.num_heads):
            raise SpecError("plan.tp", degree, f"does not divide num_heads={model.num_heads}",
                            "use a TP degree that divides the attention head count")
        if not model.uses_mla and not (_divides(degree, model.num_kv_heads) or _divides(model.num_kv_heads, degree)):
            raise SpecError("plan.tp", degree, f"neither divides nor is a multiple of num_kv_heads={model.num_kv_heads}",
                            "use a TP degree that divides the KV head count, or a multiple of it")
        if not model.is_moe or model.first_k_dense_layers:
            if not _divides(degree, model.ffn_hidden_size):
                raise SpecError("plan.tp", degree, f"does not divide ffn_hidden_size={model.ffn_hidden_size}",
                                "use a TP degree that divides the MLP width")
    if domain is not None and (plan.tp > domain or domain % plan.tp):
        raise SpecError("plan.tp", plan.tp,
                        f"a TP group of {plan.tp} does not fit the NVLink domain / super-node of {domain}",
                        f"use tp <= {domain} (a divisor of it); split further with PP or DP")


def _check_experts(plan: ParallelPlan, model: ModelSpec, domain: int | None) -> None:
    if not model.is_moe:
        if plan.ep != 1 or plan.etp != 1:
            raise SpecError("plan.ep", (plan.ep, plan.etp), "a dense model has no experts to split",
                            "set ep=1 and etp=1")
        return
    if not _divides(plan.ep, model.num_experts):
        raise SpecError("plan.ep", plan.ep, f"does not divide num_experts={model.num_experts}",
                        "use an expert-parallel degree that divides the expert count")
    if not _divides(plan.etp, model.moe_ffn_hidden_size):
        raise SpecError("plan.etp", plan.etp, f"does not divide moe_ffn_hidden_size={model.moe_ffn_hidden_size}",
                        "use an expert TP degree that divides the expert width")
    if domain is not None and (plan.etp > domain or domain % plan.etp):
        raise SpecError("plan.etp", plan.etp, f"an expert-TP group of {plan.etp} does not fit the NVLink domain "
                        f"of {domain}", f"use etp <= {domain}")
    stage = plan.tp * plan.cp * plan.dp
    if stage % (plan.ep * plan.etp):
        raise SpecError("plan.ep", plan.ep,
                        f"etp*ep = {plan.ep * plan.etp} does not divide the ranks of one stage, tp*cp*dp = {stage}",
                        "choose ep*etp dividing tp*cp*dp (MoE parallel folding)")


def _check_stages(plan: ParallelPlan, model: ModelSpec) -> None:
    num_layers = model.num_layers
    if plan.vpp > 1 and (plan.pp == 1 or plan.pp * plan.vpp > num_layers):
        raise SpecError("plan.vpp", plan.vpp, f"virtual stages need pp > 1 and pp*vpp <= num_layers={num_layers} "
                        f"(pp={plan.pp})", "use vpp=1, or fewer virtual stages")
    if plan.dualpipe and (plan.pp == 1 or plan.vpp > 1 or 2 * plan.pp > num_layers):
        raise SpecError("plan.dualpipe", plan.dualpipe, f"DualPipeV needs pp > 1, vpp = 1 and two chunks of layers "
                        f"a rank (2*pp <= num_layers={num_layers}; pp={plan.pp}, vpp={plan.vpp})",
                        "use dualpipe=false, or a pipeline with vpp=1 and fewer stages")
    if plan.dualpipe and plan.replica_microbatches is None \
            and plan.num_microbatches(model.global_batch_sequences) < 2 * plan.pp:
        m = plan.num_microbatches(model.global_batch_sequences)
        raise SpecError("plan.dualpipe", plan.dualpipe, f"DualPipeV needs at least 2*pp = {2 * plan.pp} micro-batches "
                        f"per replica; this plan has {m} (global_batch_sequences / (dp * micro_batch_size))",
                        "use dualpipe=false, fewer stages, a smaller micro_batch_size or dp, or a larger global batch")
    if plan.pp > num_layers:
        raise SpecError("plan.pp", plan.pp, f"more pipeline stages than layers ({num_layers})",
                        f"use pp <= {num_layers}")
    if plan.stage_starts is None:
        if num_layers % plan.pp:
            raise SpecError("plan.pp", plan.pp, f"num_layers={num_layers} is not divisible into {plan.pp} even stages",
                            "pick pp dividing the layer count, or give stage_starts (the planner balances them)")
        return
    starts = tuple(plan.stage_starts)
    if len(starts) != plan.pp or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
            or starts[-1] >= num_layers:
        raise SpecError("plan.stage_starts", starts,
                        f"needs {plan.pp} strictly increasing first-layer indices starting at 0, below {num_layers}",
                        "give the first layer of each stage, e.g. (0, 16) for 2 stages of 32 layers")


def _check_batch(plan: ParallelPlan, model: ModelSpec) -> None:
    gbs = model.global_batch_sequences
    if plan.replica_accelerators is not None and len(plan.replica_accelerators) != plan.dp:
        raise SpecError("plan.replica_accelerators", len(plan.replica_accelerators),
                        f"needs one accelerator type per DP replica ({plan.dp})", "give dp entries")
    if plan.replica_microbatches is not None:
        if len(plan.replica_microbatches) != plan.dp or min(plan.replica_microbatches) < 1:
            raise SpecError("plan.replica_microbatches", plan.replica_microbatches,
                            f"needs {plan.dp} positive micro-batch counts", "give one count >= 1 per DP replica")
        if sum(plan.replica_microbatches) * plan.micro_batch_size != gbs:
            raise SpecError("plan.replica_microbatches", plan.replica_microbatches,
                            f"sum x micro_batch_size != global_batch_sequences={gbs}",
                            "make the micro-batch counts add up to the global batch")
        return
    if gbs % (plan.dp * plan.micro_batch_size):
        raise SpecError("plan.micro_batch_size", plan.micro_batch_size,
                        f"dp*micro_batch_size = {plan.dp * plan.micro_batch_size} does not divide "
                        f"global_batch_sequences={gbs}",
                        "pick dp and micro_batch_size whose product divides the global batch")
