"""A validated training job as small frozen slices: what each consumer of a ``TrainJobSpec`` gets.

Design decisions:
- The pydantic ``TrainJobSpec`` is validated once, at the job's edge (the CLI, the SDK, the
  ``python -m rayfleet.jobs.train`` entrypoint); :func:`train_job` then cuts it into frozen
  dataclasses, once, and nothing downstream sees the spec again (torchtitan deleted its
  ``JobConfig`` because a root config passed everywhere leaks everywhere):

  * the train loop gets a :class:`LoopConfig` (model, data, optimizer, schedule, precision);
  * the flash-checkpoint hook gets :class:`CheckpointSettings`;
  * the launcher and the elastic driver get :class:`~rayfleet.jobs.planning.PlanInputs` (the
    job in placement's terms) and :class:`ElasticBounds`;
  * the shared autoscaler's shell and the queue admission read the job's identity (name,
    queue, priority, class).

- Ray Train workers receive the loop config and the checkpoint settings pickled in their
  ``train_loop_config``: plain frozen dataclasses of built-in values and a ``MoEConfig``, so the
  workers re-validate nothing and the model's config (an HF ``config.json`` included) is read
  once, in the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rayfleet.jobs.planning import PlanInputs, plan_inputs
from rayfleet.jobs.spec import TrainJobSpec, is_fp8_precision
from rayfleet.models.config import MoEConfig

__all__ = ["DataSettings", "EvalSettings", "OptimizerSettings", "ScheduleSettings", "LoopConfig", "CheckpointSettings",
           "ElasticBounds", "TrainJob", "train_job", "loop_config", "checkpoint_settings"]


@dataclass(frozen=True)
class DataSettings:
    """The token dataset: where, how long a sample (tokens), and the shuffle order's seed."""

    uri: str
    seq_len: int
    shuffle: bool = True
    seed: int = 0


@dataclass(frozen=True)
class EvalSettings:
    """Validation: ``batches`` global batches of the dataset at ``uri``, every ``every_n_steps`` steps."""

    uri: str
    every_n_steps: int
    batches: int


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW hyper-parameters."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class ScheduleSettings:
    """Warmup then cosine (or constant) learning rate."""

    kind: str
    warmup_steps: int
    min_lr_ratio: float


@dataclass(frozen=True)
class LoopConfig:
    """Everything the train loop reads (``loop.train_worker``).

    ``global_batch_size`` counts sequences of ``data.seq_len`` tokens per step; ``accelerator``
    prices MFU when the plan names no per-replica types; ``output_uri`` receives the final model.
    """

    name: str
    model: MoEConfig
    seed: int
    hf: str | None
    precision: str
    data: DataSettings
    optimizer: OptimizerSettings
    schedule: ScheduleSettings
    steps: int
    global_batch_size: int
    grad_clip: float | None
    a2a_overlap: bool
    fp8_dispatch: bool
    accelerator: str
    cp_exchange: str = "all_gather"
    output_uri: str | None = None
    eval: EvalSettings | None = None
    host_cpu_share: float | None = None  # jobs/host_share.py


@dataclass(frozen=True)
class CheckpointSettings:
    """Flash snapshots every ``every_n_steps``; every ``persist_every``-th goes to ``uri``."""

    every_n_steps: int
    persist_every: int
    uri: str | None
    keep: int
    max_failures: int


@dataclass(frozen=True)
class ElasticBounds:
    """An elastic job's size range, in workers."""

    min_workers: int
    max_workers: int


@dataclass(frozen=True)
class TrainJob:
    """A validated job, as the driver holds it: identity plus one slice per consumer."""

    name: str
    queue: str
    priority: int
    steps: int
    loop: LoopConfig
    planning: PlanInputs
    checkpoint: CheckpointSettings | None = None
    elastic: ElasticBounds | None = None
    job_class: str | None = None  # resources.job_class; None: elastic when is_elastic, else guaranteed

    @property
    def queue_class(self) -> str:
        """How the job's queue may reclaim it: guaranteed, elastic or opportunistic (docs/queues.md)."""
        return self.job_class or ("elastic" if self.is_elastic else "guaranteed")

    @property
    def accelerator(self) -> str:
        return self.planning.accelerator

    @property
    def replica_size(self) -> int:
        return self.planning.replica_size

    @property
    def is_elastic(self) -> bool:
        """Re-formed by the driver: an elastic range and checkpoints to resume from."""
        return self.elastic is not None and self.checkpoint is not None

    def with_checkpoint_uri(self, uri: str) -> "TrainJob":
        assert self.checkpoint is not None
        return replace(self, checkpoint=replace(self.checkpoint, uri=uri))


def loop_config(spec: TrainJobSpec) -> LoopConfig:
    """The train loop's slice of ``spec``."""
    opt, sched, data, ev = spec.optimizer, spec.schedule, spec.data, spec.eval
    return LoopConfig(
        name=spec.name, model=spec.model.to_config(), seed=spec.model.seed, hf=spec.model.hf,
        precision=spec.precision,
        data=DataSettings(uri=data.uri, seq_len=data.seq_len, shuffle=data.shuffle, seed=data.seed),
        optimizer=OptimizerSettings(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay),
        schedule=ScheduleSettings(kind=sched.kind, warmup_steps=sched.warmup_steps, min_lr_ratio=sched.min_lr_ratio),
        steps=spec.steps, global_batch_size=spec.global_batch_size, grad_clip=spec.grad_clip,
        a2a_overlap=spec.comm.a2a_overlap,
        fp8_dispatch=spec.comm.fp8_dispatch and is_fp8_precision(spec.precision), cp_exchange=spec.comm.cp_exchange,
        accelerator=spec.resources.accelerator, output_uri=spec.output.uri if spec.output is not None else None,
        eval=EvalSettings(uri=ev.uri, every_n_steps=ev.every_n_steps, batches=ev.batches) if ev is not None else None,
        host_cpu_share=spec.resources.host_cpu_share)


def checkpoint_settings(spec: TrainJobSpec) -> CheckpointSettings | None:
    """The checkpoint hook's slice of ``spec`` (``None``: no ``checkpoint`` section)."""
    ck = spec.checkpoint
    if ck is None:
        return None
    return CheckpointSettings(every_n_steps=ck.every_n_steps, persist_every=ck.persist_every, uri=ck.uri,
                              keep=ck.keep, max_failures=ck.max_failures)


def train_job(spec: TrainJobSpec) -> TrainJob:
    """Cut a validated spec into the slices its consumers take (once per job)."""
    el = spec.resources.elastic
    return TrainJob(name=spec.name, queue=spec.queue, priority=spec.priority, steps=spec.steps,
                    loop=loop_config(spec), planning=plan_inputs(spec), checkpoint=checkpoint_settings(spec),
                    elastic=ElasticBounds(el.min_workers, el.max_workers) if el is not None else None,
                    job_class=spec.resources.job_class)
