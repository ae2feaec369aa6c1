"""``python -m rayfleet.jobs.train job.yaml``: the entrypoint of a training job.

Run it with ``ray job submit -- python -m rayfleet.jobs.train job.yaml`` (or through
``rayfleet train`` / ``fleet.train``, which submit exactly this). The spec is validated and
the plan checked against the live fleet before any worker starts; a bad spec exits with code 2
and one line naming the field, the value and the fix.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Sequence

import yaml

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.planning import check_dataset
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import train_job
from rayfleet.jobs.training_run import decode_spec

__all__ = ["load_spec", "apply_overrides", "pin_checkpoint_uri", "main"]


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a spec mapping (copied)."""
    out = yaml.safe_load(yaml.safe_dump(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError("--set", item, "is not of the form key=value", "write e.g. --set steps=20")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def load_spec(path: str | None = None, *, overrides: Sequence[str] = (), spec_b64: str | None = None) -> TrainJobSpec:
    if spec_b64:
        data = decode_spec(spec_b64)
    elif path:
        data = TrainJobSpec.from_yaml(path).to_dict()
    else:
        raise SpecError("job", None, "no job spec given", "pass a job YAML path (see examples/jobs)")
    return TrainJobSpec.model_validate(apply_overrides(data, overrides))


def pin_checkpoint_uri(spec: TrainJobSpec, *, run_key: str | None, storage_path: str | None) -> TrainJobSpec:
    """``spec`` with ``checkpoint.uri`` set to ``<storage>/<run_key>/checkpoints`` when the job
    checkpoints, names no ``uri`` and has a run key; else ``spec`` unchanged.

    Why: without a uri each run keeps its checkpoints in its own timestamped directory, which a
    later submission cannot know. The run key (the first submission's id, kept by every
    ``rayfleet job resume``) makes the place the same for all submissions of one run, and the
    restore at start (``FlashCheckpointHook``: shared memory, else storage) picks the newest step.
    """
    if spec.checkpoint is None or spec.checkpoint.uri is not None or not run_key:
        return spec
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", run_key):
        raise SpecError("--run-key", run_key, "is not a plain directory name", "use letters, digits, '.', '_' and '-'")
    from rayfleet.jobs.train_launcher import default_storage_path

    uri = os.path.join(storage_path or default_storage_path(), run_key, "checkpoints")
    print(f"rayfleet train: checkpoints of run {run_key} in {uri}", flush=True)
    data = spec.to_dict()
    data["checkpoint"]["uri"] = uri
    return TrainJobSpec.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayfleet.jobs.train", description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", help="job YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set steps=20 --set plan.ep=2")
    parser.add_argument("--spec-b64", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--storage-path", default=None, help="where runs, metrics and checkpoints go")
    parser.add_argument("--max-failures", type=int, default=None,
                        help="worker-group restarts Ray Train may do (default: checkpoint.max_failures, else 0)")
    parser.add_argument("--run-key", default=None,
                        help="keep checkpoints under STORAGE/RUN_KEY/checkpoints (when checkpoint.uri is unset), "
                             "so that a resubmission with the same key resumes from them (`rayfleet job resume`)")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.job, overrides=args.set, spec_b64=args.spec_b64)
        spec = pin_checkpoint_uri(spec, run_key=args.run_key, storage_path=args.storage_path)
        # The job's edge: the spec was validated by load_spec and its dataset is checked here, once;
        # from here on the job travels as frozen slices (train_job), never as the spec.
        check_dataset(spec)
        from rayfleet.jobs.elastic.formation import run_training
        from rayfleet.platform.connection import connect

        connect()
        from rayfleet.jobs.admission_gate import submission_id

        final = run_training(train_job(spec), storage_path=args.storage_path, max_failures=args.max_failures,
                             job_id=submission_id(run_key=args.run_key, name=spec.name))
    except RayfleetError as exc:
        print(f"rayfleet train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"rayfleet train: {spec.name} finished: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(final.items())
        if k in ("step", "loss", "val_loss", "tokens_per_s", "mfu")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
