"""The shells' skeleton (take -> apply -> report) against the real in-process autoscaler service."""

from __future__ import annotations

import threading
import time

from rayfleet.platform.autoscaler.service import SharedAutoscaler
from rayfleet.platform.autoscaler.shell import AutoscalerShellBase, LocalChannel
from rayfleet.platform.autoscaler.types import GrowTraining, ScaleServe, ServeObservation


class CountingShell(AutoscalerShellBase):
    """A Serve-like shell whose replicas are a counter."""

    observation_type = ServeObservation

    def __init__(self, channel, *, fail_first: int = 0) -> None:
        super().__init__(channel, inbox="chat", subject="serve:chat", interval_s=0.01, log=self.lines_append,
                         thread_name="test-shell")
        self.replicas, self.applied, self.lines, self.fail_first = 1, [], [], fail_first
        self.ticked = threading.Event()

    def lines_append(self, line: str) -> None:
        self.lines.append(line)

    def observe(self) -> ServeObservation:
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("controller restarting")
        self.ticked.set()
        return ServeObservation("chat", "H100", 1, running_replicas=self.replicas, desired_replicas=self.replicas)

    def apply(self, decision, decided_at_s: float) -> None:
        match decision:
            case ScaleServe(target_replicas=target):
                self.replicas = target
                self.applied.append((decision, decided_at_s))
                self.event("scaled", decision.reason, {"replicas": target})


def service() -> SharedAutoscaler:
    return SharedAutoscaler(free_accelerators=lambda: ({}, {}), request_nodes=lambda d: None,
                            record=lambda *e: None)


def test_a_tick_applies_its_decisions_before_reporting_the_result():
    autoscaler, events = service(), []
    shell = CountingShell(LocalChannel(autoscaler, record=lambda *e: events.append(e)))
    before = time.time()
    autoscaler.carry_out(ScaleServe("chat", 3, ("n1", "n2"), (), "TTFT at risk"))
    autoscaler.carry_out(GrowTraining("job", 4, ("n3",), "not for this shell"))  # another inbox
    shell.tick()
    assert shell.replicas == 3 and autoscaler.serve["chat"].running_replicas == 3  # the report saw the decision
    (decision, decided_at), = shell.applied
    assert isinstance(decision, ScaleServe) and before <= decided_at <= time.time()
    assert events == [("serve:chat", "scaled", "TTFT at risk", {"replicas": 3})]
    assert autoscaler.take("chat") == [] and len(autoscaler.take("job")) == 1


def test_the_loop_survives_a_failing_tick_and_close_forgets_the_report():
    autoscaler = service()
    shell = CountingShell(LocalChannel(autoscaler), fail_first=2).start()
    assert shell.ticked.wait(10), shell.lines
    assert sum("controller restarting" in line for line in shell.lines) == 2
    shell.close()
    assert shell.stopped and "chat" not in autoscaler.serve
