"""Test-wide setup: the `gpu` marker, applied to everything under tests/gpu/ and skipped without CUDA;
the `compiled_clean` fixture shared by the CPU compile-check tests."""

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


def _compiled_clean(row: dict) -> None:
    """A flash4.compile.check.compile_check row compiled, without register spills, with HGMMA in its
    SASS and without serialized wgmmas (ptxas C7512); skips the resource checks where cuobjdump is not installed (the row has no registers)."""
    assert row["ok"], row["error"]
    if row.get("registers") is None:
        pytest.skip("cuobjdump not installed: resource usage not checked")
    assert row["spills"] == 0, f"{row['config']}: {row['spills']} local-memory instructions (register spill)"
    assert row["hgmma"] > 0, f"{row['config']}: no HGMMA in SASS (wgmma was not used)"
    assert not row.get("wgmma_serialized"), (
        f"{row['config']}: ptxas serialized the wgmmas (C7512, one WARPGROUP.ARRIVE/DEPBAR per HGMMA)")


@pytest.fixture
def compiled_clean():
    """The check every compile-check test applies to its rows (_compiled_clean)."""
    return _compiled_clean
