"""Model specs: presets match published sizes; YAML/pydantic edge gives clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayfleet.errors import SpecError
from rayfleet.placement.model_spec import ModelSpecInput, load_model_spec, preset

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "models"


@pytest.mark.parametrize("name,total_b,active_b", [
    ("llama3-8b", 8.03, 8.03), ("llama3-70b", 70.6, 70.6), ("mixtral-8x7b", 46.7, 12.9),
    ("deepseek-v3", 671.0, 37.5),
])
def test_presets_match_published_sizes(name: str, total_b: float, active_b: float) -> None:
    spec = preset(name)
    assert spec.total_params() / 1e9 == pytest.approx(total_b, rel=0.01)
    assert spec.active_params() / 1e9 == pytest.approx(active_b, rel=0.02)


def test_yaml_examples_load() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert len(files) >= 3
    for path in files:
        spec = load_model_spec(path)
        assert spec.num_layers > 0


def test_fields_override_preset_and_tokens_convert() -> None:
    spec = ModelSpecInput(preset="mixtral-8x7b", num_layers=4, global_batch_tokens=4096 * 32).to_spec()
    assert spec.num_layers == 4 and spec.global_batch_sequences == 32 and spec.num_experts == 8


def test_unknown_field_names_the_field() -> None:
    with pytest.raises(SpecError) as info:
        load_model_spec({"preset": "mixtral-8x7b", "num_layer": 4})
    assert "num_layer" in str(info.value)


def test_bad_values_raise_spec_errors() -> None:
    with pytest.raises(SpecError, match="top_k"):
        load_model_spec({"preset": "mixtral-8x7b", "top_k": 9})
    with pytest.raises(SpecError, match="num_kv_heads"):
        load_model_spec({"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 3, "vocab_size": 10})
    with pytest.raises(SpecError, match="not a multiple"):
        load_model_spec({"preset": "llama3-8b", "global_batch_tokens": 1000})
    with pytest.raises(SpecError, match="preset"):
        load_model_spec("no-such-model")
