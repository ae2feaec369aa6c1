"""ServeSpec: YAML examples load, errors name the field and the fix, engine config mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.spec import ServeSpec, load_serve_spec

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "serve"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path):
    spec = load_serve_spec(path)
    names = spec.replica_names()
    assert set(names) == ({"colocated"} if spec.mode == "colocated" else {"prefill", "decode"})
    # never sample ids the byte tokenizer cannot decode; an HF model's engine takes its tokenizer's size
    assert spec.engine_config().vocab_limit == (None if spec.model.hf else 259)


@pytest.mark.parametrize("data, field", [
    ({"mode": "split"}, "mode"),
    ({"engine": {"num_blocks": 0}}, "engine.num_blocks"),
    ({"prefill": {"replicas": 0}}, "prefill.replicas"),
    ({"kv_transfer": {"lease_s": -1}}, "kv_transfer.lease_s"),
    ({"modle": {}}, "modle"),
    ({"model": {"preset": "tiny", "checkpoint": "file:///x"}}, "model"),
    ({"http": {"route_prefix": "no-slash"}}, "http.route_prefix"),
])
def test_bad_fields_raise_spec_error_naming_the_field(data, field):
    with pytest.raises(SpecError) as err:
        ServeSpec.parse(data)
    assert err.value.field == field and "Fix:" in str(err.value)


def test_defaults_and_names(tmp_path):
    spec = ServeSpec.parse({"mode": "disaggregated", "prefill": {"replicas": 2},
                            "model": {"checkpoint": "file:///ckpt/run-7/"}})
    assert spec.replica_names() == {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0"]}
    assert spec.model.served_name == "run-7"
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [unclosed")
    with pytest.raises(SpecError, match="YAML"):
        load_serve_spec(bad)
    with pytest.raises(SpecError, match="no such file"):
        load_serve_spec(tmp_path / "missing.yaml")


def test_cli_registers_serve_and_reports_spec_errors(tmp_path, capsys):
    from rayfleet.cli import build_parser, main

    args = build_parser().parse_args(["serve", "examples/serve/colocated.yaml", "--detach", "--port", "9001"])
    assert args.command == "serve" and args.detach and args.port == 9001
    bad = tmp_path / "serve.yaml"
    bad.write_text("mode: sideways\n")
    assert main(["serve", str(bad)]) == 2  # a user error: one line, exit 2, nothing deployed
    assert "mode='sideways'" in capsys.readouterr().err


def test_a_checkpoint_spec_round_trips_through_its_dump():
    """Regression: the default preset survived next to ``model.checkpoint`` in a dumped spec,
    so re-parsing it (the autoscaler's Serve shell does) failed with "preset or checkpoint"."""
    spec = ServeSpec.parse({"model": {"checkpoint": "/models/tiny-fp8", "name": "tiny-fp8"}})
    again = ServeSpec.parse(spec.model_dump(mode="json"))
    assert again == spec and again.model.preset is None and again.model.served_name == "tiny-fp8"
    with pytest.raises(SpecError) as err:
        ServeSpec.parse({"model": {"checkpoint": "/models/tiny-fp8", "preset": "tiny"}})
    assert "model" in str(err.value) and "not several" in str(err.value)
