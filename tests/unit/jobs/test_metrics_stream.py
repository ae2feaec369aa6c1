"""The step's reporting path never waits: the background stream, the report pacer, the run plot."""

from __future__ import annotations

import threading
import time

import pytest

from rayfleet.jobs.loop import PolledFlag
from rayfleet.jobs.train_metrics import MetricsWriter, ReportPacer, StepStream, plot_metrics, read_metrics, write_run_plot


def test_put_does_not_wait_for_a_slow_sink_and_close_delivers_everything() -> None:
    got: list[int] = []

    def slow_sink(row: dict) -> None:  # a driver queue or a Parquet flush on a busy machine
        time.sleep(0.05)
        got.append(row["step"])

    stream = StepStream([slow_sink])
    started = time.perf_counter()
    for step in range(1, 21):
        stream.put({"step": step})
    put_s = time.perf_counter() - started
    assert put_s < 0.05, put_s  # 20 rows x 50 ms of sink time stayed off the caller's path
    assert stream.close(timeout_s=10)
    assert got == list(range(1, 21))


def test_a_failing_sink_is_counted_and_the_others_still_get_every_row() -> None:
    seen: list[int] = []

    def broken(row: dict) -> None:
        raise RuntimeError("prometheus agent gone")

    stream = StepStream([broken, lambda row: seen.append(row["step"])])
    for step in range(3):
        stream.put({"step": step})
    assert stream.close()
    assert seen == [0, 1, 2] and stream.sink_errors == 3


@pytest.mark.parametrize("interval_s,steps,expected", [
    (4.0, [0.2] * 60, [20, 40, 60]),   # a 0.2 s step reports every 20 steps, not every step
    (4.0, [3.0, 3.0, 3.0, 3.0], [2, 4]),
    (0.0, [0.2] * 3, [1, 2, 3]),        # 0: every step (the paced behaviour, kept for comparison)
])
def test_report_pacer_lets_a_report_through_once_per_interval(interval_s, steps, expected) -> None:
    pacer = ReportPacer(interval_s)
    assert [i + 1 for i, s in enumerate(steps) if pacer.due(s)] == expected


def test_report_pacer_refuses_a_negative_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ReportPacer(-1)


def test_polled_flag_reads_without_blocking_and_turns_true_after_the_poll() -> None:
    asked = threading.Event()

    def slow_stop_signal() -> bool:  # a remote actor call
        time.sleep(0.2)
        asked.set()
        return True

    flag = PolledFlag(slow_stop_signal, period_s=0.01)
    started = time.perf_counter()
    assert flag() is False and time.perf_counter() - started < 0.01
    assert asked.wait(5)
    deadline = time.monotonic() + 5
    while not flag() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flag() is True
    flag.close()


def test_run_plot_is_a_png_beside_the_metrics(tmp_path) -> None:
    writer = MetricsWriter(str(tmp_path / "metrics"), flush_every=3)
    for step in range(1, 8):
        writer.write({"step": step, "rank": 0, "loss": 5.0 / step, "tokens_per_s": 1000.0 + step})
    writer.close()
    path = write_run_plot(str(tmp_path))
    assert path == str(tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot_metrics(read_metrics(str(tmp_path / "metrics")))
    loss_ax, speed_ax = fig.axes
    assert list(loss_ax.lines[0].get_xdata()) == list(range(1, 8))
    assert list(speed_ax.lines[0].get_ydata()) == [1000.0 + s for s in range(1, 8)]
    assert write_run_plot(str(tmp_path / "empty-run")) is None


def test_polled_flag_long_polls_back_to_back_and_backs_off_a_failing_poll() -> None:
    calls: list[float] = []

    def gone() -> bool:  # the signal's actor died with its formation
        calls.append(time.monotonic())
        raise RuntimeError("actor died")

    flag = PolledFlag(gone, period_s=0.0)
    time.sleep(0.5)
    flag.close()
    assert 1 <= len(calls) <= 2 and flag() is False  # not a hot loop of failing calls


def test_formation_control_answers_a_waiting_rank_when_raised_and_not_before() -> None:
    import asyncio

    from rayfleet.jobs.formation_control import FormationControl

    async def scenario() -> tuple[bool, bool, float, bool]:
        signal = FormationControl()
        quiet = await signal.wait_stop(0.05)
        waiting = asyncio.ensure_future(signal.wait_stop(30.0))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        signal.set("grow to 2 workers")
        raised = await waiting
        return quiet, raised, time.monotonic() - started, signal.should_stop()

    quiet, raised, seconds, should_stop = asyncio.run(scenario())
    assert quiet is False and raised is True and should_stop is True and seconds < 1.0


def test_formation_control_hands_the_driver_every_waiting_row_in_order_as_soon_as_one_arrives() -> None:
    import asyncio
    import threading

    from rayfleet.jobs.formation_control import FormationControl

    async def scenario() -> tuple[list, list, float, list, list]:
        control = FormationControl()
        empty = await control.take(0.05)
        waiting = asyncio.ensure_future(control.take(30.0))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        # rank 0's puts come from another thread (the actor's method runs off this loop)
        threading.Thread(target=lambda: [control.put({"step": s}) for s in (1, 2, 3)]).start()
        first = await waiting
        seconds = time.monotonic() - started
        await asyncio.sleep(0.05)
        rest = await control.take(0.05)
        after = await control.take(0.05)
        return empty, first, seconds, rest, after

    empty, first, seconds, rest, after = asyncio.run(scenario())
    assert empty == [] and after == [] and seconds < 1.0
    assert [r["step"] for r in first + rest] == [1, 2, 3]  # none lost, none twice, in order
