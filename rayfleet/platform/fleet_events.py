"""``record_fleet_event``: the one way code outside the controller records an event with it.

Training drivers, train workers (health decisions) and the autoscaler shells all record what
they did with the fleet controller, where ``rayfleet status`` and the SDK's ``events()`` show it.
Recording is best effort: a plain Ray cluster has no controller, and an event lost must never
fail the job or the deployment that tried to record it.

Subjects name what the event is about: ``job:<name>``, ``serve:<name>``, a node name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["record_fleet_event"]


def record_fleet_event(subject: str, kind: str, cause: str, detail: dict | None = None, *,
                       controller: Any = None) -> bool:
    """Record ``kind`` (with its ``cause`` and JSON-able ``detail``) about ``subject``; fire and forget.

    ``controller``: the controller actor's handle when the caller holds one, else it is looked up.
    Returns whether the event was sent (``False`` when there is no controller).
    """
    try:
        if controller is None:
            from rayfleet.platform.controller import get_controller

            controller = get_controller()
        controller.record_event.remote(subject, kind, cause, dict(detail or {}))
        return True
    except Exception:  # noqa: BLE001 - see module doc
        return False
