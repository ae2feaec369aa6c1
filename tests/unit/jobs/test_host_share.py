"""``resources.host_cpu_share``: a worker idles after each step to keep its CPU under that share."""

from __future__ import annotations

import time

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.host_share import MAX_IDLE_S, HostShareHook, idle_for
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import train_job


class _Clocks:
    """CPU and wall clocks the test moves by hand; ``sleep`` moves the wall clock only."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.slept: list[float] = []

    def step(self, cpu_s: float, wall_s: float) -> None:
        self.cpu += cpu_s
        self.wall += wall_s

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += seconds


def _hook(share: float, clocks: _Clocks) -> HostShareHook:
    hook = HostShareHook(share, cpu_clock=lambda: clocks.cpu, wall_clock=lambda: clocks.wall, sleep=clocks.sleep)
    hook.on_start(rank=0, world_size=1, plan=None, step=0, state_fn=None, load_fn=None)
    return hook


def test_a_worker_idles_until_its_cpu_is_its_share_of_the_wall_time() -> None:
    clocks = _Clocks()
    hook = _hook(0.25, clocks)
    for step in range(4):
        clocks.step(cpu_s=0.2, wall_s=0.25)  # a step: 0.2 s of CPU in 0.25 s
        hook.after_step(step, metrics={}, sample_ids=(), state_fn=None, load_fn=None)
    assert clocks.slept == pytest.approx([0.55] * 4)  # 0.2 / 0.25 = 0.8 s a step in all
    assert clocks.cpu / clocks.wall == pytest.approx(0.25)
    assert hook.idled_s == pytest.approx(2.2)


def test_a_worker_under_its_share_never_idles_and_an_idle_is_bounded() -> None:
    clocks = _Clocks()
    hook = _hook(0.5, clocks)
    clocks.step(cpu_s=0.1, wall_s=1.0)  # waited in a collective: already under half
    hook.after_step(0, metrics={}, sample_ids=(), state_fn=None, load_fn=None)
    assert clocks.slept == []
    assert idle_for(cpu_s=100.0, wall_s=1.0, share=0.1) == MAX_IDLE_S  # a stop is polled within 30 s
    with pytest.raises(ValueError, match="share=0"):
        idle_for(1.0, 1.0, 0.0)


def test_the_real_clocks_hold_the_share_of_a_busy_loop() -> None:
    """With the process's real clocks. On a loaded machine the loop may get less than a core; the
    hook must then idle less (what it reads is the process's CPU, not the loop's wall time)."""
    share = 0.2
    hook = HostShareHook(share)
    hook.on_start()
    start_cpu, start_wall = time.process_time(), time.monotonic()
    rates = []
    for step in range(3):
        c0, w0 = time.process_time(), time.monotonic()
        while time.process_time() < c0 + 0.05:
            pass
        rates.append((time.process_time() - c0) / (time.monotonic() - w0))
        hook.after_step(step)
    cpu, wall = time.process_time() - start_cpu, time.monotonic() - start_wall
    assert cpu / wall <= share * 1.15, (cpu, wall, rates)
    if max(rates) > 1.5 * share:  # a step ran well above the share: the hook idled after it
        assert hook.idled_s > 0.05, (hook.idled_s, rates)


def test_the_share_is_validated_at_the_edge_and_travels_in_the_loop_slice(job_dict) -> None:
    spec = TrainJobSpec.model_validate({**job_dict, "resources": {"host_cpu_share": 0.3}})
    assert train_job(spec).loop.host_cpu_share == 0.3
    assert train_job(TrainJobSpec.model_validate(job_dict)).loop.host_cpu_share is None
    for bad in (0, 1.5, -0.2):
        with pytest.raises(SpecError, match=r"resources\.host_cpu_share"):
            TrainJobSpec.model_validate({**job_dict, "resources": {"host_cpu_share": bad}})
