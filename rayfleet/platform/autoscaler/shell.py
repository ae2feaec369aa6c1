"""The skeleton both autoscaler shells (a training job's, a Serve deployment's) stand on.

A shell is the thin side of the shared autoscaler that lives beside the work it scales. Every
``interval_s`` it does the same three things, in this order:

1. **take** the decisions waiting for it in the controller's inbox (typed: the policy's frozen
   decision objects with their decision time, see :class:`~rayfleet.platform.autoscaler.types.InboxEntry`);
2. **apply** each one (``apply(decision, decided_at_s)``; subclasses ``match`` on the type);
3. **report** its current observation (``observe()``), so the next policy step sees the result.

Design decisions:
- Take before report: a decision taken this tick is reflected in the report of the same tick
  (e.g. a training job reports itself as resizing), so the policy never acts twice on one need.
- The controller is reached through a ``ShellChannel``: ``RayChannel`` talks to the controller
  actor; ``LocalChannel`` calls an in-process :class:`~rayfleet.platform.autoscaler.service.SharedAutoscaler`
  directly (unit tests, notebooks without Ray) — the same service the controller runs.
- A failing tick is logged and the loop goes on: a hiccup of the controller must not kill the
  job or the deployment the shell belongs to.
- ``events`` is the one way a shell records what it did (handover times, errors): best effort,
  never raising.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable, Protocol

from rayfleet.platform.autoscaler.types import Decision, InboxEntry, ServeObservation, TrainingObservation

__all__ = ["ShellChannel", "RayChannel", "LocalChannel", "AutoscalerShellBase"]

Observation = ServeObservation | TrainingObservation


class ShellChannel(Protocol):
    """What a shell needs of the fleet controller."""

    def take(self, target: str) -> list[InboxEntry]: ...

    def report(self, observation: Observation) -> None: ...

    def forget(self, observation_type: type, name: str) -> None: ...

    def autoscaler_running(self) -> bool: ...

    def record_event(self, subject: str, kind: str, cause: str, detail: dict) -> None: ...


class RayChannel:
    """A ``ShellChannel`` over the controller actor's handle (reports and events fire and forget)."""

    def __init__(self, controller: Any, *, timeout_s: float = 60.0) -> None:
        self.controller, self.timeout_s = controller, timeout_s

    def take(self, target: str) -> list[InboxEntry]:
        import ray

        return ray.get(self.controller.take_decisions.remote(target), timeout=self.timeout_s)

    def report(self, observation: Observation) -> None:
        match observation:
            case ServeObservation():
                self.controller.report_serve.remote(observation)
            case TrainingObservation():
                self.controller.report_training.remote(observation)

    def forget(self, observation_type: type, name: str) -> None:
        import ray

        method = self.controller.report_serve if observation_type is ServeObservation else self.controller.report_training
        ray.get(method.remote(None, name), timeout=self.timeout_s)

    def autoscaler_running(self) -> bool:
        import ray

        return bool(ray.get(self.controller.autoscaler_running.remote(), timeout=self.timeout_s))

    def record_event(self, subject: str, kind: str, cause: str, detail: dict) -> None:
        from rayfleet.platform.fleet_events import record_fleet_event

        record_fleet_event(subject, kind, cause, detail, controller=self.controller)


class LocalChannel:
    """A ``ShellChannel`` to an in-process ``SharedAutoscaler`` (no Ray); events go to ``record``."""

    def __init__(self, autoscaler: Any, *, record: Callable[[str, str, str, dict], None] | None = None,
                 running: bool = True) -> None:
        self.autoscaler, self.record, self.running = autoscaler, record, running

    def take(self, target: str) -> list[InboxEntry]:
        return self.autoscaler.take(target)

    def report(self, observation: Observation) -> None:
        match observation:
            case ServeObservation():
                self.autoscaler.report_serve(observation)
            case TrainingObservation():
                self.autoscaler.report_training(observation)

    def forget(self, observation_type: type, name: str) -> None:
        if observation_type is ServeObservation:
            self.autoscaler.report_serve(None, name)
        else:
            self.autoscaler.report_training(None, name)

    def autoscaler_running(self) -> bool:
        return self.running

    def record_event(self, subject: str, kind: str, cause: str, detail: dict) -> None:
        if self.record is not None:
            self.record(subject, kind, cause, detail)


class AutoscalerShellBase(abc.ABC):
    """take → apply → report every ``interval_s`` seconds in a daemon thread (see module doc).

    Subclasses give ``inbox`` (the inbox's name: job id or deployment), ``subject`` (events),
    ``observation_type`` and implement ``observe`` and ``apply``; ``after_apply`` is a hook
    for work that must follow the tick's decisions (retried every tick until it succeeds).
    """

    observation_type: type = TrainingObservation

    def __init__(self, channel: ShellChannel, *, inbox: str, subject: str, interval_s: float,
                 log: Callable[[str], None], thread_name: str) -> None:
        self.channel, self.inbox, self.subject, self.interval_s, self.log = channel, inbox, subject, interval_s, log
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    # -- what a shell implements ---------------------------------------------------------------
    @abc.abstractmethod
    def observe(self) -> Observation | None:
        """The observation to report now, or ``None`` to skip this tick's report."""

    @abc.abstractmethod
    def apply(self, decision: Decision, decided_at_s: float) -> None:
        """Carry out one decision taken from the inbox (ignore the kinds that are not for this shell)."""

    def before_take(self) -> None:
        """Hook: refresh what the tick needs before taking decisions."""

    def after_apply(self) -> None:
        """Hook: follow-up work after the tick's decisions (see class doc)."""

    # -- the skeleton ------------------------------------------------------------------------------
    def tick(self) -> None:
        self.before_take()
        for entry in self.channel.take(self.inbox):
            self.apply(entry.decision, entry.decided_at_s)
        self.after_apply()
        self.report()

    def report(self) -> None:
        observation = self.observe()
        if observation is not None:
            self.channel.report(observation)

    def event(self, kind: str, cause: str, detail: dict | None = None) -> None:
        """Record what the shell did with the controller (best effort: never raises)."""
        try:
            self.channel.record_event(self.subject, kind, cause, dict(detail or {}))
        except Exception as exc:  # noqa: BLE001 - an event lost is not worth a failed job
            self.log(f"rayfleet autoscaler shell: could not record {kind}: {exc!r}")

    def start(self) -> "AutoscalerShellBase":
        self._thread.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._halt.is_set()

    def close(self) -> None:
        """Stop the loop and make the controller forget this shell's report."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        try:
            self.channel.forget(self.observation_type, self.inbox)
        except Exception:  # noqa: BLE001 - the controller may be gone at shutdown
            pass

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - see module doc
                self.on_tick_error(exc)

    def on_tick_error(self, exc: Exception) -> None:
        self.log(f"rayfleet autoscaler shell {self.inbox}: {exc!r}")
