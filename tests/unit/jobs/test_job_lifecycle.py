"""The job lifecycle's pure parts, without a cluster: records read from Ray's own ``JobDetails``,
the list table and JSON shape, which jobs ``resume`` accepts (and the errors it gives), the
run key that pins a run's checkpoints, and the training spec's ``runtime_env``."""

from __future__ import annotations

import json
import shlex

import pytest
from ray.dashboard.modules.job.pydantic_models import JobDetails, JobType

from rayfleet.errors import SpecError
from rayfleet.jobs.log_stream import complete_lines
from rayfleet.jobs.lifecycle import JobStateError, record_of, render_job, render_jobs, resume_request, with_admissions
from rayfleet.jobs.runtime_env import BASE_ENV_VARS, RuntimeEnvSection, absolute_working_dir, ray_runtime_env
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train import pin_checkpoint_uri
from rayfleet.jobs.training_run import encode_spec, parse_metrics_lines, train_metadata, training_entrypoint

SPEC = {"name": "tiny-life", "model": {"preset": "tiny"}, "data": {"uri": "/data/tokens", "seq_len": 64},
        "steps": 8, "global_batch_size": 4, "checkpoint": {"every_n_steps": 2, "persist_every": 1}}
JSON_KEYS = {"id", "status", "kind", "name", "queue", "entrypoint", "message", "start_time_s", "end_time_s",
             "resumed_from", "ray_job_id", "queue_state", "queue_reason", "queue_position"}


def _details(*, status: str = "STOPPED", spec: dict | None = None, run_key: str | None = "rayfleet-train-x",
             metadata: dict | None = None) -> JobDetails:
    spec_obj = TrainJobSpec.model_validate(spec or SPEC)
    if metadata is None:
        metadata = train_metadata(spec_obj)
    return JobDetails(type=JobType.SUBMISSION, submission_id="rayfleet-train-x", job_id="02000000",
                      status=status, entrypoint=training_entrypoint(encode_spec(spec_obj.to_dict()), run_key=run_key),
                      message="Job was intentionally stopped.", start_time=1_700_000_000_000,
                      end_time=1_700_000_090_000, metadata=metadata)


def test_record_reads_rayfleet_metadata_and_converts_milliseconds():
    record = record_of(_details())
    assert (record.id, record.status, record.kind, record.name, record.queue) == (
        "rayfleet-train-x", "STOPPED", "train", "tiny-life", "default")
    assert record.duration_s() == 90.0 and record.ray_job_id == "02000000"
    assert set(json.loads(json.dumps(record.to_json()))) == JSON_KEYS
    assert "status: STOPPED" in render_job(record) and "resumed_from" not in render_job(record)


def test_a_job_rayfleet_did_not_submit_is_kind_ray():
    record = record_of(JobDetails(type=JobType.SUBMISSION, submission_id="raysubmit_1", status="RUNNING",
                                  entrypoint="python x.py", start_time=1_700_000_000_000))
    assert (record.kind, record.name, record.queue, record.end_time_s) == ("ray", "", None, None)


def test_job_table_lists_every_record():
    table = render_jobs([record_of(_details()), record_of(_details(status="RUNNING"))])
    lines = table.splitlines()
    assert lines[0].split() == ["job", "kind", "name", "queue", "status", "started", "duration"]
    assert len(lines) == 4 and "STOPPED" in lines[2] and "0:01:30" in lines[2]
    assert render_jobs([]) == "no jobs"


def test_a_job_waiting_in_its_queue_lists_as_queued_with_reason_and_place():
    waiting = {"request": {"job_id": "rayfleet-train-x"}, "state": "QUEUED", "reason": "waiting: 0 idle",
               "position": 2}
    running, ended = record_of(_details(status="RUNNING")), record_of(_details())
    [merged] = with_admissions([running], [waiting])
    assert (merged.status, merged.queue_state, merged.queue_reason, merged.queue_position) == (
        "QUEUED", "QUEUED", "waiting: 0 idle", 2)
    assert with_admissions([ended], [waiting]) == [ended]  # Ray's end wins over a stale record
    table = render_jobs([merged])
    assert "QUEUED (place 2)" in table and "waiting: 0 idle" in table and table.splitlines()[0].endswith("queue reason")
    admitted = with_admissions([running], [{**waiting, "state": "ADMITTED"}])[0]
    assert (admitted.status, admitted.queue_position) == ("RUNNING", None)


def test_resume_keeps_the_entrypoint_and_records_where_it_came_from():
    details = _details()
    request = resume_request(record_of(details), metadata=dict(details.metadata))
    assert request.entrypoint == details.entrypoint  # same spec, same --run-key: same checkpoints
    assert request.metadata["rayfleet.resumed_from"] == "rayfleet-train-x"
    assert request.metadata["rayfleet.kind"] == "train" and request.spec.name == "tiny-life"


@pytest.mark.parametrize("details, words", [
    (_details(status="RUNNING"), ["RUNNING", "rayfleet job stop rayfleet-train-x"]),
    (_details(status="SUCCEEDED"), ["SUCCEEDED", "rayfleet train"]),
    (_details(metadata={}), ["not a rayfleet training job"]),
    (_details(spec={k: v for k, v in SPEC.items() if k != "checkpoint"}), ["no checkpoint section", "step 0"]),
    (_details(run_key=None), ["no checkpoint location", "--run-key"]),
])
def test_resume_refuses_with_the_reason_and_the_fix(details, words):
    with pytest.raises(JobStateError) as err:
        resume_request(record_of(details), metadata=dict(details.metadata or {}))
    for word in words:
        assert word in str(err.value)
    assert "Fix:" in str(err.value)


def test_resume_accepts_a_pinned_checkpoint_uri_without_run_key():
    details = _details(spec={**SPEC, "checkpoint": {"uri": "s3://b/ckpt"}}, run_key=None)
    assert resume_request(record_of(details), metadata=dict(details.metadata)).spec.checkpoint.uri == "s3://b/ckpt"


def test_run_key_pins_the_checkpoints_of_every_submission_of_a_run(tmp_path):
    spec = TrainJobSpec.model_validate(SPEC)
    pinned = pin_checkpoint_uri(spec, run_key="rayfleet-train-x", storage_path=str(tmp_path))
    assert pinned.checkpoint.uri == str(tmp_path / "rayfleet-train-x" / "checkpoints")
    assert pinned.checkpoint.every_n_steps == 2  # the rest of the section is kept
    assert pin_checkpoint_uri(spec, run_key=None, storage_path=str(tmp_path)) is spec
    explicit = TrainJobSpec.model_validate({**SPEC, "checkpoint": {"uri": "s3://b/c"}})
    assert pin_checkpoint_uri(explicit, run_key="k", storage_path=str(tmp_path)).checkpoint.uri == "s3://b/c"
    with pytest.raises(SpecError, match="--run-key"):
        pin_checkpoint_uri(spec, run_key="../escape", storage_path=str(tmp_path))


def test_entrypoint_carries_the_run_key_quoted():
    argv = shlex.split(training_entrypoint("c3BlYw==", run_key="rayfleet-train-a-1"))
    assert argv[argv.index("--run-key") + 1] == "rayfleet-train-a-1"
    assert "--run-key" not in training_entrypoint("c3BlYw==")


def test_runtime_env_passes_through_to_rays_job_api(tmp_path):
    section = RuntimeEnvSection(working_dir=str(tmp_path), excludes=("*.ckpt",), env_vars={"HF_HOME": "/hf"})
    env = ray_runtime_env(section)
    assert env == {"working_dir": str(tmp_path), "excludes": ["*.ckpt"],
                   "env_vars": {**BASE_ENV_VARS, "HF_HOME": "/hf"}}
    assert ray_runtime_env(None) == {"env_vars": BASE_ENV_VARS}
    assert ray_runtime_env(RuntimeEnvSection(working_dir="s3://b/code.zip"))["working_dir"] == "s3://b/code.zip"


def test_a_missing_working_dir_is_refused_where_the_job_is_submitted(tmp_path):
    spec = TrainJobSpec.model_validate({**SPEC, "runtime_env": {"working_dir": str(tmp_path / "gone")}})
    with pytest.raises(SpecError) as err:  # the spec itself is valid: the head re-validates it
        ray_runtime_env(spec.runtime_env)
    assert err.value.field == "runtime_env.working_dir" and "gone" in str(err.value) and "Fix:" in str(err.value)


def test_relative_working_dir_is_pinned_to_the_submitting_directory(tmp_path):
    section = absolute_working_dir(RuntimeEnvSection(working_dir="code"), cwd=str(tmp_path))
    assert section.working_dir == str(tmp_path / "code")
    assert absolute_working_dir(RuntimeEnvSection(working_dir="gs://b/c.zip")).working_dir == "gs://b/c.zip"


@pytest.mark.parametrize("runtime_env, field", [
    ({"working_dir": "ftp://host/code.zip"}, "runtime_env.working_dir"),
    ({"working_dir": "s3://bucket/code"}, "runtime_env.working_dir"),
    ({"working_dir": " "}, "runtime_env.working_dir"),
    ({"env_vars": {"RAY_AUTH_MODE": "disabled"}}, "runtime_env.env_vars.RAY_AUTH_MODE"),
    ({"env_vars": {"9LIVES": "x"}}, "runtime_env.env_vars.9LIVES"),
    ({"pip": ["torch"]}, "runtime_env.pip"),
])
def test_runtime_env_mistakes_name_the_field(runtime_env, field):
    with pytest.raises(SpecError) as err:
        TrainJobSpec.model_validate({**SPEC, "runtime_env": runtime_env})
    assert err.value.field == field and "Fix:" in str(err.value)


def test_complete_lines_rejoins_lines_cut_between_chunks():
    chunks = ["RAYFLEET_METRICS {\"st", "ep\": 1}\nplain line\nRAYFLEET_", "METRICS {\"step\": 2}\n", "tail"]
    lines = list(complete_lines(iter(chunks)))
    assert lines == ['RAYFLEET_METRICS {"step": 1}', "plain line", 'RAYFLEET_METRICS {"step": 2}', "tail"]
    assert [r["step"] for r in parse_metrics_lines("\n".join(lines))] == [1, 2]
    assert [r["step"] for r in parse_metrics_lines(chunks[0])] == []  # a cut line alone parses to nothing
