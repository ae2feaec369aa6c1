"""Pydantic's ``ValidationError`` -> one :class:`rayfleet.errors.SpecError` naming field, value and fix.

Split out of :mod:`rayfleet.jobs.spec` (the spec's sections and their checks stay there): the
translation knows nothing of training, only of pydantic's error records and a spec's sections.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from rayfleet.errors import SpecError

__all__ = ["to_spec_error", "split_spec_error"]


def split_spec_error(err: SpecError) -> tuple[str, str]:
    """(why, fix) of a SpecError, recovered from its fixed message shape ``f=v: why. Fix: fix``."""
    body = str(err).split(": ", 1)[-1]
    why, _, fix = body.partition(". Fix: ")
    return why, fix


def _section_class(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last key of ``loc`` (to list its fields)."""
    cls: type[BaseModel] | None = root
    for key in loc[:-1]:
        if cls is None or not isinstance(key, str) or key not in cls.model_fields:
            return None
        cls = _model_in(cls.model_fields[key].annotation)
    return cls


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def to_spec_error(err: ValidationError, data: Any, *, root: type[BaseModel]) -> SpecError:
    """The one ``SpecError`` a pydantic failure of ``root`` (a spec class) surfaces as."""
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, SpecError):
        return cause
    loc = tuple(first["loc"])
    field = ".".join(str(p) for p in loc) or "job"
    kind = first["type"]
    if kind == "extra_forbidden":
        owner = _section_class(root, loc)
        allowed = sorted(owner.model_fields) if owner is not None else []
        return SpecError(field, first.get("input"), "is not a field of this section",
                         f"remove it (allowed here: {', '.join(allowed)})")
    if kind == "missing":
        return SpecError(field, None, "is required", f"add `{loc[-1]}:` (see examples/jobs/*.yaml)")
    message = first["msg"]
    if isinstance(cause, Exception):
        message = str(cause)
    return SpecError(field, first.get("input"), message, "see examples/jobs/*.yaml for valid values")
