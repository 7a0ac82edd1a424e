"""Test-wide setup: the `gpu` marker, applied to everything under tests/gpu/ and skipped without CUDA;
`--shard K/N` (run the K-th of N parts of the collected tests, whole files per part, balanced by
the seconds each file took on a GPU, tests/gpu/durations.json, else by test count: the GPU suite in
several device calls of <= 10 minutes each); the `compiled_clean` fixture shared by the CPU
compile-check tests."""

import collections
import json

from pathlib import Path

import pytest
import torch

_GPU_DIR = Path(__file__).parent / "gpu"
# seconds per GPU test file of a recorded run (its "recorded" field says which): --shard's weights
_DURATIONS = _GPU_DIR / "durations.json"


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only part K of N (1 <= K <= N) of the collected tests: whole test files per "
                          "part, each file to the part with the least work so far (largest first; work: the "
                          "file's seconds in tests/gpu/durations.json, else its test count x the recorded "
                          "seconds per test)")


def shard_files(weights: dict, num_shards: int) -> list:
    """[set of files] per part: files (name -> weight: seconds or test count) largest first, each to
    the part with the least weight so far (ties: the lower part; names break weight ties), so the
    parts are deterministic and balanced. Pure."""
    parts = [set() for _ in range(num_shards)]
    loads = [0] * num_shards
    for name, weight in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])):
        i = loads.index(min(loads))
        parts[i].add(name)
        loads[i] += weight
    return parts


def file_weights(counts: dict, seconds: dict) -> dict:
    """name -> weight of each collected file (counts: its collected tests): its recorded seconds, or,
    for a file the record lacks, its count x the record's seconds per test (1 per test without a
    record, i.e. balanced by count). Pure."""
    recorded = {name: counts[name] for name in counts if name in seconds}
    per_test = sum(seconds[name] for name in recorded) / sum(recorded.values()) if recorded else 1.0
    return {name: seconds.get(name, count * per_test) for name, count in counts.items()}


def recorded_seconds(path: Path = _DURATIONS) -> dict:
    """tests/gpu/durations.json's per-file seconds (node-id paths), or {} when it is absent or unreadable."""
    try:
        return dict(json.loads(path.read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


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
        keep_files = shard_files(file_weights(counts, recorded_seconds()), n)[k - 1]
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
