"""Test-wide setup: the `gpu` marker, applied to everything under tests/gpu/ and skipped without CUDA."""

from pathlib import Path

import pytest
import torch

_GPU_DIR = Path(__file__).parent / "gpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped automatically without one)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _GPU_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
