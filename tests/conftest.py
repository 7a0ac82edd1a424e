"""Test-wide setup: the `gpu` marker, applied to everything under tests/gpu/ and skipped without CUDA;
`--shard K/N` (run the K-th of N parts of the collected tests, whole files per part, balanced by
test count: the GPU suite in several device calls of <= 10 minutes each); the `compiled_clean`
fixture shared by the CPU compile-check tests."""

import collections

from pathlib import Path

import pytest
import torch

_GPU_DIR = Path(__file__).parent / "gpu"


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only part K of N (1 <= K <= N) of the collected tests: whole test files per "
                          "part, each file to the part with the fewest tests so far (largest files first)")


def shard_files(counts: dict, num_shards: int) -> list:
    """[set of files] per part: files (name -> test count) largest first, each to the part with the
    fewest tests so far (ties: the lower part; names break count ties), so the parts are deterministic
    and balanced by count. Pure."""
    parts = [set() for _ in range(num_shards)]
    loads = [0] * num_shards
    for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = loads.index(min(loads))
        parts[i].add(name)
        loads[i] += count
    return parts


def _parse_shard(text: str) -> tuple:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard must be K/N with integers 1 <= K <= N, e.g. 1/2; got {text!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard must be K/N with 1 <= K <= N; got {text!r}")
    return k, n


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped automatically without one)")
    config.addinivalue_line("markers", "jit_engine: the CPU test compiles with the CuTe DSL's JIT engine "
                                       "(tests/cpu/conftest.py compiles without it otherwise)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard:
        k, n = _parse_shard(shard)
        counts = collections.Counter(item.nodeid.split("::")[0] for item in items)
        keep_files = shard_files(counts, n)[k - 1]
        kept = [item for item in items if item.nodeid.split("::")[0] in keep_files]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid.split("::")[0] not in keep_files])
        items[:] = kept
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
