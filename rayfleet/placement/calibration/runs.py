"""Published training runs: the YAML table beside this module, validated into ``PublishedRun``.

A run's plan is taken as published (degrees, micro-batch, ZeRO stage); a plan the published
degrees cannot form is an error that names the run and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from rayfleet.errors import SpecError
from rayfleet.placement.model_spec import ModelSpec, preset
from rayfleet.placement.plan import ParallelPlan, validate_plan
from rayfleet.platform.catalogue import get_accelerator

__all__ = ["PUBLISHED_RUNS_PATH", "PublishedRun", "load_published_runs"]

PUBLISHED_RUNS_PATH = Path(__file__).with_name("published_runs.yaml")


class _PlanInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    zero_stage: int = 1
    ep_overlap: bool = True
    ep_dedup: bool = True
    tp_overlap: bool = True


class _RunInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    source: str
    hardware: str
    model: str
    seq_len: int
    global_batch_sequences: int
    precision: str
    plan: _PlanInput
    tokens_per_s_per_gpu: float
    routing: Literal["n/a", "forced_balance", "token_drop", "dropless"] = "n/a"
    fit: bool = False


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement: ``plan`` (recompute left to the model) of ``model`` on
    ``plan.world_size`` accelerators of type ``hardware`` ran at ``tokens_per_s_per_gpu``.

    ``routing`` is how the MoE router placed tokens in that run, as its source states it:
    ``forced_balance`` (the router forced an even load: what the cost model assumes),
    ``token_drop`` (a capacity factor capped each expert's load), ``dropless`` (every token
    routed, loads as the router chose them: slower than balanced), ``n/a`` for dense models."""

    id: str
    source: str
    hardware: str
    model: ModelSpec
    plan: ParallelPlan
    tokens_per_s_per_gpu: float
    fit: bool
    routing: str = "n/a"

    @property
    def num_gpus(self) -> int:
        return self.plan.world_size

    @property
    def step_time_s(self) -> float:
        return self.model.global_batch_tokens / (self.tokens_per_s_per_gpu * self.num_gpus)




def load_published_runs(path: str | Path = PUBLISHED_RUNS_PATH) -> tuple[PublishedRun, ...]:
    """The runs in ``path`` (YAML), validated; errors name the run and the field."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    out = []
    for i, raw in enumerate(data.get("runs", [])):
        try:
            run = _RunInput.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            raise SpecError(f"runs[{i}]." + ".".join(str(p) for p in first["loc"]), first.get("input"), first["msg"],
                            f"fix {Path(path).name}") from None
        model = preset(run.model, seq_len=run.seq_len, global_batch_sequences=run.global_batch_sequences,
                       precision=run.precision,
                       **({"moe_routing": run.routing} if run.routing != "n/a" else {}))
        p = run.plan
        width = p.tp * p.cp * p.pp
        if p.num_gpus % width:
            raise SpecError(f"runs[{i}].plan.num_gpus", p.num_gpus, f"is not a multiple of tp*cp*pp={width}",
                            "check the published degrees")
        plan = ParallelPlan(tp=p.tp, pp=p.pp, cp=p.cp, vpp=p.vpp, ep=p.ep, etp=p.etp, dp=p.num_gpus // width,
                            micro_batch_size=p.micro_batch_size, zero_stage=p.zero_stage, ep_overlap=p.ep_overlap,
                            ep_dedup=p.ep_dedup, tp_overlap=p.tp_overlap)
        try:  # uneven splits are balanced by the cost model: validate with placeholder boundaries
            validate_plan(replace(plan, stage_starts=tuple(range(plan.pp))), model,
                          scaleup_domain_size=get_accelerator(run.hardware).scaleup_domain_size)
        except SpecError as err:
            why_fix = str(err).split(": ", 1)[-1]
            why, _, fix = why_fix.rpartition(". Fix: ")
            raise SpecError(f"runs[{i}] ({run.id}).{err.field}", err.value, why, fix) from None
        if model.is_moe == (run.routing == "n/a"):
            raise SpecError(f"runs[{i}] ({run.id}).routing", run.routing,
                            "MoE runs state their routing (forced_balance, token_drop, dropless); dense runs have none",
                            "label the row as its source does")
        out.append(PublishedRun(run.id, run.source, get_accelerator(run.hardware).name, model, plan,
                                run.tokens_per_s_per_gpu, run.fit, run.routing))
    return tuple(out)
