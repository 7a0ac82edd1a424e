"""Fixtures shared by every GPU test module (tests/gpu/).

The `gpu` marker and the skip without CUDA come from tests/conftest.py (applied to everything under
tests/gpu/); the helpers the tests call (inputs, NaN-poisoned buffers, reference gradients, the
varlen checks, tolerances) are in tests/gpu/gpu_helpers.py.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _sm90_only():
    """flash4 has kernels for sm_90 only: on another GPU every module here skips."""
    from flash4.arch import device_arch

    if torch.cuda.is_available() and device_arch() != 90:
        pytest.skip(f"flash4 has kernels for sm_90 only; this GPU is sm_{device_arch()}")
