"""Regression (issue 15): ``storage_path`` went into the job's shell entrypoint unquoted, so a
path with spaces broke the job and one with ``;`` ran a command."""

from __future__ import annotations

import shlex

from rayfleet.jobs.training_run import training_entrypoint


def test_storage_path_with_shell_syntax_stays_one_argument():
    path = "/mnt/ckpt dir; touch /tmp/pwned $(id) `id`"
    argv = shlex.split(training_entrypoint("c3BlYw==", max_failures=2, storage_path=path))
    assert argv[:3] == ["python", "-m", "rayfleet.jobs.train"]
    assert argv[argv.index("--storage-path") + 1] == path
    assert argv[argv.index("--max-failures") + 1] == "2" and len(argv) == 9
