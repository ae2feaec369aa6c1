"""Errors that rayfleet raises for user mistakes.

Every user-facing error names the offending value, says why it is wrong and which setting fixes
it. They subclass ``ValueError`` so that callers validating input can catch one type, and they
keep their constructor arguments in ``args`` so that they pickle across Ray processes.
"""

from __future__ import annotations

__all__ = [
    "RayfleetError",
    "SpecError",
    "UnknownAcceleratorError",
    "LabelError",
    "FleetNotFoundError",
    "FleetStateError",
]


class RayfleetError(ValueError):
    """Base class: a mistake the user can fix. ``str(err)`` is the whole message."""


class SpecError(RayfleetError):
    """A field of a spec has a bad value.

    Built from the field, the value and the fix so that every message has the same shape.
    """

    def __init__(self, field: str, value: object, why: str, fix: str) -> None:
        super().__init__(f"{field}={value!r}: {why}. Fix: {fix}")
        self.field = field
        self.value = value

    def __reduce__(self):  # keep the structured fields across pickling
        return (_rebuild_spec_error, (self.args[0], self.field, self.value, type(self)))


def _rebuild_spec_error(message: str, field: str, value: object, cls: type | None = None) -> "SpecError":
    err = (cls or SpecError).__new__(cls or SpecError)
    RayfleetError.__init__(err, message)
    err.field = field
    err.value = value
    return err


class UnknownAcceleratorError(RayfleetError):
    """An accelerator type that the catalogue does not know."""


class LabelError(RayfleetError):
    """A node label that is malformed or missing."""


class FleetNotFoundError(RayfleetError):
    """No rayfleet/Ray cluster is reachable where the user pointed."""


class FleetStateError(RayfleetError):
    """The request does not fit the fleet's current state (e.g. a fleet is already running)."""
