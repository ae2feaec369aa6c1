"""``rayfleet train job.yaml``: validate, submit through Ray's job API, follow with a progress bar.

``--dry-run`` prints the plan the job would get (``rayfleet.jobs.dry_run``: the submission's own
planning path) and returns without importing Ray or submitting anything.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def _cmd_train(args: argparse.Namespace) -> int:
    from rayfleet.jobs.train import load_spec

    spec = load_spec(args.job, overrides=args.set)
    if args.dry_run:
        from rayfleet.jobs.dry_run import dry_run, format_dry_run

        print(format_dry_run(dry_run(spec), spec))
        return 0
    from rayfleet.sdk import connect

    fleet = connect(args.address)
    run = fleet.train(spec, max_failures=args.max_failures)
    print(f"submitted {spec.name} as Ray job {run.job_id} (dashboard {run.dashboard_url})", flush=True)
    if args.detach:
        print(f"follow it: rayfleet job logs --follow {run.job_id}; stop it: rayfleet job stop {run.job_id}")
        return 0
    status = run.follow()
    rows = run.metrics()
    if rows:
        last = rows.last()
        val = [v for v in rows["val_loss"] if v is not None] if "val_loss" in rows.columns else []
        print(f"{spec.name}: {status} after {last.get('step')} steps, loss {last.get('loss'):.4f}"
              + (f", val_loss {val[-1]:.4f}" if val else ""))
    if status != "SUCCEEDED":
        print("\n".join(run.logs().splitlines()[-20:]), file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="submit a training job (YAML spec) and follow its progress")
    p.add_argument("job", help="job YAML (see examples/jobs)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--address", default=None, help="host:port of the cluster (default: the local fleet)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan the job would get (plan, memory, step time, layout size); no Ray, no submit")
    p.add_argument("--detach", action="store_true", help="submit and return without following")
    p.add_argument("--max-failures", type=int, default=None,
                   help="worker-group restarts (default: checkpoint.max_failures, or 0 without checkpoints)")
    p.set_defaults(func=_cmd_train)
