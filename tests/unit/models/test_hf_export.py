"""Import -> export through rayfleet: bit-identical tensors, and folders transformers loads with
logits equal to rayfleet's. Also: what is refused, and the error names the config field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rayfleet.cli.model import export_hf_model, import_hf_model
from rayfleet.errors import SpecError
from rayfleet.models import MoEConfig, build_model, preset
from rayfleet.models.hf import from_hf_config
from rayfleet.storage.model_registry import load_servable, save_servable
from rayfleet.storage.safetensors_io import INDEX_NAME, HFCheckpoint
from tests.unit.models.hf_fixtures import hf_config_dict, hf_configs, save_tiny

transformers = pytest.importorskip("transformers")


def _all_tensors(folder) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(str(folder))
    return {k: ckpt.get(k) for k in ckpt.keys()}


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "qwen2"])
def test_import_export_round_trip_is_bit_identical_and_loads_in_transformers(tmp_path, name):
    src = save_tiny(name, tmp_path / "src")
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    imported = import_hf_model(str(src), str(tmp_path / "servable"))
    assert "tokenizer_config.json" in imported.files
    out = tmp_path / "exported"
    export_hf_model(str(tmp_path / "servable"), str(out), max_shard_bytes=64 << 10)

    assert (out / INDEX_NAME).exists() and len(list(out.glob("model-*.safetensors"))) > 1  # sharded
    original, exported = load_file(str(src / "model.safetensors")), _all_tensors(out)
    assert set(original) == set(exported)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    for side in ("tokenizer_config.json", "generation_config.json", "config.json"):
        assert (out / side).exists()
    before, after = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: v for k, v in after.items() if k in before} == before

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    servable = load_servable(str(tmp_path / "servable"))
    model = build_model(servable.config, device="meta")
    model.load_state_dict(servable.state_dict, assign=True)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(tokens).logits - model.eval()(tokens)).abs().max().item() <= 1e-4


def test_a_rayfleet_trained_dense_model_with_interleaved_rotary_exports_to_llama(tmp_path):
    # rayfleet's own rotary layout is interleaved; HF Llama's is halves: export permutes q/k rows.
    config = MoEConfig(vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96,
                       num_dense_layers=2, num_experts=0, top_k=0, num_shared_experts=0, init_std=0.2)
    model = build_model(config, seed=5).eval()
    save_servable(str(tmp_path / "run"), config=config, state_dict=model.state_dict())
    transfer = export_hf_model(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert transfer.architecture == "LlamaForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, model(tokens)
    assert ref.abs().max() > 0.1 and (ref - ours).abs().max().item() <= 1e-4


def test_the_native_sigmoid_router_gqa_preset_is_refused_with_the_fix(tmp_path):
    config = preset("tiny")
    model = build_model(config, device="meta")
    state = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    save_servable(str(tmp_path / "run"), config=config, state_dict=state)
    with pytest.raises(SpecError, match="no Hugging Face architecture computes this model.*model import"):
        export_hf_model(str(tmp_path / "run"), str(tmp_path / "hf"))


@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_parameters.rope_type"),
    ("hidden_act", "gelu", "config.json:hidden_act"),
    ("sliding_window", 64, "config.json:sliding_window"),
    ("architectures", ["GPT2LMHeadModel"], "config.json:architectures"),
])
def test_unsupported_fields_are_refused_naming_the_field(field, value, match):
    base = hf_config_dict("mixtral")
    base[field] = value
    with pytest.raises(SpecError, match=match):
        from_hf_config(base)


@pytest.mark.parametrize("name", sorted(hf_configs()))
def test_analytic_parameter_counts_equal_the_built_models(name):
    spec = from_hf_config(hf_config_dict(name))
    model = build_model(spec.config, device="meta")
    assert spec.config.num_params().total == sum(p.numel() for p in model.parameters())



def test_a_random_model_created_without_transformers_loads_in_transformers(tmp_path):
    from rayfleet.cli.model import create_random_hf_model

    config = hf_config_dict("qwen3_moe")
    create_random_hf_model(str(tmp_path / "m"), config, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    ours = build_model(from_hf_config(config).config, seed=3).eval()
    tokens = torch.randint(0, config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4
