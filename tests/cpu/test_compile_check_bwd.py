"""Compile check on the CPU (no GPU) of every shipped backward config (issue 3): each must build
for sm_90a with HGMMA and TMA in the SASS, fit shared memory and spill no register."""

import pytest

pytest.importorskip("cutlass")

from flash4.compile.check import compile_check  # noqa: E402
from flash4.config import SM90_MAX_SMEM_BYTES, shipped_bwd_configs  # noqa: E402

CONFIGS = shipped_bwd_configs()


@pytest.fixture(scope="module")
def rows():
    return compile_check(CONFIGS)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[
    f"d{c.headdim}{'' if c.headdim_v is None else f'v{c.headdim_v}'}-{c.dtype}{'-causal' if c.causal else ''}"
    f"{'-det' if c.deterministic else ''}{'-dkv-accum' if c.dkv_accum else ''}" for c in CONFIGS])
def test_bwd_compiles_without_spills(rows, i, compiled_clean):
    row = rows[i]
    assert row["ok"], row["error"]
    assert row["smem_bytes"] <= SM90_MAX_SMEM_BYTES
    compiled_clean(row)
    assert row["utmaldg"] > 0, "no UTMALDG in SASS: TMA loads were not used"
