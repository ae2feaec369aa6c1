"""A training job starting from an HF model (``model: {hf: DIR}``) on data prepared with the
model's own tokenizer, then ``rayfleet model export`` of its output back to transformers.

- lr = 1e-30 (the spec requires lr > 0; AdamW's steps are then ~1e-30, far below one ulp of
  the weights): the run's servable holds the HF weights bit for bit (loaded, not re-drawn),
  and exporting it reproduces the original tensors;
- FP8 (delayed scaling) for a few steps: the exported master weights load in transformers with
  logits equal to rayfleet's, and they moved away from the start.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("rayfleet.jobs.parallel", reason="the train loop needs rayfleet.jobs.parallel")
transformers = pytest.importorskip("transformers")

from rayfleet.errors import SpecError  # noqa: E402
from rayfleet.jobs.local_processes import run_local  # noqa: E402
from rayfleet.jobs.spec import TrainJobSpec  # noqa: E402
from rayfleet.models import build_model  # noqa: E402
from rayfleet.placement.plan import ParallelPlan  # noqa: E402
from rayfleet.cli.model import export_hf_model  # noqa: E402
from rayfleet.storage.model_registry import load_servable  # noqa: E402
from rayfleet.storage.safetensors_io import HFCheckpoint  # noqa: E402
from tests.unit.models.hf_fixtures import save_tiny_moe_with_data  # noqa: E402



@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny Qwen3-MoE with a locally trained BPE tokenizer of the model's vocabulary size."""
    root = tmp_path_factory.mktemp("ft")
    save_tiny_moe_with_data(root)
    return root


def _job(root, **overrides) -> TrainJobSpec:
    job = {"name": "ft", "model": {"hf": str(root / "hf")}, "data": {"uri": str(root / "data"), "seq_len": 32},
           "steps": 2, "global_batch_size": 4, "precision": "fp32", "resources": {"num_workers": 1},
           "schedule": {"warmup_steps": 0, "kind": "constant"}}
    return TrainJobSpec.model_validate({**job, **overrides})


def test_a_job_starts_from_the_hf_weights(hf_model, tmp_path):
    spec = _job(hf_model, optimizer={"lr": 1e-30, "weight_decay": 0.0}, output={"uri": str(tmp_path / "out")})
    run_local(spec, ParallelPlan(dp=1, micro_batch_size=2))
    servable = load_servable(str(tmp_path / "out"))
    assert servable.metadata["hf"]["architecture"] == "Qwen3MoeForCausalLM"
    assert "tokenizer.json" in servable.files
    export_hf_model(str(tmp_path / "out"), str(tmp_path / "hf_out"))
    original = load_file(str(hf_model / "hf" / "model.safetensors"))
    exported = HFCheckpoint(str(tmp_path / "hf_out"))
    for name, tensor in original.items():
        assert torch.equal(exported.get(name), tensor), name


def test_an_fp8_finetune_exports_master_weights_that_transformers_loads(hf_model, tmp_path):
    spec = _job(hf_model, steps=3, precision="delayed", optimizer={"lr": 3e-3, "weight_decay": 0.0},
                output={"uri": str(tmp_path / "out")})
    result = run_local(spec, ParallelPlan(dp=1, micro_batch_size=2))
    assert all(torch.isfinite(torch.tensor(result.losses)))
    export_hf_model(str(tmp_path / "out"), str(tmp_path / "hf_out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32).eval()
    servable = load_servable(str(tmp_path / "out"))
    ours = build_model(servable.config, device="meta")
    ours.load_state_dict(servable.state_dict, assign=True)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours.eval()(tokens)).abs().max().item() <= 1e-4
    start = load_file(str(hf_model / "hf" / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(HFCheckpoint(str(tmp_path / "hf_out")).get("model.layers.1.self_attn.q_proj.weight"), start)


def test_an_hf_job_refuses_shape_overrides(hf_model):
    with pytest.raises(SpecError, match="model.config.num_layers"):
        _job(hf_model, model={"hf": str(hf_model / "hf"), "config": {"num_layers": 2}})
