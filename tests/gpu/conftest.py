"""Fixtures shared by every GPU test module (tests/gpu/).

The `gpu` marker and the skip without CUDA come from tests/conftest.py (applied to everything under
tests/gpu/); the helpers the tests call (inputs, NaN-poisoned buffers, reference gradients, the
varlen checks, tolerances) are in tests/gpu/gpu_helpers.py.

The portable family (flash4.config.sm80): on its own GPUs (sm_80 / 86 / 89 / 120), or forced on the
H200 with `FLASH4_FAMILY=portable pytest tests/gpu ...`, the suite runs on it. A test that needs a
feature the family lacks skips instead of failing: its error carries
flash4.config.sm80.UNSUPPORTED_PREFIX (paged K/V, split-KV, headdim_v != headdim;
pytest_runtest_makereport below), and the modules of PORTABLE_SKIP test the sm90 family's own
machinery. On its own GPUs the family is served behind the first-use self-test (FLASH4_PORTABLE,
flash4.selftest): packed varlen / seqused / KV-cache configs are untestable for that self-test and
refused, so run the suite there with FLASH4_PORTABLE=on (forced on the H200 nothing is gated).
"""

import os

import pytest
import torch

# Modules that test the sm90 family's own machinery: skipped while the portable family runs.
PORTABLE_SKIP = {
    "test_pack_gqa.py": "GQA packing (FwdConfig.pack_gqa) is the sm90 family's",
    "test_gqa_bwd.py": "the GQA head split of the backward (BwdConfig.dkv_accum) is the sm90 family's",
    "test_selftest.py": "the first-use self-test drives the sm90 / sm100 kernels",
    "test_sink_delta.py": "the backward kernel's own D (BwdConfig.sink_delta) is the sm90 family's",
    "test_speed_switches.py": "the speed switches (FwdConfig / BwdConfig fields) are the sm90 family's",
}


def _active_family():
    """The kernel family the host runs on this GPU (flash4.config.active_family), or None."""
    from flash4.arch import device_arch
    from flash4.config import active_family

    try:
        return active_family(device_arch()).name
    except ValueError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _supported_gpu(request):
    """Skip where flash4 has no kernel family for this GPU, and PORTABLE_SKIP's modules where the
    portable family runs."""
    if not torch.cuda.is_available():
        return
    from flash4.arch import device_arch

    family = _active_family()
    if family is None:
        pytest.skip(f"flash4 has no kernel family for this GPU (sm_{device_arch()}; FLASH4_FAMILY="
                    f"{os.environ.get('FLASH4_FAMILY')!r})")
    reason = PORTABLE_SKIP.get(request.node.path.name) if family == "sm80" else None
    if reason is not None:
        pytest.skip(f"portable family: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails with the portable family's "does not implement" error is skipped (the
    feature is not in that family), naming the feature."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or not report.failed:
        return
    from flash4.config.sm80 import UNSUPPORTED_PREFIX

    exc = call.excinfo.value
    if isinstance(exc, (ValueError, NotImplementedError)) and UNSUPPORTED_PREFIX in str(exc):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {str(exc)[:300]}")
