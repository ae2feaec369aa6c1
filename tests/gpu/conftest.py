"""GPU-only tests: skipped where CUDA is absent (CI and the development machines have none)."""

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
