"""``TrainJobSpec``: the one typed description of a training job (YAML, SDK, CLI).

Design decisions:
- Pydantic v2 at the edge, one small section per concern (model, data, plan, optimizer,
  schedule, checkpoint, output, resources), each with ``extra="forbid"``; components receive
  only their section (torchtitan's lesson: a root config passed everywhere leaks everywhere).
- Every validation failure surfaces as :class:`rayfleet.errors.SpecError` naming the dotted
  field (``plan.ep``, ``model.config.dim``), the value and the fix, whether the spec came from
  ``from_yaml``, ``model_validate`` or the constructor: pydantic's ``ValidationError`` is
  translated once (:mod:`rayfleet.jobs.spec_errors`), so users never see two error shapes.
- Checks that need only the spec run at construction (names, ranges, batch arithmetic that
  does not depend on the fleet). Checks that need I/O or the fleet (the dataset's manifest,
  the plan against the accelerators' memory) live in :mod:`rayfleet.jobs.planning` and run
  in the driver before any worker starts.
- ``plan: auto`` is stored as ``None`` internally and serialised back as ``"auto"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from rayfleet.errors import SpecError
from rayfleet.jobs.runtime_env import RuntimeEnvSection
from rayfleet.jobs.spec_errors import split_spec_error, to_spec_error
from rayfleet.models.config import PRESETS, MoEConfig, preset
from rayfleet.models.fp8.recipe_names import RECIPE_NAMES
from rayfleet.placement.capabilities import require_runnable
from rayfleet.placement.plan import ParallelPlan
from rayfleet.platform.catalogue import accelerator_names, get_accelerator

__all__ = [
    "TrainJobSpec", "ModelSection", "DataSection", "PlanSection", "OptimizerSection", "ScheduleSection",
    "CheckpointSection", "OutputSection", "ResourcesSection", "ElasticSection", "EvalSection", "RuntimeEnvSection",
    "PRECISIONS",
    "is_fp8_precision",
]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", *sorted(RECIPE_NAMES))


def is_fp8_precision(precision: str) -> bool:
    """True when ``precision`` names an FP8 recipe (GEMMs in FP8, the rest in BF16)."""
    return precision in RECIPE_NAMES


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """A preset, ``config`` overrides of :class:`MoEConfig` fields, and the init seed; or ``hf``:
    a Hugging Face model folder/URI to start from (see ``rayfleet.jobs.hf_init``)."""

    preset: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    hf: str | None = None

    @model_validator(mode="after")
    def _builds(self) -> "ModelSection":
        if self.hf is not None:
            if self.preset is not None:
                raise SpecError("model.preset", self.preset, "conflicts with model.hf",
                                "give either a preset or an HF model, not both")
            self.to_config()  # reads config.json: a missing folder or unsupported model fails here
            return self
        if self.preset is None and not self.config:
            raise SpecError("model", {}, "names neither a preset nor a config",
                            f"add `preset: tiny` (one of {sorted(PRESETS)}) or `config: {{...}}`")
        if self.preset is not None and self.preset not in PRESETS:
            raise SpecError("model.preset", self.preset, "unknown model preset",
                            f"use one of {sorted(PRESETS)}")
        known = set(MoEConfig.__dataclass_fields__)
        unknown = sorted(set(self.config) - known)
        if unknown:
            raise SpecError(f"model.config.{unknown[0]}", self.config[unknown[0]], "is not a model config field",
                            f"use fields of MoEConfig: {sorted(known)}")
        try:
            self.to_config()
        except SpecError as err:
            why, fix = split_spec_error(err)
            raise SpecError(f"model.config.{err.field}", err.value, why, fix) from None
        except TypeError as err:
            raise SpecError("model.config", self.config, str(err), "give values of the right type") from None
        return self

    def to_config(self) -> MoEConfig:
        if self.hf is not None:
            from rayfleet.jobs.hf_init import hf_config

            return hf_config(self.hf, self.config)
        if self.preset is not None:
            return preset(self.preset, **self.config)
        return MoEConfig(**self.config)


class DataSection(_Section):
    """A Parquet token dataset (``rayfleet data prepare``) at an fsspec URI."""

    uri: str
    seq_len: int = Field(256, ge=1)
    shuffle: bool = True
    seed: int = 0


class EvalSection(_Section):
    """Validation every ``every_n_steps`` steps (and after the last) on ``batches`` global batches
    of the token dataset at ``uri`` (e.g. ``rayfleet data prepare --source shakespeare``'s ``val``);
    the same samples every time, logged as ``val_loss``."""

    uri: str = Field(min_length=1)
    every_n_steps: int = Field(250, ge=1)
    batches: int = Field(20, ge=1)


class PlanSection(_Section):
    """An explicit parallel plan; ``dp`` left out means "whatever fills the workers"."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int | None = Field(None, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    micro_batch_size: int | None = Field(None, ge=1)
    recompute: Literal["none", "selective", "full"] = "none"
    zero_stage: int = Field(3, ge=0, le=3)
    replica_microbatches: tuple[int, ...] | None = None
    replica_accelerators: tuple[str, ...] | None = None
    vpp: int = Field(1, ge=1)  # virtual pipeline stages per rank (interleaved 1F1B)
    dualpipe: bool = False  # DeepSeek's DualPipeV schedule

    @model_validator(mode="after")
    def _runnable(self) -> "PlanSection":
        # What the trainer runs is the capability table's to say (placement/capabilities.py), not
        # this section's: the same table narrows the planner's search.
        require_runnable(self.to_plan())
        return self

    def to_plan(self) -> ParallelPlan:
        """These degrees as a ``ParallelPlan`` (``dp`` / ``micro_batch_size`` open: 1), unvalidated."""
        return ParallelPlan(tp=self.tp, pp=self.pp, dp=self.dp or 1, cp=self.cp, ep=self.ep, etp=self.etp,
                            micro_batch_size=self.micro_batch_size or 1, recompute=self.recompute,
                            zero_stage=self.zero_stage, replica_microbatches=self.replica_microbatches,
                            replica_accelerators=self.replica_accelerators, vpp=self.vpp, dualpipe=self.dualpipe)

    @property
    def replica_size(self) -> int:
        return self.tp * self.cp * self.pp


class CommSection(_Section):
    """How collectives run: expert all-to-all overlap, FP8 dispatch (FP8 recipes only) and how
    context-parallel attention exchanges K/V (``all_gather``: one collective, whole-sequence K/V
    and scores kept per rank; ``ring``: point-to-point, O(S/cp) per rank, cp dependent hops)."""

    a2a_overlap: bool = True
    fp8_dispatch: bool = True
    cp_exchange: Literal["all_gather", "ring"] = "all_gather"


class OptimizerSection(_Section):
    """AdamW hyper-parameters (decoupled weight decay on matrices only)."""

    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise SpecError("optimizer.betas", v, "each beta must lie in [0, 1)", "use e.g. [0.9, 0.95]")
        return v


class ScheduleSection(_Section):
    """Linear warmup to ``optimizer.lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""

    kind: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)


class CheckpointSection(_Section):
    """Flash snapshots every ``every_n_steps``; every ``persist_every``-th one goes to ``uri``."""

    every_n_steps: int = Field(50, ge=1)
    persist_every: int = Field(10, ge=1)
    uri: str | None = None  # None: under the run's storage path
    keep: int = Field(3, ge=1)
    max_failures: int = Field(3, ge=0)  # worker-group restarts Ray Train may do; each resumes from snapshots


class OutputSection(_Section):
    """Where the final model is saved as a servable (``rayfleet.storage.model_registry``)."""

    uri: str


class ElasticSection(_Section):
    min_workers: int = Field(ge=1)
    max_workers: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "ElasticSection":
        if self.min_workers > self.max_workers:
            raise SpecError("resources.elastic.min_workers", self.min_workers,
                            f"exceeds max_workers={self.max_workers}", "make min_workers <= max_workers")
        return self


class ResourcesSection(_Section):
    """Which accelerators and how many workers (one worker per accelerator)."""

    accelerator: str = "H100"
    num_workers: int | None = Field(None, ge=1)
    elastic: ElasticSection | None = None
    # How the job's queue may reclaim its accelerators (docs/queues.md, job classes): None means
    # elastic for a job with resources.elastic and a checkpoint, guaranteed otherwise.
    job_class: str | None = None
    # On hosts shared with latency-sensitive work: each worker's CPU time at most this share of
    # its wall time (jobs/host_share.py). None: no cap.
    host_cpu_share: float | None = Field(None, gt=0, le=1)

    @field_validator("job_class")
    @classmethod
    def _job_class(cls, v: str | None) -> str | None:
        if v is not None and v not in ("guaranteed", "elastic", "opportunistic"):
            raise SpecError("resources.job_class", v, "is not a job class",
                            "use guaranteed, elastic or opportunistic (or leave it unset)")
        return v

    @field_validator("accelerator")
    @classmethod
    def _known(cls, v: str) -> str:
        try:
            return get_accelerator(v).name
        except ValueError:
            raise SpecError("resources.accelerator", v, "is not in the accelerator catalogue",
                            f"use one of {accelerator_names()}") from None


class TrainJobSpec(_Section):
    """A training job. See ``examples/jobs/*.yaml``.

    ``global_batch_size`` counts sequences of ``data.seq_len`` tokens per optimizer step;
    ``grad_accum`` (optional) fixes the micro-batches per DP replica, otherwise the plan's
    ``micro_batch_size`` derives it.
    """

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: ModelSection
    data: DataSection
    plan: PlanSection | None = None  # None == "auto"
    precision: str = "bf16"
    optimizer: OptimizerSection = OptimizerSection()
    schedule: ScheduleSection = ScheduleSection()
    steps: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    grad_accum: int | None = Field(None, ge=1)
    grad_clip: float | None = Field(1.0, gt=0)
    comm: CommSection = CommSection()
    checkpoint: CheckpointSection | None = None
    eval: EvalSection | None = None
    output: OutputSection | None = None
    priority: int = Field(0, ge=0, le=100)
    queue: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    resources: ResourcesSection = ResourcesSection()
    runtime_env: RuntimeEnvSection | None = None  # what travels to the head (jobs/runtime_env.py)

    # -- construction that always raises SpecError ---------------------------------------
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise to_spec_error(err, data, root=TrainJobSpec) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "TrainJobSpec":  # type: ignore[override]
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as err:
            raise to_spec_error(err, obj, root=cls) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainJobSpec":
        import yaml  # only the YAML edge needs it

        p = Path(path)
        if not p.exists():
            raise SpecError("job", str(path), "no such file", "pass the path of a job YAML (see examples/jobs)")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise SpecError("job", str(path), f"is not valid YAML ({err})", "fix the YAML syntax") from None
        if not isinstance(data, dict):
            raise SpecError("job", str(path), "must be a YAML mapping of job fields", "see examples/jobs/*.yaml")
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-ready form (``plan`` is "auto" when searched)."""
        return self.model_dump(mode="json")

    # -- field checks -----------------------------------------------------------------------
    @field_validator("plan", mode="before")
    @classmethod
    def _auto(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v.strip().lower() != "auto":
                raise SpecError("plan", v, "is neither 'auto' nor a mapping of parallel degrees",
                                "write `plan: auto` or e.g. `plan: {dp: 2, ep: 2}`")
            return None
        return v

    @field_serializer("plan")
    def _plan_out(self, plan: PlanSection | None) -> Any:
        return "auto" if plan is None else plan.model_dump(mode="json")

    @field_validator("precision")
    @classmethod
    def _precision(cls, v: str) -> str:
        if v not in PRECISIONS:
            raise SpecError("precision", v, "is neither fp32, bf16 nor a known FP8 recipe",
                            f"use one of {list(PRECISIONS)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "TrainJobSpec":
        config = self.model.to_config()
        if self.data.seq_len > config.max_seq_len:
            raise SpecError("data.seq_len", self.data.seq_len, f"exceeds the model's max_seq_len={config.max_seq_len}",
                            "lower data.seq_len or raise model.config.max_seq_len")
        if self.schedule.warmup_steps > self.steps:
            raise SpecError("schedule.warmup_steps", self.schedule.warmup_steps, f"exceeds steps={self.steps}",
                            "use fewer warmup steps than training steps")
        if self.plan is not None and self.plan.cp > 1 and self.data.seq_len % (2 * self.plan.cp):
            raise SpecError("data.seq_len", self.data.seq_len, f"plan.cp={self.plan.cp} cuts each sequence into "
                            f"2*cp={2 * self.plan.cp} equal chunks (load-balanced context parallelism)",
                            f"use a seq_len divisible by {2 * self.plan.cp}, or a smaller cp")
        if self.resources.job_class in ("elastic", "opportunistic") and (
                self.resources.elastic is None or self.checkpoint is None):
            raise SpecError("resources.job_class", self.resources.job_class,
                            "a reclaimed job re-forms (smaller, or later) from its checkpoint",
                            "add resources.elastic and a checkpoint section, or use job_class: guaranteed")
        self._check_batch()
        self._check_workers()
        return self

    def _check_batch(self) -> None:
        plan, gbs = self.plan, self.global_batch_size
        if plan is None or plan.dp is None:
            return
        if plan.replica_microbatches is not None:
            if len(plan.replica_microbatches) != plan.dp or min(plan.replica_microbatches) < 1:
                raise SpecError("plan.replica_microbatches", plan.replica_microbatches,
                                f"needs one count >= 1 per DP replica (dp={plan.dp})", "give dp positive counts")
            mbs = plan.micro_batch_size or 1
            if sum(plan.replica_microbatches) * mbs != gbs:
                raise SpecError("plan.replica_microbatches", plan.replica_microbatches,
                                f"sum x micro_batch_size={mbs} != global_batch_size={gbs}",
                                "make the counts add up to global_batch_size / micro_batch_size")
            return
        if gbs % plan.dp:
            raise SpecError("global_batch_size", gbs, f"is not divisible by plan.dp={plan.dp}",
                            f"use a multiple of {plan.dp} sequences")
        per_replica = gbs // plan.dp
        if plan.micro_batch_size is not None and per_replica % plan.micro_batch_size:
            raise SpecError("plan.micro_batch_size", plan.micro_batch_size,
                            f"does not divide the {per_replica} sequences each DP replica gets per step",
                            "pick a micro-batch size dividing global_batch_size / dp")
        if self.grad_accum is not None:
            if plan.micro_batch_size is not None and plan.micro_batch_size * self.grad_accum != per_replica:
                raise SpecError("grad_accum", self.grad_accum,
                                f"micro_batch_size={plan.micro_batch_size} x grad_accum != {per_replica} "
                                f"sequences per DP replica (global_batch_size={gbs} / dp={plan.dp})",
                                "drop one of grad_accum / micro_batch_size, or make them agree")
            if per_replica % self.grad_accum:
                raise SpecError("grad_accum", self.grad_accum,
                                f"does not divide the {per_replica} sequences per DP replica",
                                "pick grad_accum dividing global_batch_size / dp")

    def _check_workers(self) -> None:
        res, plan = self.resources, self.plan
        if res.elastic is not None and res.num_workers is not None and not (
                res.elastic.min_workers <= res.num_workers <= res.elastic.max_workers):
            raise SpecError("resources.num_workers", res.num_workers,
                            f"lies outside elastic [{res.elastic.min_workers}, {res.elastic.max_workers}]",
                            "make num_workers fall inside the elastic range")
        if plan is not None and plan.dp is not None and res.num_workers is not None:
            world = plan.replica_size * plan.dp
            if world != res.num_workers:
                raise SpecError("resources.num_workers", res.num_workers,
                                f"plan tp*cp*pp*dp = {world} accelerators",
                                f"set num_workers: {world} or change the plan's degrees")
