"""Checkpoints are data, not code (issue 15): loading never unpickles arbitrary objects, and a
training checkpoint's checksums are verified by default."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import pickle

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.storage.checkpoint import load_checkpoint, save_checkpoint
from rayfleet.storage.model_registry import load_servable, save_servable
from rayfleet.storage.safe_dcp_reader import safe_load_metadata


class _Boom:
    """Unpickling this runs code: a crafted checkpoint would do the same with os.system."""

    def __reduce__(self):
        return (os.getenv, ("RAYFLEET_BOOM_RAN",))


def _state(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g)}, "optim": {"step": torch.tensor(3.0), "lr": 0.1}}


def _template() -> dict:
    return {"model": {"w": torch.zeros(16, 8)}, "optim": {"step": torch.tensor(0.0), "lr": 0.0}}


def test_a_flipped_byte_is_caught_by_default_and_the_opt_out_skips_the_check(tmp_path):
    uri = str(tmp_path / "ck")
    save_checkpoint(uri, step=1, sharded=_state())
    (data_file,) = glob.glob(f"{uri}/step_*/*.distcp")
    raw = bytearray(open(data_file, "rb").read())
    raw[len(raw) // 2] ^= 0xFF  # same size: only a checksum can tell
    open(data_file, "wb").write(bytes(raw))
    with pytest.raises(SpecError, match="corrupt checkpoint"):
        load_checkpoint(uri, sharded=_template())
    template = _template()
    load_checkpoint(uri, sharded=template, verify_checksums=False)  # explicitly trusted: loads the bytes
    assert not torch.equal(template["model"]["w"], _state()["model"]["w"])


def test_dcp_metadata_naming_anything_but_dcp_classes_is_refused(tmp_path):
    uri = str(tmp_path / "ck")
    save_checkpoint(uri, step=1, sharded=_state())
    (meta,) = glob.glob(f"{uri}/step_*/.metadata")
    with open(meta, "rb") as f:
        assert type(safe_load_metadata(f)).__name__ == "Metadata"  # what torch writes reads fine
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        safe_load_metadata(io.BytesIO(pickle.dumps(_Boom())))
    with pytest.raises(pickle.UnpicklingError, match="not DCP Metadata"):
        safe_load_metadata(io.BytesIO(pickle.dumps({"a": 1})))
    # A crafted .metadata (checksums skipped, as an attacker with write access would arrange)
    # fails the load instead of running code.
    size = os.path.getsize(meta)
    crafted = pickle.dumps(_Boom())
    open(meta, "wb").write(crafted + b"\0" * (size - len(crafted)))  # same size: still "committed"
    with pytest.raises(Exception, match="not DCP metadata"):
        load_checkpoint(uri, sharded=_template(), verify_checksums=False)


def test_a_servable_whose_weights_pickle_an_object_is_refused(tmp_path):
    uri = f"file://{tmp_path}/servable"
    save_servable(uri, config={"dim": 8}, state_dict={"w": torch.zeros(2)})
    path = tmp_path / "servable"
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2), "evil": _Boom()}, buf)
    (path / "weights.pt").write_bytes(buf.getvalue())
    manifest = json.loads((path / "manifest.json").read_text())  # checksums made to match
    manifest["files"]["weights.pt"] = {"bytes": len(buf.getvalue()),
                                       "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="holds more than tensors"):
        load_servable(uri)
