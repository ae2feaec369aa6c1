"""``rayfleet job ...``: the jobs on a fleet after submission, through Ray's job API.

    rayfleet job list [--json]
    rayfleet job status JOB [--json]
    rayfleet job logs JOB [--follow] [--json]
    rayfleet job stop JOB [--wait SECONDS]
    rayfleet job resume JOB [--follow]

JOB is a submission id from ``rayfleet job list`` (``rayfleet train`` prints it too). ``--address``
takes the job API URL (``http://HEAD:8265``, enough for a remote head) or a GCS ``host:port``;
without it the fleet ``rayfleet up`` started is used. The work is in ``rayfleet.jobs.lifecycle``.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register"]


def _client(args: argparse.Namespace):
    from rayfleet.jobs.lifecycle import job_client

    return job_client(args.address)


def _admissions(address: str | None) -> list[dict]:
    """The fleet controller's queued and admitted jobs, when it can be reached (best effort: a
    job API URL alone does not reach it unless this process is connected already)."""
    try:
        import ray

        from rayfleet.platform.controller import get_controller

        if not ray.is_initialized():
            if address and "://" in address:
                return []
            from rayfleet.platform.connection import connect

            connect(address)
        return ray.get(get_controller().admissions.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - a plain Ray cluster: no queues to show
        return []


def _cmd_list(args: argparse.Namespace) -> int:
    from rayfleet.jobs.lifecycle import list_jobs, render_jobs, with_admissions

    client = _client(args)
    records = with_admissions(list_jobs(client), _admissions(args.address))
    if args.kind:
        records = [r for r in records if r.kind == args.kind]
    print(json.dumps([r.to_json() for r in records], indent=2) if args.json else render_jobs(records))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rayfleet.jobs.lifecycle import get_job, render_job, with_admissions

    record = with_admissions([get_job(_client(args), args.job)], _admissions(args.address))[0]
    print(json.dumps(record.to_json(), indent=2) if args.json else render_job(record))
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    from rayfleet.jobs.lifecycle import follow_logs, get_job, job_logs

    client = _client(args)
    if not args.follow:
        text = job_logs(client, args.job)
        sys.stdout.write(json.dumps({"job": args.job, "logs": text}) + "\n" if args.json else text)
        return 0
    for chunk in follow_logs(client, args.job):
        if args.json:  # one JSON object per chunk (JSON lines), as it arrives
            print(json.dumps({"job": args.job, "text": chunk}), flush=True)
        else:
            sys.stdout.write(chunk)
            sys.stdout.flush()
    record = get_job(client, args.job)
    print(f"rayfleet job logs: {args.job} ended {record.status}", file=sys.stderr)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    from rayfleet.jobs.lifecycle import TERMINAL, stop_job

    record = stop_job(_client(args), args.job, wait_s=args.wait)
    print(f"{record.id}: {record.status}")
    return 0 if record.status in TERMINAL else 1


def _cmd_resume(args: argparse.Namespace) -> int:
    from rayfleet.jobs.lifecycle import follow_logs, resume_job

    client = _client(args)
    new_id = resume_job(client, args.job).job_id
    print(f"resumed {args.job} as {new_id} (follow it: rayfleet job logs --follow {new_id})", flush=True)
    if args.follow:
        for chunk in follow_logs(client, new_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rayfleet job {list,status,logs,stop,resume}``."""
    job = subparsers.add_parser("job", help="jobs on the fleet: list, status, logs [--follow], stop, resume",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = job.add_subparsers(dest="job_command", required=True)
    listing = sub.add_parser("list", help="every job the cluster knows, oldest first")
    listing.add_argument("--kind", choices=("train", "ray"), default=None,
                         help="only rayfleet training jobs (train) or jobs rayfleet did not submit (ray)")
    listing.set_defaults(func=_cmd_list)
    status = sub.add_parser("status", help="one job: status, message, times, entrypoint")
    status.set_defaults(func=_cmd_status)
    logs = sub.add_parser("logs", help="a job's log; --follow streams it until the job ends")
    logs.add_argument("--follow", "-f", action="store_true", help="stream new output (Ray's tail_job_logs)")
    logs.set_defaults(func=_cmd_logs)
    stop = sub.add_parser("stop", help="stop a job (SIGTERM to its driver, then SIGKILL)")
    stop.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                      help="how long to wait for it to end (default 30)")
    stop.set_defaults(func=_cmd_stop)
    resume = sub.add_parser("resume", help="resubmit a stopped/failed training job; it restores its last checkpoint")
    resume.add_argument("--follow", "-f", action="store_true", help="then stream its log")
    resume.set_defaults(func=_cmd_resume)
    for p in (status, logs, stop, resume):
        p.add_argument("job", metavar="JOB", help="submission id (see `rayfleet job list`)")
    for p in (listing, status, logs):
        p.add_argument("--json", action="store_true", help="machine-readable output")
    for p in (listing, status, logs, stop, resume):
        p.add_argument("--address", default=None,
                       help="job API URL (http://HEAD:8265) or GCS host:port (default: the `rayfleet up` fleet)")
