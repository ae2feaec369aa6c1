"""Intra-op threads of a CPU training worker (``worker_entry.cpu_threads_per_worker``)."""

import os

import pytest

from rayfleet.errors import SpecError
from rayfleet.jobs.worker_entry import THREADS_ENV, cpu_threads_per_worker


def test_workers_share_the_hosts_cores_equally_by_default():
    cores = os.cpu_count() or 1
    assert cpu_threads_per_worker(1, env={}) == cores
    assert cpu_threads_per_worker(cores, env={}) == 1
    assert cpu_threads_per_worker(4 * cores, env={}) == 1  # never 0 threads


def test_the_environment_leaves_cores_to_the_platform():
    assert cpu_threads_per_worker(1, env={THREADS_ENV: "1"}) == 1
    assert cpu_threads_per_worker(1, env={THREADS_ENV: "3"}) == 3


@pytest.mark.parametrize("raw", ["0", "-2", "two", ""])
def test_a_bad_thread_count_names_the_variable_the_value_and_the_fix(raw):
    with pytest.raises(SpecError) as err:
        cpu_threads_per_worker(1, env={THREADS_ENV: raw})
    message = str(err.value)
    assert THREADS_ENV in message and repr(raw) in message and "Fix:" in message
