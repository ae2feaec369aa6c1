"""FlashCheckpointer in one process (no Ray, no process group): cadence, shm/storage restore,
fallbacks, and an exact resume of a small model + AdamW."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rayfleet.errors import SpecError
from rayfleet.jobs.checkpoint.flash import CheckpointState, FlashCheckpointer
from rayfleet.platform.snapshot import SnapshotStore
from rayfleet.storage.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint


@pytest.fixture()
def shm_root(tmp_path):
    # The pid keeps concurrent pytest sessions apart: their tmp_path names repeat, and two
    # processes sharing one slot directory overwrite each other's snapshots.
    path = f"/dev/shm/rayfleet-test-flash-{os.getpid()}-{tmp_path.name}"
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def _toy(step: int) -> CheckpointState:
    return CheckpointState(sharded={"w": torch.full((64,), float(step)), "meta": {"lr": 0.1 * step}},
                           rank_local={"data_position": step * 8})


def _template() -> CheckpointState:
    return CheckpointState(sharded={"w": torch.zeros(64), "meta": {"lr": 0.0}})


def test_cadence_restore_sources_and_flush(shm_root, tmp_path):
    uri = str(tmp_path / "ckpt")
    ckpt = FlashCheckpointer(snapshot_every=2, persist_every=2, store=SnapshotStore(shm_root, job="t", rank=0),
                             checkpoint_uri=uri, keep=2)
    events = {step: ckpt.after_step(step, lambda step=step: _toy(step)) for step in range(1, 10)}
    assert [s for s, e in events.items() if e is not None] == [2, 4, 6, 8]
    assert [s for s, e in events.items() if e is not None and e.persist_scheduled] == [4, 8]
    assert events[2].cold and not events[4].cold and not events[8].cold
    ckpt.close()
    assert ckpt.stats.persisted_steps == [4, 8] and verify_checkpoint(uri).ok

    template = _template()
    result = FlashCheckpointer(snapshot_every=2, persist_every=2, store=SnapshotStore(shm_root, job="t", rank=0),
                               checkpoint_uri=uri).restore(template)
    assert (result.source, result.step) == ("shm", 8)
    assert torch.equal(template.sharded["w"], torch.full((64,), 8.0))  # filled in place
    assert result.sharded["meta"]["lr"] == pytest.approx(0.8) and result.rank_local == {"data_position": 64}

    result = ckpt.restore(_template(), prefer="storage")
    assert (result.source, result.step, result.rank_local) == ("storage", 8, {"data_position": 64})

    # Preemption at step 9: flush snapshots the current state and persists it synchronously.
    ckpt = FlashCheckpointer(snapshot_every=2, persist_every=2, store=SnapshotStore(shm_root, job="t", rank=0),
                             checkpoint_uri=uri, keep=2)
    assert ckpt.flush(step=9, state_fn=lambda: _toy(9)) == 9
    ckpt.close()
    assert latest_checkpoint(uri).step == 9 and [c.step for c in list_checkpoints(uri)] == [8, 9]


def test_falls_back_to_storage_without_shm_and_skips_corrupt_snapshot(shm_root, tmp_path):
    uri = str(tmp_path / "ckpt")
    store = SnapshotStore(shm_root, job="f", rank=0)
    ckpt = FlashCheckpointer(snapshot_every=1, persist_every=3, store=store, checkpoint_uri=uri)
    for step in range(1, 6):
        ckpt.after_step(step, lambda step=step: _toy(step))
    ckpt.close()  # storage holds 3; shm holds 5 and 4, or 5 and 3 if 4 was written while 3 was pinned
    newest, older = store.committed()
    assert newest.step == 5 and older.step in (3, 4)
    with open(store._path(newest.slot, "data"), "r+b") as f:
        f.write(b"\xff\xff\xff\xff")  # corrupt step 5's data in place
    result = FlashCheckpointer(snapshot_every=1, persist_every=3, store=SnapshotStore(shm_root, job="f", rank=0),
                               checkpoint_uri=uri).restore(_template())
    assert (result.source, result.step) == ("shm", older.step)

    # A restarted worker on another node: empty shared memory, so storage.
    other = SnapshotStore(shm_root, job="f-other-node", rank=0)
    template = _template()
    result = FlashCheckpointer(snapshot_every=1, persist_every=3, store=other, checkpoint_uri=uri).restore(template)
    assert (result.source, result.step) == ("storage", 3) and "hold no snapshot" in result.reason
    assert torch.equal(template.sharded["w"], torch.full((64,), 3.0))

    # A template of another layout (e.g. another world size) cannot take the shm copy.
    wrong = CheckpointState(sharded={"w": torch.zeros(32), "meta": {"lr": 0.0}})
    with pytest.raises(SpecError, match="Size mismatch"):
        FlashCheckpointer(snapshot_every=1, persist_every=3, store=SnapshotStore(shm_root, job="f", rank=0),
                          checkpoint_uri=uri).restore(wrong)  # shm refused, then DCP refuses the shape

    nothing = FlashCheckpointer(snapshot_every=1, persist_every=1, store=SnapshotStore(shm_root, job="none", rank=0),
                                checkpoint_uri=str(tmp_path / "empty")).restore(_template())
    assert nothing.source == "none" and nothing.step is None


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # data position == step: batch is a function of it
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train_step(model, optim, step: int) -> float:
    x, y = _batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)  # dropout draws from the global RNG
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


def _state(model, optim, step: int) -> CheckpointState:
    model_sd, optim_sd = get_state_dict(model, optim)
    return CheckpointState(sharded={"model": model_sd, "optim": optim_sd},
                           rank_local={"next_step": step + 1, "rng": torch.get_rng_state()})


def _fresh(seed: int):
    torch.manual_seed(seed)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model_sd, optim_sd = get_state_dict(model, optim)  # initializes AdamW state to restore into
    return model, optim, CheckpointState(sharded={"model": model_sd, "optim": optim_sd})


def _resume(model, optim, result, *, restore_rng: bool = True) -> int:
    set_state_dict(model, optim, model_state_dict=result.sharded["model"], optim_state_dict=result.sharded["optim"])
    if restore_rng:
        torch.set_rng_state(result.rank_local["rng"])
    return result.rank_local["next_step"]


def test_model_and_adamw_resume_gives_the_same_next_loss(shm_root, tmp_path):
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    reference = {step: _train_step(model, optim, step) for step in range(1, 9)}

    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    uri = str(tmp_path / "ckpt")
    ckpt = FlashCheckpointer(snapshot_every=2, persist_every=2, store=SnapshotStore(shm_root, job="m", rank=0),
                             checkpoint_uri=uri)
    for step in range(1, 7):
        assert _train_step(model, optim, step) == reference[step]
        ckpt.after_step(step, lambda step=step: _state(model, optim, step))
    ckpt.close()  # the process "dies" after step 6: shm holds 6 (and 4), storage holds 4

    # From shared memory: resume at step 7, and every later loss equals the uninterrupted run's.
    model, optim, template = _fresh(seed=99)
    result = FlashCheckpointer(snapshot_every=2, persist_every=2, store=SnapshotStore(shm_root, job="m", rank=0),
                               checkpoint_uri=uri).restore(template)
    assert (result.source, result.step) == ("shm", 6)
    next_step = _resume(model, optim, result)
    assert [_train_step(model, optim, s) for s in range(next_step, 9)] == [reference[7], reference[8]]

    # From storage (resharding path): resume at step 5, replay 5..8 exactly.
    model, optim, template = _fresh(seed=98)
    result = FlashCheckpointer(snapshot_every=2, persist_every=2, store=None, checkpoint_uri=uri).restore(template)
    assert (result.source, result.step) == ("storage", 4)
    next_step = _resume(model, optim, result)
    assert [_train_step(model, optim, s) for s in range(next_step, 9)] == [reference[s] for s in range(5, 9)]

    # Broken variant: without the RNG state the dropout masks differ and so does the loss.
    model, optim, template = _fresh(seed=97)
    result = FlashCheckpointer(snapshot_every=2, persist_every=2, store=SnapshotStore(shm_root, job="m", rank=0),
                               checkpoint_uri=uri).restore(template)
    torch.manual_seed(12345)
    next_step = _resume(model, optim, result, restore_rng=False)
    assert _train_step(model, optim, next_step) != reference[7]


def test_bad_settings_raise_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="snapshot_every"):
        FlashCheckpointer(snapshot_every=0, persist_every=1, store=None, checkpoint_uri=str(tmp_path))
    with pytest.raises(SpecError, match="neither a snapshot store nor a checkpoint_uri"):
        FlashCheckpointer(snapshot_every=1, persist_every=1, store=None, checkpoint_uri=None)


def test_a_slow_persist_does_not_block_steps(shm_root, tmp_path, monkeypatch):
    # Hold the persister at its commit point: training must keep taking snapshots meanwhile.
    import threading

    import rayfleet.storage.checkpoint as checkpoint_store

    gate, reached = threading.Event(), threading.Event()
    real_write_manifest = checkpoint_store.write_manifest

    def gated_write_manifest(*args, **kwargs):
        reached.set()
        assert gate.wait(timeout=60)
        return real_write_manifest(*args, **kwargs)

    monkeypatch.setattr(checkpoint_store, "write_manifest", gated_write_manifest)
    uri = str(tmp_path / "ckpt")
    store = SnapshotStore(shm_root, job="slow", rank=0)
    ckpt = FlashCheckpointer(snapshot_every=1, persist_every=4, store=store, checkpoint_uri=uri)
    try:
        for step in range(1, 8):  # step 4 persists; 5, 6, 7 snapshot while that persist is stuck
            event = ckpt.after_step(step, lambda step=step: _toy(step))
            # A wait for the gated persist would last until the gate opens (60 s); 5 s is slack for load.
            assert event.blocking_s < 5.0 and event.persist_wait_s < 5.0
        assert reached.wait(timeout=60) and latest_checkpoint(uri) is None  # persist of 4 in flight
        # Commits run in the background: wait for step 7's (one that waited for the persist times out).
        assert ckpt.wait_committed(timeout=30) == 7
        assert store.restore().step == 7  # snapshots went on, into the unpinned slot
        assert {i.step for i in store.committed()} == {7, 4}  # 4 stays pinned for the persister
    finally:
        gate.set()  # a failed assertion must not leave the persister stuck for a minute
    ckpt.close()
    assert latest_checkpoint(uri).step == 4 and verify_checkpoint(uri).ok


def test_worker_killed_during_background_persist_leaves_last_committed_checkpoint(shm_root, tmp_path):
    import os
    import signal
    import sys
    import textwrap
    import time

    uri = str(tmp_path / "ckpt")
    script = textwrap.dedent(f"""
        import torch
        from rayfleet.jobs.checkpoint.flash import CheckpointState, FlashCheckpointer
        from rayfleet.platform.snapshot import SnapshotStore
        ckpt = FlashCheckpointer(snapshot_every=1, persist_every=1, checkpoint_uri={uri!r}, keep=5,
                                 store=SnapshotStore({shm_root!r}, job="kill", rank=0))
        for step in range(1, 10_000):
            w = torch.full((8 << 20,), float(step))  # 32 MiB: persists take a while
            ckpt.after_step(step, lambda: CheckpointState(sharded={{"w": w}}, rank_local={{"step": step}}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait for one committed step and a later one in progress
            committed = latest_checkpoint(uri)
            in_progress = [p for p in (tmp_path / "ckpt").glob("step_*")
                           if committed and p.name > f"step_{committed.step:08d}"
                           and not (p / "manifest.json").exists() and any(p.glob("*.distcp"))]
            if committed is not None and in_progress:
                break
            time.sleep(0.01)
        else:
            pytest.fail("no persist in progress was observed")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    latest = latest_checkpoint(uri)
    assert latest is not None and verify_checkpoint(uri, step=latest.step).ok
    template = CheckpointState(sharded={"w": torch.zeros(8 << 20)})
    result = FlashCheckpointer(snapshot_every=1, persist_every=1, store=None, checkpoint_uri=uri).restore(template)
    assert result.source == "storage" and result.step == latest.step
    assert torch.equal(template.sharded["w"], torch.full((8 << 20,), float(latest.step)))
    assert result.rank_local == {"step": latest.step}


def test_rollback_restores_at_most_the_given_step_and_discards_the_abandoned_timeline(shm_root, tmp_path):
    from rayfleet.jobs.health.policy import LossAnomalyPolicy

    uri = str(tmp_path / "ckpt")
    ckpt = FlashCheckpointer(snapshot_every=1, persist_every=2, keep=10, checkpoint_uri=uri,
                             store=SnapshotStore(shm_root, job="rb", rank=0))
    policy = LossAnomalyPolicy(spike_factor=3.0, warmup_steps=3)
    decision = None
    for step in range(1, 10):
        ckpt.after_step(step, lambda step=step: _toy(step))
        decision = policy.observe(step, 50.0 if step == 9 else 2.0) or decision
    ckpt.close()  # shm: 9, 8; storage: 2, 4, 6, 8
    assert decision is not None and decision.restore_at_most_step == 8

    restorer = FlashCheckpointer(snapshot_every=1, persist_every=2, keep=10, checkpoint_uri=uri,
                                 store=SnapshotStore(shm_root, job="rb", rank=0))
    result = restorer.restore(_template(), at_most_step=decision.restore_at_most_step)
    assert (result.source, result.step) == ("shm", 8)
    assert [i.step for i in restorer.store.committed()] == [8]  # the spiked step 9 is gone

    # A deeper rollback than shared memory holds: storage, and newer checkpoints are discarded.
    template = _template()
    result = restorer.restore(template, at_most_step=5)
    assert (result.source, result.step) == ("storage", 4)
    assert torch.equal(template.sharded["w"], torch.full((64,), 4.0))
    assert [c.step for c in list_checkpoints(uri)] == [2, 4] and restorer.store.committed() == []


class _MiniRun:
    """Drives hooks exactly as ``rayfleet.jobs.loop.train_worker`` does (on_start with state_fn/load_fn,
    after_step(0-based step), on_end), with a small real model instead of the MoE job."""

    def __init__(self, seed: int) -> None:
        from rayfleet.jobs.train_state import TrainState, capture_rng, restore_rng

        self._TrainState, self._capture_rng, self._restore_rng = TrainState, capture_rng, restore_rng
        torch.manual_seed(seed)
        self.model = _model()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.step = 0

    def state(self):
        fresh = not self.optim.state
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        if fresh:  # as the loop does: asking for a template must not advance AdamW's step
            for param_state in self.optim.state.values():
                param_state["step"].zero_()
        return self._TrainState(step=self.step, model=model_sd, optimizer=optim_sd, data={"position": self.step * 8},
                                rng=self._capture_rng(torch.device("cpu")), extra={"world_size": 1})

    def load(self, state) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=dict(state.model), optim_state_dict=dict(state.optimizer))
        assert state.data["position"] == state.step * 8
        self._restore_rng(state.rng, torch.device("cpu"))
        self.step = state.step

    def run(self, hooks, *, steps: int, stop_at: int | None = None, spike_at: int | None = None) -> list[float]:
        """Losses of the steps run; ``spike_at`` reports a 100x loss once at that (1-based) step,
        and ``step_losses`` keeps the last loss of each step (a rollback replays steps)."""
        hooks.on_start(rank=0, world_size=1, plan=None, step=self.step, state_fn=self.state, load_fn=self.load)
        losses, self.step_losses = [], {}
        while self.step < steps:
            done = self.step
            loss = _train_step(self.model, self.optim, done + 1)
            losses.append(loss)
            self.step_losses[done + 1] = loss
            self.step += 1
            reported = loss * 100 if done + 1 == spike_at else loss
            spike_at = None if done + 1 == spike_at else spike_at
            metrics = {"loss": reported, "step_time_s_per_rank": [1.0, 1.0, 1.6 if done >= 1 else 1.0]}
            hooks.after_step(done, metrics=metrics, sample_ids=(), state_fn=self.state, load_fn=self.load)
            if self.step == stop_at:
                break
        hooks.on_end(None, state_fn=self.state)
        return losses


def test_hook_follows_the_loop_contract_and_resumes_exactly(shm_root, tmp_path):
    from rayfleet.jobs.checkpoint.hook import FlashCheckpointHook
    from rayfleet.jobs.train_state import TrainHooks

    reference = _MiniRun(seed=0).run(TrainHooks(), steps=6)
    uri = str(tmp_path / "ckpt")

    def hook(job: str) -> FlashCheckpointHook:
        return FlashCheckpointHook(job=job, snapshot_every=2, persist_every=2, checkpoint_uri=uri, shm_root=shm_root)

    first = hook("h")
    assert _MiniRun(seed=0).run(first, steps=6, stop_at=3) == reference[:3]  # the hook changes nothing
    assert [e.step for e in first.events] == [2] and first.checkpointer.stats.persisted_steps == [3]  # flush at stop
    assert first.restored.source == "none"

    again = hook("h")
    assert _MiniRun(seed=5).run(again, steps=6) == reference[3:]
    assert (again.restored.source, again.restored.step) == ("shm", 3)

    elsewhere = hook("h-new-node")  # no snapshot on this node: storage (step 6, flushed at the end)
    run = _MiniRun(seed=6)
    assert run.run(elsewhere, steps=6) == [] and run.step == 6
    assert (elsewhere.restored.source, elsewhere.restored.step) == ("storage", 6)


def test_hook_rolls_back_a_loss_spike_and_flags_a_slow_rank(shm_root, tmp_path):
    from rayfleet.jobs.checkpoint.hook import FlashCheckpointHook
    from rayfleet.jobs.health.policy import LossAnomalyPolicy, RollbackDecision, SlowRankDecision, SlowRankPolicy
    from rayfleet.jobs.train_state import TrainHooks

    reference_run = _MiniRun(seed=0)
    reference_run.run(TrainHooks(), steps=7)
    seen = []
    hook = FlashCheckpointHook(job="spike", snapshot_every=1, persist_every=3, checkpoint_uri=str(tmp_path / "ckpt"),
                               shm_root=shm_root, loss_policy=LossAnomalyPolicy(spike_factor=3.0, warmup_steps=2),
                               slow_rank_policy=SlowRankPolicy(threshold=1.3, window=3), on_decision=seen.append)
    run = _MiniRun(seed=0)
    losses = run.run(hook, steps=7, spike_at=5)
    rollbacks = [d for d in hook.decisions if isinstance(d, RollbackDecision)]
    assert [(d.step, d.restore_at_most_step) for d in rollbacks] == [(5, 4)]
    assert len(losses) == 8  # step 5 ran twice: once spiked, once after the rollback to step 4
    assert run.step_losses == reference_run.step_losses  # the replay is exact (RNG and AdamW restored)
    assert [e.step for e in hook.events] == [1, 2, 3, 4, 5, 6, 7]  # the spiked step 5 was not snapshotted
    slow = [d for d in hook.decisions if isinstance(d, SlowRankDecision)]
    # Rank 2 is 1.6x from step 2 on: with window 3, 2 of 3 ratios are slow at step 3.
    assert [(d.rank, d.step) for d in slow] == [(2, 3)] and seen == hook.decisions
