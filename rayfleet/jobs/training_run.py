"""A submitted training job as seen from a notebook or the CLI: status, metrics, logs, cancel.

Design decisions:
- Jobs go through Ray's job API (``JobSubmissionClient``), the same path as ``ray job submit``,
  so a run started from a notebook, the CLI or a shell is the same kind of object, survives the
  client going away, and shows up in the Ray dashboard.
- Rank 0 prints one line per step, ``RAYFLEET_METRICS {json}``, to the job's log. The client
  reads metrics back from the log it already has to fetch for ``logs()``; no second channel
  (and no port on the driver) is needed. The same rows are also written to Parquet in the
  run's storage and exported as Ray metrics by the job itself.
- ``MetricsTable`` is a small column view of those rows (``table["loss"]``, ``table.last()``,
  ``to_pandas()`` when pandas is installed): notebooks get a table without a hard pandas
  dependency.
"""

from __future__ import annotations

import base64
import json
import math
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from rayfleet.errors import RayfleetError

__all__ = ["METRICS_PREFIX", "format_metrics_line", "parse_metrics_lines", "MetricsTable",
           "TrainingRun", "JobFailedError", "submit_training", "summarize", "encode_spec", "decode_spec", "render_progress",
           "training_entrypoint", "new_submission_id", "train_metadata", "TERMINAL"]

METRICS_PREFIX = "RAYFLEET_METRICS "
QUEUE_PREFIX = "rayfleet queue: "  # the driver's queue admission lines (jobs.admission_gate)
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class JobFailedError(RayfleetError):
    """A training job ended in FAILED or STOPPED."""


def format_metrics_line(metrics: dict[str, Any]) -> str:
    return METRICS_PREFIX + json.dumps(metrics, sort_keys=True, default=float)


def parse_metrics_lines(text: str) -> list[dict[str, Any]]:
    """Every ``RAYFLEET_METRICS`` row in a log (Ray may prefix worker lines with ``(pid=...)``)."""
    rows = []
    for line in text.splitlines():
        at = line.find(METRICS_PREFIX)
        if at < 0:
            continue
        try:
            rows.append(json.loads(line[at + len(METRICS_PREFIX):]))
        except json.JSONDecodeError:
            continue  # a line cut by log rotation; the next step's row follows
    # A restarted worker group re-reports steps: keep the newest row of each step.
    by_step: dict[Any, dict] = {}
    for row in rows:
        by_step[row.get("step", len(by_step))] = row
    return [by_step[k] for k in sorted(by_step, key=lambda s: (s is None, s))]


def encode_spec(spec_dict: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(spec_dict).encode()).decode()


def decode_spec(text: str) -> dict[str, Any]:
    return json.loads(base64.urlsafe_b64decode(text.encode()))


@dataclass(frozen=True)
class MetricsTable:
    """Per-step metrics rows with column access."""

    rows: tuple[dict[str, Any], ...] = ()

    @property
    def columns(self) -> list[str]:
        return sorted({k for row in self.rows for k in row})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, column: str) -> list[Any]:
        if column not in self.columns:
            raise KeyError(f"no column {column!r}; columns: {self.columns}")
        return [row.get(column) for row in self.rows]

    def last(self) -> dict[str, Any]:
        return dict(self.rows[-1]) if self.rows else {}

    def to_pandas(self):
        import pandas as pd  # optional; notebooks usually have it

        return pd.DataFrame(list(self.rows))

    def __repr__(self) -> str:
        cols = [c for c in ("step", "loss", "tokens_per_s", "mfu", "step_time_s") if c in self.columns]
        lines = ["  ".join(f"{c:>12}" for c in cols)]
        for row in self.rows[-10:]:
            lines.append("  ".join(f"{_fmt(row.get(c)):>12}" for c in cols))
        return f"MetricsTable({len(self)} rows)\n" + "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def render_progress(row: dict[str, Any], *, total_steps: int | None, started_s: float) -> str:
    """One progress line: ``[#####     ] step 12/40  loss 4.812  1.2k tok/s  ETA 0:21``."""
    step = int(row.get("step", 0))
    frac = min(1.0, step / total_steps) if total_steps else 0.0
    bar = "#" * int(frac * 20)
    elapsed = time.monotonic() - started_s
    eta = (elapsed / frac - elapsed) if frac > 0 else math.nan
    eta_s = "--:--" if math.isnan(eta) else f"{int(eta // 60)}:{int(eta % 60):02d}"
    tps = row.get("tokens_per_s") or 0.0
    loss = row.get("loss")
    loss_s = f"{loss:.4f}" if isinstance(loss, (int, float)) else "?"
    total = f"/{total_steps}" if total_steps else ""
    return f"[{bar:<20}] step {step}{total}  loss {loss_s}  {tps:,.0f} tok/s  ETA {eta_s}"


@dataclass
class TrainingRun:
    """A training job submitted through Ray's job API.

    ``status()``: PENDING / RUNNING / SUCCEEDED / FAILED / STOPPED. ``metrics()``: a
    ``MetricsTable``. ``wait()`` blocks until the end and raises ``JobFailedError`` on failure.
    """

    job_id: str
    dashboard_url: str
    name: str = ""
    total_steps: int | None = None
    _client: Any = field(default=None, repr=False)

    @property
    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            self._client = JobSubmissionClient(self.dashboard_url)
        return self._client

    def status(self) -> str:
        return str(self.client.get_job_status(self.job_id).value)

    def info(self):
        return self.client.get_job_info(self.job_id)

    def logs(self) -> str:
        return self.client.get_job_logs(self.job_id)

    def metrics(self) -> MetricsTable:
        return MetricsTable(tuple(parse_metrics_lines(self.logs())))

    def plot(self, path: str | None = None):
        """Loss and tokens/s against step (a matplotlib ``Figure``: a notebook shows it); also
        saved as PNG at ``path`` when given. Rank 0 writes the same plot as ``metrics.png``
        beside the run's Parquet metrics when the run ends."""
        from rayfleet.jobs.train_metrics import plot_metrics

        return plot_metrics(self.metrics().rows, path)

    def cancel(self) -> bool:
        return bool(self.client.stop_job(self.job_id))

    def wait(self, timeout_s: float = 3600.0, *, poll_s: float = 1.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            if status in TERMINAL:
                if status != "SUCCEEDED":
                    raise JobFailedError(self._failure_message(status))
                return status
            time.sleep(poll_s)
        raise TimeoutError(f"training job {self.job_id} still {self.status()} after {timeout_s:.0f} s")

    def follow(self, *, out=sys.stdout, poll_s: float = 1.0) -> str:
        """Print a progress line per new step (and the queue admission's lines: QUEUED with
        reason and place, admitted) until the job ends; returns the final status.

        Reads the log once, as it is written (Ray's ``tail_job_logs``); if that stream breaks
        (the head restarted), falls back to polling the status every ``poll_s`` seconds."""
        from rayfleet.jobs.log_stream import complete_lines, stream_job_logs

        started, seen = time.monotonic(), -1
        try:
            for line in complete_lines(stream_job_logs(self.client, self.job_id)):
                if QUEUE_PREFIX in line:  # waiting in its queue, admitted, reclaimed: say so
                    print(line[line.find(QUEUE_PREFIX):].rstrip(), file=out, flush=True)
                for row in parse_metrics_lines(line):
                    if int(row.get("step", 0)) > seen:
                        seen = int(row.get("step", 0))
                        print(render_progress(row, total_steps=self.total_steps, started_s=started), file=out,
                              flush=True)
        except RuntimeError as exc:
            print(f"rayfleet: log stream of {self.job_id} broke ({exc}); waiting for the job to end", file=out)
        while (status := self.status()) not in TERMINAL:
            time.sleep(poll_s)
        return status

    def _failure_message(self, status: str) -> str:
        info = self.info()
        tail = "\n".join(self.logs().splitlines()[-15:])
        return (f"training job {self.job_id} ({self.name}) ended {status}: {info.message}\n"
                f"last log lines:\n{tail}")


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean throughput and final loss of a run's rows (for CLI summaries and demos)."""
    if not rows:
        return {}
    steady = rows[1:] or rows  # the first step pays for warm-up
    return {"steps": len(rows), "final_loss": rows[-1].get("loss"),
            "mean_tokens_per_s": sum(r.get("tokens_per_s", 0.0) for r in steady) / len(steady)}


def training_entrypoint(spec_b64: str, *, max_failures: int | None = None, storage_path: str | None = None,
                        run_key: str | None = None) -> str:
    """The job's shell command line; every value is quoted (a path is data, never shell syntax).

    ``run_key`` names the run's checkpoint directory in the driver's storage (``--run-key``; see
    ``rayfleet.jobs.train``): every resubmission of the run (``rayfleet job resume``) keeps it."""
    entrypoint = f"python -m rayfleet.jobs.train --spec-b64 {shlex.quote(spec_b64)}"
    if run_key:
        entrypoint += f" --run-key {shlex.quote(run_key)}"
    if max_failures is not None:
        entrypoint += f" --max-failures {int(max_failures)}"
    if storage_path:
        entrypoint += f" --storage-path {shlex.quote(storage_path)}"
    return entrypoint


def new_submission_id(name: str) -> str:
    """``rayfleet-train-<job>-<YYYYmmdd-HHMMSS>-<6 hex>``: unique, sortable, and says what it is."""
    return f"rayfleet-train-{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def train_metadata(spec, **extra: str) -> dict[str, str]:
    """The Ray job metadata of a training job (``rayfleet job list`` reads it back)."""
    return {"rayfleet.kind": "train", "rayfleet.job": spec.name, "rayfleet.queue": spec.queue, **extra}


def submit_training(spec, *, dashboard_url: str, max_failures: int | None = None,
                    storage_path: str | None = None) -> TrainingRun:
    """Submit ``spec`` (a ``TrainJobSpec``) as a Ray job running ``python -m rayfleet.jobs.train``.

    The spec's ``runtime_env`` goes to Ray's job API (a local ``working_dir`` is made absolute,
    checked and uploaded by Ray); the submission id doubles as the run key that names the run's
    checkpoints, so ``rayfleet job resume`` can restore them.
    """
    from ray.job_submission import JobSubmissionClient

    from rayfleet.jobs.runtime_env import absolute_working_dir, ray_runtime_env

    if spec.runtime_env is not None:
        spec = spec.model_copy(update={"runtime_env": absolute_working_dir(spec.runtime_env)})
    runtime_env = ray_runtime_env(spec.runtime_env)  # SpecError before anything is submitted
    client = JobSubmissionClient(dashboard_url)
    submission_id = new_submission_id(spec.name)
    entrypoint = training_entrypoint(encode_spec(spec.to_dict()), max_failures=max_failures,
                                     storage_path=storage_path, run_key=submission_id)
    job_id = client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env,
                               metadata=train_metadata(spec))
    return TrainingRun(job_id=job_id, dashboard_url=dashboard_url, name=spec.name, total_steps=spec.steps,
                       _client=client)
