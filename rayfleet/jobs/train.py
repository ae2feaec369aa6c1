"""``python -m rayfleet.jobs.train job.yaml``: the entrypoint of a training job.

Run it with ``ray job submit -- python -m rayfleet.jobs.train job.yaml`` (or through
``rayfleet train`` / ``fleet.train``, which submit exactly this). The spec is validated and
the plan checked against the live fleet before any worker starts; a bad spec exits with code 2
and one line naming the field, the value and the fix.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import yaml

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.planning import check_dataset
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import train_job
from rayfleet.jobs.training_run import decode_spec

__all__ = ["load_spec", "apply_overrides", "main"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayfleet.jobs.train", description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", help="job YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set steps=20 --set plan.ep=2")
    parser.add_argument("--spec-b64", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--storage-path", default=None, help="where runs, metrics and checkpoints go")
    parser.add_argument("--max-failures", type=int, default=None,
                        help="worker-group restarts Ray Train may do (default: checkpoint.max_failures, else 0)")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.job, overrides=args.set, spec_b64=args.spec_b64)
        # The job's edge: the spec was validated by load_spec and its dataset is checked here, once;
        # from here on the job travels as frozen slices (train_job), never as the spec.
        check_dataset(spec)
        from rayfleet.jobs.elastic.formation import run_training
        from rayfleet.platform.connection import connect

        connect()
        final = run_training(train_job(spec), storage_path=args.storage_path, max_failures=args.max_failures)
    except RayfleetError as exc:
        print(f"rayfleet train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"rayfleet train: {spec.name} finished: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(final.items())
        if k in ("step", "loss", "tokens_per_s", "mfu")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
