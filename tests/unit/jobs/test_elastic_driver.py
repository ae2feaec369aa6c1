"""The elastic driver's state machine, driven with a fake ``fit`` (no Ray).

Everything but the Train run is real: jobs cut from specs, the planner (``prepare_formation`` on a
``FleetTopology``), the elastic policy, the training shell, and for the autoscaler cases the
shared autoscaler's service and policy (in process, through ``LocalChannel``). The fake ``fit``
reports steps like rank 0 does, stops after the step in which the formation's stop signal was
raised (as every rank does), and can kill a node of the fleet or fail on its own.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest

from rayfleet.errors import RayfleetError, SpecError
from rayfleet.jobs.elastic.driver import ElasticDriver, FormationOutcome
from rayfleet.jobs.elastic.policy import DriverState as S, EndKind, FormationEnd
from rayfleet.jobs.formation_control import FormationControl
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_job import TrainJob, train_job
from rayfleet.jobs.train_launcher import prepare_formation
from rayfleet.jobs.elastic.training_shell import TrainingShell
from rayfleet.platform.autoscaler.service import SharedAutoscaler
from rayfleet.platform.autoscaler.shell import LocalChannel
from rayfleet.platform.autoscaler.types import GrowTraining, ServeObservation, ShrinkTraining
from rayfleet.platform.topology import FleetTopology, NodeTopology

STEPS = 12


def node(name: str, n: int = 2) -> NodeTopology:
    return NodeTopology(name=name, accelerator_type="H100", num_accelerators=n, rack="r0", block="b0",
                        nvlink_domain=f"nvl-{name}")


class FakeFleet:
    """A ``FormationRuntime`` whose ``fit`` is a script: one function per formation."""

    def __init__(self, nodes: list[NodeTopology], script: list[Callable]) -> None:
        self.nodes, self.script = list(nodes), list(script)
        self.runs: list[tuple[int, str, bool]] = []
        self.events: list[tuple[str, str, dict]] = []
        self.cleanups = 0
        self.signals: list[FormationControl | None] = []

    def observe(self) -> tuple:
        return FleetTopology(tuple(self.nodes)), set(), set()

    def prepare(self, job, topology, *, world_size, held, cordoned):
        return prepare_formation(job, topology, world_size=world_size, held=held, cordoned=cordoned)

    def run(self, launch, *, run_dir, watch, on_start, on_step) -> FormationOutcome:
        self.runs.append((launch.layout.world_size, run_dir, watch))
        signal = FormationControl() if watch else None
        self.signals.append(signal)
        on_start(signal)
        return self.script.pop(0)(self, launch, signal, on_step or (lambda row: None))

    def clean_up_aborted(self) -> None:
        self.cleanups += 1

    def record(self, kind: str, cause: str, detail: dict) -> None:
        self.events.append((kind, cause, detail))

    def pause(self, seconds: float) -> None:
        pass


def fit(until: int = STEPS, *, then: Callable | None = None, per_step: Callable | None = None) -> Callable:
    """A fake formation: report steps from where the checkpoint left off up to ``until`` (or the
    step in which the stop signal was raised); ``then(fleet)`` returns how it ended."""

    def run(fleet: FakeFleet, launch, signal, on_step) -> FormationOutcome:
        start = fleet.resume_at if hasattr(fleet, "resume_at") else 0
        step = start
        for step in range(start + 1, until + 1):
            on_step({"step": step, "loss": 1.0 / step, "workers": launch.layout.world_size})
            if per_step is not None:
                per_step(fleet, step)
            if signal is not None and signal.should_stop():
                break
        fleet.resume_at = step
        if then is not None:
            return then(fleet, step)
        return FormationOutcome(metrics={"step": step})

    return run


class Releasing(FakeFleet):
    """A fleet whose next ``still_held`` observations still show ``held`` taken (Ray frees a
    formation's, or a borrower's, accelerators asynchronously); records its pauses."""

    def __init__(self, nodes: list[NodeTopology], script: list[Callable], *, held: set) -> None:
        super().__init__(nodes, script)
        self.held, self.still_held, self.pauses = set(held), 0, []

    def observe(self) -> tuple:
        topology, held, cordoned = super().observe()
        if self.still_held:
            self.still_held -= 1
            held = held | self.held
        return topology, held, cordoned

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)


def lose(name: str) -> Callable:
    def then(fleet: FakeFleet, step: int) -> FormationOutcome:
        fleet.nodes = [n for n in fleet.nodes if n.name != name]
        return FormationOutcome(end=FormationEnd(EndKind.NODE_LOST, f"node {name} of the layout died"),
                                error=RuntimeError("TrainController died"))
    return then


@pytest.fixture()
def spec(job_dict, tmp_path) -> TrainJob:
    return train_job(TrainJobSpec.model_validate({
        **job_dict, "name": "elastic-unit", "steps": STEPS,
        "resources": {"accelerator": "H100", "elastic": {"min_workers": 2, "max_workers": 4}},
        "checkpoint": {"every_n_steps": 2, "uri": str(tmp_path / "ckpt")}}))


def states(driver: ElasticDriver) -> list[str]:
    return [driver.transitions[0].source.value] + [t.target.value for t in driver.transitions]


def test_a_fixed_size_job_runs_one_unwatched_formation(job_dict, tmp_path):
    spec = train_job(TrainJobSpec.model_validate({**job_dict, "steps": STEPS,
                                                  "resources": {"accelerator": "H100", "num_workers": 2}}))
    fleet, lines = FakeFleet([node("n0"), node("n1")], [fit()]), []
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lines.append)
    assert driver.run() == {"step": STEPS}
    assert states(driver) == ["SCHEDULING", "RUNNING", "FINISHED"]
    assert fleet.runs == [(2, str(tmp_path / "job" / "job-f0"), False)]
    assert "rayfleet elastic: RUNNING -> FINISHED (step 12 of 12 done)" in lines


def test_node_loss_recovers_on_a_smaller_formation(spec, tmp_path):
    fleet, lines = FakeFleet([node("n0"), node("n1")], [fit(5, then=lose("n1")), fit()]), []
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lines.append)
    assert driver.run()["step"] == STEPS
    assert states(driver) == ["SCHEDULING", "RUNNING", "RECOVERING", "SCHEDULING", "RUNNING", "FINISHED"]
    assert [(size, watch) for size, _, watch in fleet.runs] == [(4, True), (2, True)]
    assert len({run_dir for _, run_dir, _ in fleet.runs}) == 2  # snapshots are keyed per formation
    assert fleet.cleanups == 1  # the aborted formation's placement group
    assert [kind for kind, _, _ in fleet.events] == ["node_lost", "elastic_reform"]
    assert "rayfleet elastic: formation 1 with 2 workers" in lines  # what the cluster test and operators read


def test_capacity_back_stops_the_formation_and_regrows(spec, tmp_path):
    def grow(fleet, step):
        fleet.nodes.append(node("n1"))
        return FormationOutcome(metrics={"step": step}, end=FormationEnd(EndKind.GROW, "the fleet now holds 4 workers"))

    fleet = FakeFleet([node("n0")], [fit(3, then=grow), fit()])
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lambda line: None)
    assert driver.run()["step"] == STEPS
    assert states(driver) == ["SCHEDULING", "RUNNING", "RESIZING", "SCHEDULING", "RUNNING", "FINISHED"]
    assert [size for size, _, _ in fleet.runs] == [2, 4]
    assert [kind for kind, _, _ in fleet.events] == ["grow", "elastic_reform"]


def test_a_failure_nobody_caused_fails_the_job_with_its_own_error(spec, tmp_path):
    def boom(fleet, step):
        return FormationOutcome(error=ValueError("NaN in the optimizer"))

    fleet = FakeFleet([node("n0"), node("n1")], [fit(3, then=boom)])
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lambda line: None)
    with pytest.raises(ValueError, match="NaN in the optimizer"):
        driver.run()
    assert driver.state is S.ERRORED and fleet.cleanups == 0


def test_a_fleet_too_small_for_the_minimum_errors_naming_the_field(spec, tmp_path):
    fleet = FakeFleet([node("n0"), node("n1")], [fit(3, then=lose("n1"))])
    fleet.nodes = [node("n0", 1), node("n1")]
    with pytest.raises(SpecError, match="resources.elastic.min_workers"):
        ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lambda line: None).run()
    assert [size for size, _, _ in fleet.runs] == [3]  # 1 + 2 free: ran once, then n1 died and 1 < min


def test_a_re_plan_waits_for_the_last_formations_accelerators_to_be_released(spec, tmp_path):
    """Ray frees a formation's accelerators after ``fit`` returns: the re-plan first sees them
    taken, waits (polls), and re-forms once they are free, instead of failing the job."""
    from rayfleet.platform.topology import AcceleratorSlot

    def grow(fleet, step):
        fleet.nodes.append(node("n1"))
        fleet.still_held = 3  # the next observations still see n0's two slots taken
        return FormationOutcome(metrics={"step": step}, end=FormationEnd(EndKind.GROW, "grow"))

    fleet, lines = Releasing([node("n0")], [fit(3, then=grow), fit()],
                             held={AcceleratorSlot("n0", 0), AcceleratorSlot("n0", 1), AcceleratorSlot("n1", 0)}), []
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lines.append)
    assert driver.run()["step"] == STEPS
    assert [size for size, _, _ in fleet.runs] == [2, 4] and len(fleet.pauses) == 3
    assert any("waiting up to" in line and "released" in line for line in lines)


def test_a_capacity_shortage_that_lasts_fails_after_the_release_wait(spec, tmp_path, monkeypatch):
    import rayfleet.jobs.elastic.driver as driver_module

    monkeypatch.setattr(driver_module, "RELEASE_POLLS", 4)
    fleet = FakeFleet([node("n0"), node("n1")], [fit(3, then=lose("n1"))])
    fleet.nodes = [node("n0", 1), node("n1")]
    polls = []
    fleet.pause = polls.append
    with pytest.raises(SpecError, match="resources.elastic.min_workers"):
        ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lambda line: None).run()
    assert polls.count(driver_module.RELEASE_POLL_S) >= 4


def test_the_first_formation_does_not_wait_for_capacity(spec, tmp_path):
    fleet = FakeFleet([node("n0", 1)], [])
    fleet.pause = lambda seconds: pytest.fail("the first sizing waited")
    with pytest.raises(SpecError, match="resources.elastic.min_workers"):
        ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lambda line: None).run()


def test_flapping_capacity_stops_after_max_formations(spec, tmp_path):
    def flap(fleet, step):
        return FormationOutcome(metrics={"step": step}, end=FormationEnd(EndKind.GROW, "flap"))

    fleet = FakeFleet([node("n0"), node("n1")], [fit(1, then=flap), fit(2, then=flap), fit(3, then=flap)])
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), log=lambda line: None, max_formations=3)
    with pytest.raises(RayfleetError, match="re-formed 3 times"):
        driver.run()
    assert len(fleet.runs) == 3


# -- the shared autoscaler, through the training shell ---------------------------------------------

@pytest.fixture()
def autoscaler() -> SharedAutoscaler:
    # no free accelerator anywhere: Serve's extra replica can only come from the training job
    return SharedAutoscaler(free_accelerators=lambda: ({"n0": 0, "n1": 0, "s0": 0}, {"n0": "H100", "n1": "H100",
                                                                                    "s0": "H100"}),
                            request_nodes=lambda decision: None, record=lambda *event: None)


def test_the_autoscaler_lends_a_replica_and_the_job_reforms_around_it(spec, tmp_path, autoscaler):
    """Serve is short; the real policy shrinks the job by whole DP replicas on one node; the shell
    stops the formation after that step; the driver re-forms at 2 workers on the other node."""
    events = []
    shell = TrainingShell(spec, LocalChannel(autoscaler, record=lambda *e: events.append(e)), log=lambda line: None)
    decided = []

    def serve_gets_short(fleet, step):
        if step == 4:  # the shell reported a running formation; now Serve wants a second 2-accelerator replica
            shell.tick()  # the shell's report: 4 workers, stepping, one DP replica per accelerator
            autoscaler.report_serve(ServeObservation("chat", "H100", 2, running_replicas=1, desired_replicas=2,
                                                     replica_nodes=("s0",)))
            decided.extend(autoscaler.step(time.time()))
            shell.tick()  # take -> apply (stops the formation) -> report
            # lent just now: the borrower waits for the job to re-form, so Ray does not count it yet
            assert shell.lent_slots() and not shell.placed_lent_slots()

    fleet = FakeFleet([node("n0"), node("n1"), node("s0", 0)], [fit(per_step=serve_gets_short), fit()])
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), shell=shell, log=lambda line: None)
    assert driver.run()["step"] == STEPS
    shrink = next(d for d in decided if isinstance(d, ShrinkTraining))
    assert shrink.new_size == 2 and len(shrink.replicas) == 2
    lent_node = next(iter(shrink.freed_by_node))
    assert states(driver) == ["SCHEDULING", "RUNNING", "RESIZING", "SCHEDULING", "RUNNING", "FINISHED"]
    assert fleet.resume_at == STEPS and fleet.signals[0].should_stop()  # stopped after step 4, then resumed
    assert [size for size, _, _ in fleet.runs] == [4, 2]
    assert lent_node not in driver.launch.layout.nodes()  # planned around the lent accelerators
    # once the job re-formed around them, the borrower runs: a later re-plan counts it once (Ray's count)
    assert set(shell.placed_lent_slots()) == set(shell.lent_slots()) and shell.lent_slots()
    resized = [e for e in events if e[1] == "autoscaler_training_resized"]
    assert resized and "ShrinkTraining 4->2" in resized[0][2] and resized[0][0] == "job:elastic-unit"
    assert autoscaler.training == {}  # closing the driver's shell made the controller forget the job


def test_a_whole_preemption_pauses_the_job_until_accelerators_come_back(spec, tmp_path, autoscaler):
    shell = TrainingShell(spec, LocalChannel(autoscaler), log=lambda line: None, interval_s=0.01)

    def preempt(fleet, step):
        if step == 3:
            autoscaler.carry_out(ShrinkTraining("elastic-unit", 0, (0, 1, 2, 3), {"n0": 2, "n1": 2}, "preempted whole"))
            shell.tick()

            def give_back():  # later, another controller step returns the accelerators
                time.sleep(0.2)
                autoscaler.carry_out(GrowTraining("elastic-unit", 4, ("n0", "n1"), "give back 4"))
                shell.tick()
            threading.Thread(target=give_back, daemon=True).start()

    fleet = FakeFleet([node("n0"), node("n1")], [fit(per_step=preempt), fit()])
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), shell=shell, log=lambda line: None)
    assert driver.run()["step"] == STEPS
    assert states(driver) == ["SCHEDULING", "RUNNING", "RESIZING", "SCHEDULING", "PAUSED", "SCHEDULING", "RUNNING",
                              "FINISHED"]
    assert [size for size, _, _ in fleet.runs] == [4, 4]  # all lent slots came back


def test_a_job_preempted_whole_by_the_policy_is_grown_back_by_it_on_the_next_step(job_dict, tmp_path):
    """Regression (quickstart notebook, fresh clone): after a whole preemption the paused job's
    shell reported it *resizing*, so the policy grew nothing, that job included; it was never
    grown back. Here the real policy preempts the job (at its minimum) for Serve, Serve gives
    the accelerators back, and the next controller step grows the job back (despite the default
    600 s resize cooldown, which bounds restarts of running jobs, not of paused ones)."""
    spec = train_job(TrainJobSpec.model_validate({
        **job_dict, "name": "elastic-unit", "steps": STEPS,
        "resources": {"accelerator": "H100", "elastic": {"min_workers": 4, "max_workers": 4}},
        "checkpoint": {"every_n_steps": 2, "uri": str(tmp_path / "ckpt")}}))
    free = {"n0": 0, "n1": 0, "s0": 0}
    autoscaler = SharedAutoscaler(free_accelerators=lambda: (dict(free), {n: "H100" for n in free}),
                                  request_nodes=lambda decision: None, record=lambda *event: None)
    shell = TrainingShell(spec, LocalChannel(autoscaler), log=lambda line: None, interval_s=0.01)
    decided: list = []
    driver: ElasticDriver

    def give_back() -> None:  # the controller's next steps, once the job sits paused
        deadline = time.monotonic() + 10
        while driver.state is not S.PAUSED and time.monotonic() < deadline:
            time.sleep(0.01)
        free.update({"n0": 0, "n1": 2})  # the job let go; Serve's lent replica runs on n0
        autoscaler.report_serve(ServeObservation("chat", "H100", 2, running_replicas=2, desired_replicas=2,
                                                 replica_nodes=("s0", "n0")))
        shell.tick()  # the paused job's report
        decided.extend(autoscaler.step())  # 2 free, the job's minimum is 4: nothing to grow
        free.update({"n0": 2, "n1": 2})  # the lent replica is gone again
        autoscaler.report_serve(ServeObservation("chat", "H100", 2, running_replicas=1, desired_replicas=1,
                                                 replica_nodes=("s0",)))
        decided.extend(autoscaler.step())
        shell.tick()
        if shell.target_size == 0:  # not grown (the bug): give back by hand so the driver ends
            autoscaler.carry_out(GrowTraining("elastic-unit", 4, ("n0", "n1"), "test: by hand"))
            shell.tick()

    def serve_gets_short(fleet, step):
        if step == 3:
            shell.tick()  # stepping at 4 workers, its minimum
            autoscaler.report_serve(ServeObservation("chat", "H100", 2, running_replicas=1, desired_replicas=2,
                                                     replica_nodes=("s0",)))
            decided.extend(autoscaler.step())
            shell.tick()
            threading.Thread(target=give_back, daemon=True).start()

    fleet = FakeFleet([node("n0"), node("n1"), node("s0", 0)], [fit(per_step=serve_gets_short), fit()])
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), shell=shell, log=lambda line: None)
    assert driver.run()["step"] == STEPS
    shrink = next(d for d in decided if isinstance(d, ShrinkTraining))
    assert shrink.preempted and "last resort" in shrink.reason
    grown = [d for d in decided if isinstance(d, GrowTraining)]
    assert grown and grown[0].new_size == 4, decided  # by the policy, on its first step after the pause
    assert states(driver) == ["SCHEDULING", "RUNNING", "RESIZING", "SCHEDULING", "PAUSED", "SCHEDULING", "RUNNING",
                              "FINISHED"]
    assert [size for size, _, _ in fleet.runs] == [4, 4]


def test_a_grow_back_waits_for_its_accelerators_instead_of_forming_smaller(spec, tmp_path, autoscaler):
    """Regression (vLLM lend, 2026-11-29): the grow-back's formation was sized while the lent
    replica's accelerators were still held in Ray's count, formed at the old size, and the policy
    had to grow the job a second time (another stop, snapshot and worker-group start). Now the
    re-plan after a grow decision waits for the target's accelerators (a few polls here), and one
    formation at the target follows."""
    from rayfleet.platform.topology import AcceleratorSlot

    shell = TrainingShell(spec, LocalChannel(autoscaler), log=lambda line: None)

    def lend(fleet, step):
        if step == 3:
            autoscaler.carry_out(ShrinkTraining("elastic-unit", 2, (2, 3), {"n1": 2}, "lend n1"))
            shell.tick()

    def give_back(fleet, step):
        if step == 6:
            autoscaler.carry_out(GrowTraining("elastic-unit", 4, ("n1",), "give back 2"))
            shell.tick()
            fleet.still_held = 3  # the borrower lets go of n1 while the job re-plans

    fleet, lines = Releasing([node("n0"), node("n1")], [fit(per_step=lend), fit(per_step=give_back), fit()],
                             held={AcceleratorSlot("n1", 0), AcceleratorSlot("n1", 1)}), []
    driver = ElasticDriver(spec, fleet, job_dir=str(tmp_path / "job"), shell=shell, log=lines.append)
    assert driver.run()["step"] == STEPS
    assert [size for size, _, _ in fleet.runs] == [4, 2, 4], lines
    assert len(fleet.pauses) == 3  # three looks saw n1 held; the fourth formed at the target
    assert any("waiting up to 30s" in line and "the 4 the autoscaler grew the job to" in line for line in lines), lines
