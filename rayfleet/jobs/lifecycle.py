"""Jobs after submission: list, status, logs (and following them), stop and resume.

    records = list_jobs(client)                  # every job Ray knows, rayfleet's and others'
    for chunk in follow_logs(client, job_id): ...
    stop_job(client, job_id)                     # -> its final JobRecord
    resumed = resume_job(client, job_id)         # a stopped/failed training job, from its checkpoints

Design decisions:
- Ray's job API (``JobSubmissionClient``) is the only source: a job listed here is exactly what
  ``ray job list`` and the dashboard show, and it needs nothing but the job API's address, so it
  works against a remote head reached over its dashboard port alone.
- Following a log uses ``tail_job_logs`` (a websocket: each chunk is sent once as the driver writes
  it); polling ``get_job_logs`` would download the whole log again every second.
- rayfleet's own facts about a job travel in its Ray job metadata (``rayfleet.kind``, ``.job``,
  ``.queue``, ``.resumed_from``); :class:`JobRecord` reads them back, so nothing else is stored.
  Where the fleet controller is reachable, its queue state (QUEUED, reason, place in line) is
  merged in (:func:`with_admissions`); through the job API alone it is not.
- Resume resubmits the job's own entrypoint unchanged: the same spec, flags and ``--run-key``, so
  the new driver pins the same checkpoint directory (``rayfleet.jobs.train.pin_checkpoint_uri``)
  and its workers restore the newest step there. The runtime env is rebuilt from the spec (a
  local ``working_dir`` is uploaded again) rather than reusing the old job's ``gcs://`` package,
  which Ray may have garbage-collected once that job ended.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from rayfleet.errors import RayfleetError

__all__ = ["JobRecord", "JobNotFoundError", "JobStateError", "record_of", "with_admissions", "render_jobs", "render_job",
           "job_client", "resolve_job_api_url", "list_jobs", "get_job", "job_logs", "follow_logs", "stop_job",
           "ResumeRequest", "ResumedJob", "resume_request", "resume_job"]

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
RESUMABLE = ("STOPPED", "FAILED")


class JobNotFoundError(RayfleetError):
    """No job with that id on the cluster."""


class JobStateError(RayfleetError):
    """The job exists but cannot do what was asked in its state (resume a running job, ...)."""


@dataclass(frozen=True)
class JobRecord:
    """One Ray job as rayfleet shows it. ``kind``: ``"train"`` for rayfleet training jobs, ``"ray"``
    for jobs rayfleet did not submit. Times are Unix seconds (``None`` until known)."""

    id: str  # the submission id (what every command takes), else Ray's job id
    status: str
    kind: str
    name: str
    queue: str | None
    entrypoint: str
    message: str
    start_time_s: float | None
    end_time_s: float | None
    resumed_from: str | None
    ray_job_id: str | None
    # From the fleet controller's queue admission (None for jobs outside the queues): while the
    # job waits, ``status`` reads QUEUED (Ray says RUNNING: its driver runs and waits).
    queue_state: str | None = None
    queue_reason: str | None = None
    queue_position: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def duration_s(self, now_s: float | None = None) -> float | None:
        if self.start_time_s is None:
            return None
        return (self.end_time_s or now_s or time.time()) - self.start_time_s


def record_of(details: Any) -> JobRecord:
    """A :class:`JobRecord` from Ray's ``JobDetails`` (``list_jobs`` / ``get_job_info``)."""
    meta = dict(details.metadata or {})
    status = getattr(details.status, "value", details.status)
    ms = lambda t: None if not t else t / 1000.0  # noqa: E731 - Ray reports milliseconds
    return JobRecord(id=details.submission_id or details.job_id or "", status=str(status),
                     kind=meta.get("rayfleet.kind", "ray"), name=meta.get("rayfleet.job", ""),
                     queue=meta.get("rayfleet.queue"), entrypoint=details.entrypoint or "",
                     message=details.message or "", start_time_s=ms(details.start_time),
                     end_time_s=ms(details.end_time), resumed_from=meta.get("rayfleet.resumed_from"),
                     ray_job_id=details.job_id)


def with_admissions(records: list[JobRecord], admissions: list[dict]) -> list[JobRecord]:
    """``records`` with the controller's queue state (``AdmissionRecord`` JSON) merged in (pure):
    a live job that waits in its queue shows status QUEUED, its reason and its place in line."""
    from dataclasses import replace

    by_id = {a["request"]["job_id"]: a for a in admissions}
    out = []
    for record in records:
        found = by_id.get(record.id)
        if found is None or record.status in TERMINAL:
            out.append(record)
            continue
        queued = found["state"] == "QUEUED"
        out.append(replace(record, status="QUEUED" if queued else record.status, queue_state=found["state"],
                           queue_reason=found["reason"], queue_position=found["position"] if queued else None))
    return out


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def render_jobs(records: list[JobRecord], *, now_s: float | None = None) -> str:
    """The ``rayfleet job list`` table (oldest first)."""
    from rayfleet.platform.status_table import format_table

    if not records:
        return "no jobs"
    any_reason = any(r.queue_state == "QUEUED" for r in records)
    rows = [(r.id, r.kind, r.name or "-", r.queue or "-",
             r.status + (f" (place {r.queue_position})" if r.queue_position else ""),
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.start_time_s)) if r.start_time_s else "-",
             _fmt_duration(r.duration_s(now_s))) + ((r.queue_reason or "",) if any_reason else ())
            for r in records]
    return format_table(("job", "kind", "name", "queue", "status", "started", "duration")
                        + (("queue reason",) if any_reason else ()), rows)


def render_job(record: JobRecord) -> str:
    """``rayfleet job status``: one ``field: value`` line per field that has a value."""
    lines = [f"{k}: {v}" for k, v in record.to_json().items() if v not in (None, "")]
    return "\n".join(lines)


# -- the job API ------------------------------------------------------------------------------------
def resolve_job_api_url(address: str | None) -> str:
    """The job API (dashboard) URL to talk to.

    ``address``: an ``http(s)://`` URL is used as is; a GCS ``host:port`` is joined with Ray to
    ask it; ``None`` means ``RAY_API_SERVER_ADDRESS`` or an ``http`` ``RAY_ADDRESS`` (as Ray's own
    ``ray job`` CLI reads them), else the fleet ``rayfleet up`` recorded.
    """
    from rayfleet.errors import FleetNotFoundError
    from rayfleet.platform.launcher import LocalFleet, rayfleet_home

    if address and "://" in address:
        return address.rstrip("/")
    if address is None:
        for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
            if "://" in os.environ.get(var, ""):
                return os.environ[var].rstrip("/")
        record = LocalFleet.load(missing_ok=True)
        if record is not None and record.is_running() and record.dashboard_url:
            return record.dashboard_url
        if not os.environ.get("RAY_ADDRESS"):
            raise FleetNotFoundError(
                f"no job API address: no --address, no RAY_API_SERVER_ADDRESS and no running fleet recorded under "
                f"{rayfleet_home()}. Fix: pass --address http://HEAD:8265 (the dashboard port) or run `rayfleet up`")
    from rayfleet.platform.connection import connect
    from rayfleet.platform.ray_compat import dashboard_url

    connect(address)
    return dashboard_url()


def job_client(address: str | None = None):
    """A ``JobSubmissionClient`` for ``address`` (see :func:`resolve_job_api_url`), token auth on."""
    from ray.job_submission import JobSubmissionClient

    from rayfleet.platform.launcher import ensure_auth_token

    from rayfleet.errors import FleetNotFoundError

    ensure_auth_token()
    url = resolve_job_api_url(address)
    try:
        return JobSubmissionClient(url)
    except ConnectionError as exc:  # Ray's client probes the address on construction
        raise FleetNotFoundError(
            f"no Ray job API answers at {url} ({str(exc).splitlines()[0][:200]}). Fix: pass the head's dashboard "
            "URL, e.g. --address http://HEAD:8265, or start a fleet with `rayfleet up`") from None


def list_jobs(client: Any) -> list[JobRecord]:
    """Every job the cluster knows, oldest first."""
    return sorted((record_of(d) for d in client.list_jobs()), key=lambda r: (r.start_time_s or 0.0, r.id))


def get_job(client: Any, job_id: str) -> JobRecord:
    """The job ``job_id`` (a submission id or Ray job id); raises :class:`JobNotFoundError`."""
    try:
        return record_of(client.get_job_info(job_id))
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            raise JobNotFoundError(f"no job {job_id!r} on {client.get_address()}. "
                                   "Fix: take an id from `rayfleet job list`") from None
        raise


def job_logs(client: Any, job_id: str) -> str:
    get_job(client, job_id)  # a clear error for an unknown id
    return client.get_job_logs(job_id)


def follow_logs(client: Any, job_id: str) -> Iterator[str]:
    """The job's log from its start, chunk by chunk as the driver writes it, until the job ends
    (Ray's ``tail_job_logs`` websocket, through :mod:`rayfleet.jobs.log_stream`)."""
    from rayfleet.jobs.log_stream import stream_job_logs

    get_job(client, job_id)
    yield from stream_job_logs(client, job_id)


def stop_job(client: Any, job_id: str, *, wait_s: float = 30.0, poll_s: float = 0.5) -> JobRecord:
    """Ask Ray to stop the job (SIGTERM to its driver, then SIGKILL), wait up to ``wait_s`` for
    it to end; returns its record then (status ``STOPPED`` unless it had ended already)."""
    record = get_job(client, job_id)
    if record.status in TERMINAL:
        return record
    client.stop_job(job_id)
    deadline = time.monotonic() + wait_s
    while record.status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(poll_s)
        record = get_job(client, job_id)
    return record


# -- resume --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeRequest:
    """What ``submit_job`` gets to resume a job (``runtime_env`` is rebuilt by :func:`resume_job`)."""

    entrypoint: str
    spec: Any  # TrainJobSpec, decoded from the entrypoint
    metadata: dict[str, str]


def resume_request(record: JobRecord, *, metadata: dict[str, str]) -> ResumeRequest:
    """Check that ``record`` can be resumed and build its resubmission (pure; ``metadata``: the
    old job's). Raises :class:`JobStateError` naming why not and what to do instead."""
    from rayfleet.jobs.spec import TrainJobSpec
    from rayfleet.jobs.training_run import decode_spec

    if record.kind != "train":
        raise JobStateError(f"job {record.id} is not a rayfleet training job (metadata rayfleet.kind="
                            f"{record.kind!r}): only those are resumed. Fix: submit it again with `ray job submit`")
    if record.status not in RESUMABLE:
        fix = ("stop it first: `rayfleet job stop " + record.id + "`" if record.status not in TERMINAL
               else "submit a new run with `rayfleet train`")
        raise JobStateError(f"job {record.id} is {record.status}; only a STOPPED or FAILED job is resumed. Fix: {fix}")
    argv = shlex.split(record.entrypoint)
    if "--spec-b64" not in argv[:-1]:
        raise JobStateError(f"job {record.id}'s entrypoint carries no spec ({record.entrypoint[:80]!r}). "
                            "Fix: submit the job YAML again with `rayfleet train`")
    spec = TrainJobSpec.model_validate(decode_spec(argv[argv.index("--spec-b64") + 1]))
    if spec.checkpoint is None:
        raise JobStateError(f"job {record.id} ({spec.name}) has no checkpoint section, so a resubmission would "
                            "start again at step 0. Fix: add `checkpoint:` to the job YAML and submit it with "
                            "`rayfleet train`")
    if spec.checkpoint.uri is None and "--run-key" not in argv:
        raise JobStateError(f"job {record.id} ({spec.name}) recorded no checkpoint location (no checkpoint.uri and "
                            "no --run-key in its entrypoint). Fix: submit it with `rayfleet train`, or set "
                            "checkpoint.uri in the job YAML")
    return ResumeRequest(entrypoint=record.entrypoint, spec=spec,
                         metadata={**metadata, "rayfleet.resumed_from": record.id})


@dataclass(frozen=True)
class ResumedJob:
    """A resubmission: its new submission id and the (unchanged) spec it runs."""

    job_id: str
    resumed_from: str
    spec: Any  # TrainJobSpec


def resume_job(client: Any, job_id: str) -> ResumedJob:
    """Resubmit the stopped or failed training job ``job_id`` so that it restores its newest
    checkpoint; returns the new submission."""
    from rayfleet.jobs.runtime_env import ray_runtime_env
    from rayfleet.jobs.training_run import new_submission_id

    record = get_job(client, job_id)
    request = resume_request(record, metadata=dict(client.get_job_info(job_id).metadata or {}))
    runtime_env = ray_runtime_env(request.spec.runtime_env)  # SpecError if a local working_dir is gone
    new_id = client.submit_job(entrypoint=request.entrypoint, submission_id=new_submission_id(request.spec.name),
                               runtime_env=runtime_env, metadata=request.metadata)
    return ResumedJob(job_id=new_id, resumed_from=record.id, spec=request.spec)
