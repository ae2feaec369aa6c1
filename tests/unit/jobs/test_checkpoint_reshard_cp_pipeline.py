"""A checkpoint from PP2 x VP2 x CP2 restores into DP4, and back (issue 28 item 6; gloo, no Ray).

Four rank processes run, one after another: PP2 x VP2 x CP2 (interleaved 1F1B, each rank two
model chunks, every micro-batch's sequence split over two CP ranks) stopped after 2 steps (the
stop flushes a checkpoint to storage), then DP4 (FSDP2 over four ranks, no pipeline, no CP)
resumed from it; and the reverse, DP4 stopped after 2 steps and PP2 x VP2 x CP2 resumed from its
checkpoint. Asserted:

- the state each resumed run starts from, gathered whole on its ranks (DTensors'
  ``full_tensor``), is the state the stopped run saved, bit for bit -- every parameter and AdamW
  moment -- although one was written by pipeline chunks over CP ranks and read by FSDP2 shards
  over four DP ranks, and the other the reverse;
- each resumed run starts at step 2 and its remaining losses equal the uninterrupted
  single-process run's.

Checked against a broken variant by hand: a restore that hands layers 2 and 3 each other's
weights (``train_state_of`` swapping the names) fails -- the DP4 run resumed from PP2 x VP2 x CP2
missed the reference's step-3 loss by 0.0043 (rel 1.2e-3, tolerance 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rayfleet.jobs.checkpoint.hook import FlashCheckpointHook
from rayfleet.jobs.local_processes import run_local, run_local_many
from rayfleet.jobs.spec import TrainJobSpec
from rayfleet.jobs.train_state import TrainHooks
from rayfleet.placement.plan import ParallelPlan

from run_hooks import PerRun, StopAfter

LOSS_RTOL = 2e-6
RESUMED_RTOL = 1e-5  # FSDP2's reduce-scatter and CP's gradient sum add in another order than one process






def _checkpoint(uri: str, job: str) -> FlashCheckpointHook:
    return FlashCheckpointHook(job=job, snapshot_every=1, persist_every=2, checkpoint_uri=uri, shm_root=None)


def _full_tensors(state) -> dict[str, torch.Tensor]:
    """Every tensor of a rank's ``TrainState`` (model and optimizer), DTensors gathered whole.

    A collective over each DTensor's mesh: every rank of a mesh holds the same keys (CP and DP
    peers), and keys are walked in sorted order, so the gathers line up."""
    from torch.distributed.tensor import DTensor

    flat: dict[str, object] = {}

    def walk(tree, prefix: str) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(tree, torch.Tensor):
            flat[prefix.rstrip(".")] = tree

    walk({"model": dict(state.model), "optimizer": dict(state.optimizer)}, "")
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sorted(flat.items())}


class _Capture(TrainHooks):
    """Writes this rank's whole tensors to ``{root}/{tag}-rank{r}.pt``: at the start, after the
    restore (``at=None``; chain it after the checkpoint hook), or after step index ``at``
    (0-based: ``at=1`` is the state after two steps)."""

    def __init__(self, root: str, tag: str, at: int | None) -> None:
        self.root, self.tag, self.at = root, tag, at

    def _write(self, rank: int, state) -> None:
        torch.save(_full_tensors(state), f"{self.root}/{self.tag}-rank{rank}.pt")

    def on_start(self, *, rank, world_size, plan, step, state_fn, load_fn) -> None:
        self.rank = rank
        if self.at is None:
            self._write(rank, state_fn())

    def after_step(self, step, *, metrics, sample_ids, state_fn, load_fn) -> None:
        if step == self.at:
            self._write(self.rank, state_fn())


class _Chain(TrainHooks):
    """Several hooks, called in order."""

    def __init__(self, *hooks: TrainHooks) -> None:
        self.hooks = hooks

    def on_start(self, **kwargs) -> None:
        for hook in self.hooks:
            hook.on_start(**kwargs)

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def after_step(self, step: int, **kwargs) -> None:
        for hook in self.hooks:
            hook.after_step(step, **kwargs)

    def on_end(self, summary, **kwargs) -> None:
        for hook in self.hooks:
            hook.on_end(summary, **kwargs)


def _merged(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """The whole state from every rank's capture (replicas, e.g. CP peers, must agree bit for bit)."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob(f"{tag}-rank*.pt")):
        for key, tensor in torch.load(path, weights_only=True).items():
            if key in out:
                assert torch.equal(out[key], tensor), f"{tag}: ranks disagree on {key}"
            out[key] = tensor
    return out


def test_pp2_vp2_cp2_checkpoint_restores_into_dp4_and_back(token_dataset, tmp_path) -> None:
    spec = TrainJobSpec.model_validate({
        "name": "reshard-cp-pp", "model": {"preset": "tiny", "config": {"num_layers": 4}},
        "data": {"uri": token_dataset, "seq_len": 32}, "steps": 4, "global_batch_size": 8, "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.1}, "schedule": {"warmup_steps": 1},
        "comm": {"a2a_overlap": False}})
    reference = torch.tensor(run_local(spec, ParallelPlan(dp=1, micro_batch_size=2)).losses, dtype=torch.float64)
    pipelined = ParallelPlan(pp=2, vpp=2, cp=2, micro_batch_size=2)  # 4 micro-batches: 2 rounds of pp
    dp4 = ParallelPlan(dp=4, micro_batch_size=2, zero_stage=3)
    assert pipelined.world_size == dp4.world_size == 4
    from_pipelined, from_dp = str(tmp_path / "from-pp-vp-cp"), str(tmp_path / "from-dp4")
    hooks = PerRun([_Chain(_checkpoint(from_pipelined, "a"), _Capture(str(tmp_path), "pipelined-step2", at=1)),
                     _Chain(_checkpoint(from_pipelined, "b"), _Capture(str(tmp_path), "dp4-restored", at=None)),
                     _Chain(_checkpoint(from_dp, "c"), _Capture(str(tmp_path), "dp4-step2", at=1)),
                     _Chain(_checkpoint(from_dp, "d"), _Capture(str(tmp_path), "pipelined-restored", at=None))])
    results = run_local_many(spec, [(pipelined, {"should_stop": StopAfter(2)}), (dp4, {}),
                                    (dp4, {"should_stop": StopAfter(2)}), (pipelined, {})], hooks=hooks)

    for stopped, resumed in ((results[0], results[1]), (results[2], results[3])):
        assert all(s.stopped and len(s.losses) == 2 for s in stopped.summaries), stopped.summaries
        for summary in stopped.summaries:  # every rank reports the global loss
            torch.testing.assert_close(torch.tensor(summary.losses, dtype=torch.float64), reference[:2],
                                       rtol=RESUMED_RTOL, atol=0)
        assert all(s.first_step == 2 for s in resumed.summaries)  # restored from the other layout
        for summary in resumed.summaries:
            torch.testing.assert_close(torch.tensor(summary.losses, dtype=torch.float64), reference[2:],
                                       rtol=RESUMED_RTOL, atol=0)

    # the restored state is the saved one, bit for bit, parameters and AdamW moments alike
    for saved, restored in (("pipelined-step2", "dp4-restored"), ("dp4-step2", "pipelined-restored")):
        before, after = _merged(tmp_path, saved), _merged(tmp_path, restored)
        assert set(before) == set(after), sorted(set(before) ^ set(after))[:10]
        assert any(".layers.3." in k for k in before) and any("exp_avg_sq" in k for k in before), sorted(before)[:20]
        for key, tensor in before.items():
            assert torch.equal(after[key], tensor), (saved, restored, key)
