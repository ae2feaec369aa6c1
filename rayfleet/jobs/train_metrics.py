"""Per-step training metrics: what they mean, how MFU is estimated, where they are written.

Design decisions:
- One flat dict per step and rank (keys in :data:`METRIC_KEYS`); the same dict goes to Ray
  Train's ``report``, to Parquet, and to Ray metrics, so the three never disagree.
- MFU = ``6 x active parameters x tokens/s / (world_size x peak)``: the standard
  "model FLOPs" estimate (forward + backward of every active weight; attention's ``s^2`` term
  left out, as PaLM's appendix does for short sequences). ``peak`` is the catalogue's dense
  peak of the job's accelerator type for the precision: FP8 recipes use the FP8 peak, bf16
  and fp32 the BF16 peak (the catalogue has no FP32 figure; fp32 runs only for tests). On the
  CPU fleet the accelerator is fake, so MFU is tiny: it is an estimate against the hardware the
  job claims, and meaningful where that hardware is real.
- Expert load per MoE layer is reported as max and mean tokens per expert (summed over
  data-distinct ranks); ``max / mean`` is 1.0 for a perfectly balanced layer.
- Parquet: each flush writes a new part file (Parquet has no append) named by rank and a
  sequence number, under a directory the launcher picks (``{run storage}/metrics``); columns
  have a fixed schema so parts concatenate. Readers use :func:`read_metrics`.
- Ray metrics are imported lazily inside :class:`RayMetricsExporter` so this module (and the
  train loop) import without Ray.
- Nothing on the step's path waits for a sink. :class:`StepStream` hands each row to one
  background thread that feeds the driver's queue, Parquet and the gauges; the step only
  appends to an in-process queue (microseconds). ``ray.train.report`` is the one sink that must
  stay on the training thread (every rank calls it the same number of times: it holds a
  cross-rank barrier) and it blocks while Ray Train's one-slot result queue is full, i.e. until
  the controller's next poll (2 s by default): :class:`ReportPacer` lets it through only once
  ``interval_s`` of step time has passed, counted from the all-gathered slowest-rank step time,
  so every rank takes the same decision at the same step.
"""

from __future__ import annotations

import logging
import posixpath
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rayfleet.models.config import MoEConfig
from rayfleet.platform.catalogue import get_accelerator

__all__ = ["METRIC_KEYS", "EVAL_METRIC_KEYS", "METRICS_SCHEMA", "model_flops_per_token", "mfu", "expert_load_stats", "MetricsWriter",
           "read_metrics", "RayMetricsExporter", "export_ray_metrics", "StepStream", "ReportPacer", "plot_metrics",
           "write_run_plot"]

_log = logging.getLogger(__name__)

# key -> meaning (units). Every rank reports all of them every step.
METRIC_KEYS: dict[str, str] = {
    "step": "1-based count of optimizer steps completed",
    "rank": "this worker's global rank",
    "loss": "mean cross-entropy per target token over the whole global batch",
    "lr": "learning rate used by this step",
    "grad_norm": "global L2 norm of the gradients before clipping",
    "tokens": "target tokens in the global batch",
    "tokens_per_s": "global tokens / slowest rank's step time",
    "step_time_s": "this rank's wall time for the step (s)",
    "step_time_s_per_rank": "every rank's step time, index = rank (s)",
    "compute_time_s": "this rank's own compute in the step: its training thread's CPU time, which a "
                      "blocking collective wait does not add to (s)",
    "compute_time_s_per_rank": "every rank's compute_time_s, index = rank (s); what the slow-rank policy reads",
    "mfu": "model FLOPs utilisation against the catalogue peak (0..1)",
    "expert_load_max": "per MoE layer: most tokens routed to one expert this step",
    "expert_load_mean": "per MoE layer: mean tokens per expert this step",
    "a2a_hidden_fraction": "share of expert all-to-all time hidden behind compute (None: not measured)",
    "sample_ids_hash": "order-sensitive hash of the global batch's sample ids",
    "time_unix_s": "wall clock at the end of the step",
}

# key -> meaning: only in the rows of evaluation steps (a job with an ``eval`` section; see
# ``jobs.evaluation``), every rank, the same values on all. Parquet has their columns, null elsewhere.
EVAL_METRIC_KEYS: dict[str, str] = {
    "val_loss": "mean cross-entropy per target token over the validation samples (the same set every time)",
    "val_tokens": "target tokens the validation loss averages over",
    "eval_time_s": "wall time of the evaluation after this step (s), not part of step_time_s",
}

METRICS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("loss", pa.float64()), ("lr", pa.float64()),
    ("grad_norm", pa.float64()), ("tokens", pa.int64()), ("tokens_per_s", pa.float64()),
    ("step_time_s", pa.float64()), ("step_time_s_per_rank", pa.list_(pa.float64())),
    ("compute_time_s", pa.float64()), ("compute_time_s_per_rank", pa.list_(pa.float64())), ("mfu", pa.float64()),
    ("expert_load_max", pa.list_(pa.float64())), ("expert_load_mean", pa.list_(pa.float64())),
    ("a2a_hidden_fraction", pa.float64()), ("sample_ids_hash", pa.int64()), ("time_unix_s", pa.float64()),
    ("val_loss", pa.float64()), ("val_tokens", pa.int64()), ("eval_time_s", pa.float64()),
])


def model_flops_per_token(config: MoEConfig) -> float:
    """Training FLOPs per token: forward + backward of every active weight (6 x active params)."""
    return 6.0 * config.num_params().active


def mfu(tokens_per_s: float, *, flops_per_token: float, accelerators: Sequence[str], precision: str) -> float:
    """Model FLOPs utilisation of the ranks' accelerators (one catalogue type name per rank;
    mixed fleets sum each type's peak)."""
    kind = "fp8" if precision not in ("fp32", "bf16") else "bf16"
    peak = sum(get_accelerator(a).peak_tflops(kind) for a in accelerators) * 1e12
    return tokens_per_s * flops_per_token / peak


def expert_load_stats(tokens_per_expert: torch.Tensor) -> tuple[list[float], list[float]]:
    """(max, mean) tokens per expert of each MoE layer; ``tokens_per_expert`` is ``[layers, E]``."""
    if tokens_per_expert.numel() == 0:
        return [], []
    load = tokens_per_expert.detach().to("cpu", torch.float64)
    return load.max(dim=1).values.tolist(), load.mean(dim=1).tolist()


class MetricsWriter:
    """Buffers metric dicts and writes them as Parquet parts under ``uri`` (any fsspec URI).

    ``flush_every`` rows per part; :meth:`close` writes the rest. Keys outside
    :data:`METRICS_SCHEMA` are kept when their values are scalars (inferred type).
    """

    def __init__(self, uri: str, *, rank: int = 0, flush_every: int = 50) -> None:
        self.uri, self.rank, self.flush_every = uri.rstrip("/"), rank, max(1, flush_every)
        self._rows: list[dict[str, Any]] = []
        self._part = 0
        self._fs, self._root = fsspec.core.url_to_fs(self.uri)
        self._fs.makedirs(self._root, exist_ok=True)
        # continue numbering after parts left by an earlier attempt of this rank (restarts)
        existing = self._fs.glob(posixpath.join(self._root, f"metrics-r{rank:05d}-*.parquet"))
        self._part = len(existing)

    def write(self, metrics: Mapping[str, Any]) -> None:
        self._rows.append(dict(metrics))
        if len(self._rows) >= self.flush_every:
            self.flush()

    def flush(self) -> str | None:
        """Write buffered rows as one part; returns its path (None when nothing was buffered)."""
        if not self._rows:
            return None
        table = _to_table(self._rows)
        path = posixpath.join(self._root, f"metrics-r{self.rank:05d}-{self._part:05d}.parquet")
        with self._fs.open(path, "wb") as f:
            pq.write_table(table, f)
        self._part += 1
        self._rows = []
        return path

    def close(self) -> None:
        self.flush()


def _to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    for field in METRICS_SCHEMA:
        columns[field.name] = pa.array([row.get(field.name) for row in rows], type=field.type)
    extra = sorted({k for row in rows for k in row} - set(METRICS_SCHEMA.names))
    for key in extra:
        values = [row.get(key) for row in rows]
        if all(v is None or isinstance(v, (int, float, str, bool)) for v in values):
            columns[key] = pa.array(values)
    return pa.table(columns)


def read_metrics(uri: str) -> pa.Table:
    """All metric parts under ``uri`` as one table sorted by (step, rank); empty when none."""
    fs, root = fsspec.core.url_to_fs(uri)
    paths = sorted(fs.glob(posixpath.join(root.rstrip("/"), "metrics-r*-*.parquet")))
    if not paths:
        return METRICS_SCHEMA.empty_table()
    tables = []
    for path in paths:
        with fs.open(path, "rb") as f:
            tables.append(pq.read_table(f))
    table = pa.concat_tables(tables, promote_options="default")
    return table.sort_by([("step", "ascending"), ("rank", "ascending")])


class RayMetricsExporter:
    """Publishes step metrics as Ray (Prometheus) gauges tagged by job and rank.

    Scalars become gauges ``rayfleet_train_<key>``; per-layer expert loads become
    ``rayfleet_train_expert_load_imbalance`` tagged by layer (max / mean). Needs a running Ray
    worker or driver; Ray is imported on first use only.
    """

    SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "a2a_hidden_fraction", "step",
               "val_loss")

    def __init__(self, *, job: str, rank: int) -> None:
        self.tags = {"job": job, "rank": str(rank)}
        self._gauges: dict[str, Any] | None = None

    def _ensure(self) -> dict[str, Any]:
        if self._gauges is None:
            from ray.util.metrics import Gauge

            meaning = {**METRIC_KEYS, **EVAL_METRIC_KEYS}
            self._gauges = {k: Gauge(f"rayfleet_train_{k}", description=meaning[k], tag_keys=("job", "rank"))
                            for k in self.SCALARS}
            self._gauges["expert_load_imbalance"] = Gauge(
                "rayfleet_train_expert_load_imbalance", description="max / mean tokens per expert of an MoE layer",
                tag_keys=("job", "rank", "layer"))
        return self._gauges

    def export(self, metrics: Mapping[str, Any]) -> None:
        gauges = self._ensure()
        for key in self.SCALARS:
            value = metrics.get(key)
            if value is not None:
                gauges[key].set(float(value), tags=self.tags)
        for layer, (high, mean) in enumerate(zip(metrics.get("expert_load_max") or (),
                                                 metrics.get("expert_load_mean") or ())):
            if mean:
                gauges["expert_load_imbalance"].set(high / mean, tags={**self.tags, "layer": str(layer)})


_EXPORTERS: dict[tuple[str, int], RayMetricsExporter] = {}


def export_ray_metrics(metrics: Mapping[str, Any], *, job: str) -> None:
    """Export one step's metrics as Ray gauges (one exporter per job and rank, created lazily)."""
    key = (job, int(metrics.get("rank", 0)))
    if key not in _EXPORTERS:
        _EXPORTERS[key] = RayMetricsExporter(job=job, rank=key[1])
    _EXPORTERS[key].export(metrics)


class StepStream:
    """Feeds step rows to slow sinks from one background thread, so the step never waits on them.

    ``sinks`` are called in order for every row, on the stream's thread; a sink that raises is
    logged and skipped for that row (a lost Prometheus sample must not stop training).
    :meth:`put` never blocks; :meth:`close` waits up to ``timeout_s`` for the rows already put.
    """

    def __init__(self, sinks: Sequence[Callable[[dict[str, Any]], None]], *, name: str = "rayfleet-metrics") -> None:
        self._sinks = list(sinks)
        self._rows: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.rows_done = 0
        self.sink_errors = 0
        self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self._thread.start()

    def put(self, row: Mapping[str, Any]) -> None:
        self._rows.put(dict(row))

    def _drain(self) -> None:
        while (row := self._rows.get()) is not None:
            for sink in self._sinks:
                try:
                    sink(row)
                except Exception:  # noqa: BLE001 - keep streaming; the error is logged once per row
                    self.sink_errors += 1
                    _log.exception("metrics sink %r failed on step %s", sink, row.get("step"))
            self.rows_done += 1

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop after the rows put so far; True when they all reached the sinks in time."""
        self._rows.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class ReportPacer:
    """Says when a step may call a blocking, rate-limited report (Ray Train's) without waiting.

    ``due(step_s)`` adds one step's time and answers True once ``interval_s`` has accumulated
    (then starts counting again). Pass a value every rank holds identically (the all-gathered
    slowest step time): the answer is then the same on every rank, as a cross-rank report needs.
    ``interval_s = 0`` reports every step (the old, paced behaviour; for comparison).
    """

    def __init__(self, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._since = 0.0
        self.reports = 0

    def due(self, step_s: float) -> bool:
        self._since += max(0.0, step_s)
        if self._since < self.interval_s - 1e-9:  # float sums of step times fall just short
            return False
        self._since = 0.0
        self.reports += 1
        return True


def plot_metrics(rows: Sequence[Mapping[str, Any]] | pa.Table, path: str | None = None):
    """Loss (train, and validation where rows have ``val_loss``) and tokens/s against step (one
    figure, two panels); saved as PNG at ``path`` (any
    fsspec URI) when given. Returns the matplotlib ``Figure`` (a notebook shows it).

    ``rows``: metric rows (dicts) or a table from :func:`read_metrics`; rows of a step repeated
    after a restart keep the last one (the run's surviving history). matplotlib is imported
    here (a figure object, not pyplot, so it draws headless in a worker and shows in a notebook).
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry
    except ImportError as exc:
        from rayfleet.errors import RayfleetError

        raise RayfleetError(f"plotting needs matplotlib ({exc}); install it with `pip install matplotlib`") from exc
    records = rows.to_pylist() if isinstance(rows, pa.Table) else [dict(r) for r in rows]
    by_step = {int(r["step"]): r for r in records if r.get("step") is not None and r.get("rank", 0) == 0}
    steps = sorted(by_step)
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot(steps, [by_step[s]["loss"] for s in steps], color="tab:blue", label="train")
    val_steps = [s for s in steps if by_step[s].get("val_loss") is not None]
    if val_steps:  # a job with an eval section: validation beside training
        loss_ax.plot(val_steps, [by_step[s]["val_loss"] for s in val_steps], color="tab:orange", marker="o",
                     markersize=3, label="validation")
        loss_ax.legend()
    loss_ax.set_ylabel("loss (per target token)")
    loss_ax.grid(alpha=0.3)
    speed_ax.plot(steps, [by_step[s]["tokens_per_s"] for s in steps], color="tab:green")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)
    if path is not None:
        fs, target = fsspec.core.url_to_fs(path)
        with fs.open(target, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
    return fig


def write_run_plot(run_dir: str) -> str | None:
    """Draw ``{run_dir}/metrics`` into ``{run_dir}/metrics.png`` (beside the Parquet parts);
    returns the PNG's path, or None when the run has no metrics yet."""
    table = read_metrics(posixpath.join(run_dir.rstrip("/"), "metrics"))
    if table.num_rows == 0:
        return None
    path = posixpath.join(run_dir.rstrip("/"), "metrics.png")
    plot_metrics(table, path)
    return path
