"""Job-handle helpers: metrics lines, table, progress, spec transport, overrides (no Ray)."""

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.training_run import (MetricsTable, decode_spec, encode_spec, format_metrics_line,
                                  parse_metrics_lines, render_progress, summarize)
from rayfleet.jobs.train import apply_overrides


def test_metrics_lines_round_trip_through_ray_log_prefixes():
    log = "\n".join([
        "some startup noise",
        "(RayTrainWorker pid=123) " + format_metrics_line({"step": 1, "loss": 5.0, "tokens_per_s": 10.0}),
        "(RayTrainWorker pid=123) " + format_metrics_line({"step": 2, "loss": 4.0, "tokens_per_s": 12.0}),
        "RAYFLEET_METRICS {broken json",
    ])
    rows = parse_metrics_lines(log)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["loss"] == 4.0


def test_restarted_steps_keep_the_newest_row():
    log = "\n".join(format_metrics_line({"step": s, "loss": l}) for s, l in [(1, 5.0), (2, 4.0), (2, 3.9), (3, 3.5)])
    assert [r["loss"] for r in parse_metrics_lines(log)] == [5.0, 3.9, 3.5]


def test_metrics_table_columns_and_errors():
    table = MetricsTable(({"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}))
    assert table["loss"] == [2.0, 1.5] and table.last()["step"] == 2 and len(table) == 2
    with pytest.raises(KeyError, match="columns"):
        table["nope"]
    assert "MetricsTable(2 rows)" in repr(table)
    assert summarize(table.rows)["final_loss"] == 1.5


def test_progress_line_shows_step_loss_and_eta():
    import time

    line = render_progress({"step": 5, "loss": 3.25, "tokens_per_s": 1234.0}, total_steps=10,
                           started_s=time.monotonic() - 10)
    assert "step 5/10" in line and "loss 3.2500" in line and "1,234 tok/s" in line and "ETA 0:1" in line


def test_spec_transport_is_lossless():
    spec = {"name": "x", "plan": {"dp": 2}, "text": "quotes ' \" and spaces"}
    assert decode_spec(encode_spec(spec)) == spec


def test_overrides_parse_yaml_values_and_reject_bad_items():
    out = apply_overrides({"steps": 1, "plan": {"dp": 2}}, ["steps=20", "plan.ep=2", "data.uri=/x"])
    assert out == {"steps": 20, "plan": {"dp": 2, "ep": 2}, "data": {"uri": "/x"}}
    with pytest.raises(SpecError, match="--set"):
        apply_overrides({}, ["no-equals-sign"])


def test_run_plot_draws_loss_and_throughput_from_the_job_log(tmp_path) -> None:
    from rayfleet.jobs.training_run import TrainingRun, format_metrics_line

    class _JobLogs:  # what Ray's JobSubmissionClient answers for get_job_logs
        def get_job_logs(self, job_id: str) -> str:
            return "\n".join(["starting"] + [format_metrics_line({"step": s, "rank": 0, "loss": 4.0 / s,
                                                                  "tokens_per_s": 100.0 * s}) for s in range(1, 6)])

    run = TrainingRun(job_id="j", dashboard_url="http://127.0.0.1:1", _client=_JobLogs())
    fig = run.plot(str(tmp_path / "run.png"))
    loss_ax, speed_ax = fig.axes
    assert list(loss_ax.lines[0].get_xdata()) == [1, 2, 3, 4, 5]
    assert list(speed_ax.lines[0].get_ydata()) == [100.0, 200.0, 300.0, 400.0, 500.0]
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
