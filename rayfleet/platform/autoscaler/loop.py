"""The controller-side loop around the shared autoscaler's pure policy.

``AutoscalerLoop.step(now)`` gathers an observation, calls the policy, hands each decision to
``act`` and records it with its reason through ``record(subject, kind, reason, detail)``. Every
side effect is passed in: the fleet controller gives it functions that read Ray state and fill
the shells' inboxes; tests and notebooks pass plain functions. A failing ``act`` is recorded, not
raised, so one bad actuator does not stop the loop (the policy sees the unchanged fleet next step).
"""

from __future__ import annotations

from typing import Callable

from rayfleet.platform.autoscaler.policy import AutoscalerPolicy
from rayfleet.platform.autoscaler.types import (
    AutoscalerState, Decision, FleetObservation, decision_detail, decision_subject,
)

__all__ = ["AutoscalerLoop"]


class AutoscalerLoop:
    """One control-loop step around the policy, with every side effect passed in."""

    def __init__(self, policy: AutoscalerPolicy, *, gather: Callable[[float], FleetObservation],
                 act: Callable[[Decision], None], record: Callable[[str, str, str, dict], None],
                 state: AutoscalerState | None = None) -> None:
        self.policy, self.gather, self.act, self.record = policy, gather, act, record
        self.state = state or AutoscalerState()

    def step(self, now: float) -> tuple[Decision, ...]:
        observation = self.gather(now)
        result = self.policy.decide(self.state, observation)
        self.state = result.state
        for decision in result.decisions:
            subject, kind = decision_subject(decision), "autoscaler_" + type(decision).__name__
            try:
                self.act(decision)
            except Exception as exc:  # noqa: BLE001 - recorded with the decision, loop goes on
                self.record(subject, kind + "_failed", f"{decision.reason}; carrying it out failed: {exc!r}",
                            decision_detail(decision))
                continue
            self.record(subject, kind, decision.reason, decision_detail(decision))
        return result.decisions
