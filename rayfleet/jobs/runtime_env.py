"""``runtime_env:`` of a training job: what travels with it to the cluster's head.

    runtime_env:
      working_dir: .            # uploaded by Ray's job API; the driver runs inside it
      excludes: [".venv", "*.ckpt"]
      env_vars: {HF_HOME: /mnt/hf}

Design decisions:
- A pass-through to Ray's job ``runtime_env`` (``JobSubmissionClient.submit_job`` uploads a local
  ``working_dir`` itself and hands the head a ``gcs://`` package); rayfleet adds no transport of
  its own. Only the keys a training job needs are accepted, each checked here, so a typo is a
  ``SpecError`` naming the field rather than a runtime-env failure on the head minutes later.
- Two kinds of checks. The form (a URI's scheme, a zip for remote URIs, env var names) is checked
  when the spec is built, wherever that is. Whether a local ``working_dir`` exists is checked only
  where the job is submitted (:func:`ray_runtime_env`): the driver on the head re-validates the same
  spec, and the client's path does not exist there (Ray already uploaded it).
- A relative ``working_dir`` is relative to the directory the job is submitted from, as in
  ``ray job submit --working-dir .``; :func:`absolute_working_dir` pins it to an absolute path at
  submission so that ``rayfleet job resume`` uploads the same directory from any directory.
- Token authentication stays on: ``RAY_AUTH_MODE`` cannot be set here.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayfleet.errors import SpecError

__all__ = ["RuntimeEnvSection", "ray_runtime_env", "absolute_working_dir", "BASE_ENV_VARS"]

# Every training job gets these; the user's env_vars are added beside them.
BASE_ENV_VARS: dict[str, str] = {"RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
_REMOTE_SCHEMES = ("s3", "gs", "gcs", "https", "http", "az", "abfss")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _is_uri(value: str) -> bool:
    return "://" in value


class RuntimeEnvSection(BaseModel):
    """Ray job ``runtime_env`` keys a training job may set (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    working_dir: str | None = None
    excludes: tuple[str, ...] = ()
    env_vars: dict[str, str] = Field(default_factory=dict)

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise SpecError("runtime_env.working_dir", v, "is empty",
                            "give a local directory (e.g. `.`) or a zip URI (s3://bucket/code.zip)")
        if _is_uri(v):
            scheme = v.split("://", 1)[0].lower()
            if scheme not in _REMOTE_SCHEMES:
                raise SpecError("runtime_env.working_dir", v, f"scheme {scheme!r} is not one Ray's runtime_env fetches",
                                f"use a local directory or a zip URI with one of {list(_REMOTE_SCHEMES)}")
            if not v.lower().endswith(".zip"):
                raise SpecError("runtime_env.working_dir", v, "a remote working_dir must be a .zip archive",
                                "zip the directory and point at the archive, or give a local directory")
        return v

    @field_validator("env_vars")
    @classmethod
    def _env_vars(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise SpecError(f"runtime_env.env_vars.{name}", v[name], "is not a valid environment variable name",
                                "use letters, digits and underscores, not starting with a digit")
            if name == "RAY_AUTH_MODE":
                raise SpecError("runtime_env.env_vars.RAY_AUTH_MODE", v[name],
                                "rayfleet jobs keep Ray's token authentication on", "remove RAY_AUTH_MODE")
        return v


def absolute_working_dir(section: RuntimeEnvSection | None, *, cwd: str | None = None) -> RuntimeEnvSection | None:
    """``section`` with a local ``working_dir`` made absolute against ``cwd`` (default: the
    current directory); URIs and absent sections are returned as they are."""
    if section is None or section.working_dir is None or _is_uri(section.working_dir):
        return section
    path = os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(section.working_dir)))
    return section.model_copy(update={"working_dir": path})


def ray_runtime_env(section: RuntimeEnvSection | None) -> dict[str, Any]:
    """The ``runtime_env`` mapping for ``JobSubmissionClient.submit_job`` (client side).

    Raises:
        SpecError: a local ``working_dir`` that is not a directory on this machine.
    """
    env: dict[str, Any] = {"env_vars": dict(BASE_ENV_VARS)}
    if section is None:
        return env
    env["env_vars"].update(section.env_vars)
    if section.working_dir is not None:
        if not _is_uri(section.working_dir) and not os.path.isdir(section.working_dir):
            raise SpecError("runtime_env.working_dir", section.working_dir,
                            "is not a directory on the machine submitting the job",
                            "give an existing directory (relative paths are taken from the current directory) "
                            "or a zip URI the cluster can fetch")
        env["working_dir"] = section.working_dir
    if section.excludes:
        env["excludes"] = list(section.excludes)
    return env
