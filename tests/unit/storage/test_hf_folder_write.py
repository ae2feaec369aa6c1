"""``write_hf_folder`` writes ``config.json`` after everything else: its presence is what marks a
usable Hugging Face folder (``is_hf_folder``), so a crash mid-write must not leave one behind."""

from __future__ import annotations

import torch

from rayfleet.storage import safetensors_io


def test_config_json_is_written_last(tmp_path, monkeypatch):
    written: list[str] = []
    real_write_files = safetensors_io.write_files

    def recording_write_files(uri: str, files: dict) -> None:
        written.extend(files)
        real_write_files(uri, files)

    monkeypatch.setattr(safetensors_io, "write_files", recording_write_files)
    folder = str(tmp_path / "hf")
    # config.json first in the mapping: a writer that kept the mapping's order would fail here
    names = safetensors_io.write_hf_folder(folder, tensors={"w": torch.ones(2)},
                                           files={"config.json": b"{}", "tokenizer.json": b"{}"})
    assert written == ["tokenizer.json", "config.json"]
    assert names == [safetensors_io.SINGLE_NAME, "tokenizer.json", "config.json"]
    assert safetensors_io.is_hf_folder(folder) and not safetensors_io.is_hf_folder(str(tmp_path / "missing"))
