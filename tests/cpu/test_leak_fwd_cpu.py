"""The forward's V-tail zeroing (issue 25, item 1) on the CPU: the zero-fill layout fits every
forward tile, the ragged-K kernels (varlen_k / seqused_k / paged) compile clean with the zeroing
(its named barrier VTail in the SASS), and a plain dense kernel has none of it. The GPU side
(poisoned memory gives bitwise the clean result) is tests/gpu/test_leak_fwd.py."""

import dataclasses
import re

import pytest
from cpu_helpers import compiled_row

from flash4.config import HDIMV_PAIRS, SUPPORTED_HEADDIMS, paged_page_rows, select_fwd_config, with_seq_layout
from flash4.constants import THREADS_PER_WG


def _tiles():
    """(num consumer threads, tile_n, Dv) of every forward tile the configs and decode pick."""
    cfgs = [select_fwd_config(d, "bf16", c, local=loc, softcap=sc)
            for d in SUPPORTED_HEADDIMS for c in (False, True) for loc in (False, True) for sc in (False, True)]
    cfgs += [select_fwd_config(d, "bf16", c, local=loc, headdim_v=dv)
             for d, dv in HDIMV_PAIRS for c in (False, True) for loc in (False, True)]
    cfgs += [dataclasses.replace(c, tile_m=64) for c in list(cfgs)]  # decode's one-warpgroup tiles
    return sorted({(c.num_consumer_warpgroups * THREADS_PER_WG, c.tile_n, c.hdim_v) for c in cfgs})


@pytest.mark.parametrize("threads, tile_n, dv", _tiles())
def test_v_zero_layout_tiles_the_stage(threads, tile_n, dv):
    pytest.importorskip("cutlass")
    from flash4.kernels.sm90.fwd import v_zero_threads

    used, per_row = v_zero_threads(threads, tile_n, dv)
    assert used % THREADS_PER_WG == 0 and 0 < used <= threads
    assert (dv // 8) % per_row == 0 and used % per_row == 0
    assert tile_n % (used // per_row) == 0


# One ragged-K kernel per zero-fill shape: 3 warpgroups (256 of 384 threads zero), a decode tile
# (one warpgroup, split-KV), paged 80-key blocks of d256 (16-row pieces).
RAGGED = [
    with_seq_layout(select_fwd_config(64, "bf16", True), varlen_q=True, varlen_k=True, seqused_k=True),
    with_seq_layout(dataclasses.replace(select_fwd_config(128, "bf16", False), tile_m=64, kv_stages=3),
                    seqused_k=True, split_kv=True),
    with_seq_layout(select_fwd_config(256, "bf16", False), varlen_q=True, seqused_k=True,
                    page_rows=paged_page_rows(64, 80)),
]
PLAIN = select_fwd_config(128, "bf16", True)


def _build(cfg) -> dict:
    """A compile_check-style row of cfg plus its SASS text (cpu_helpers.compiled_row)."""
    from flash4.compile.cache import compile_fwd

    return compiled_row(compile_fwd(cfg), cfg)


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("cutlass")
    return [_build(cfg) for cfg in RAGGED]


@pytest.mark.parametrize("i", range(len(RAGGED)), ids=["d64-varlen-3wg", "d128-decode-split", "d256-paged"])
def test_ragged_k_kernels_compile_clean(rows, i, compiled_clean):
    """No spill, HGMMA, wgmmas not serialized; the VTail barrier (id 5) over all consumer threads
    and 16-byte zero stores in the SASS."""
    from flash4.kernels.common.barriers import NamedBarrierFwd

    compiled_clean(rows[i])
    threads = RAGGED[i].num_consumer_warpgroups * THREADS_PER_WG
    vtail = f"BAR.SYNC.DEFER_BLOCKING {hex(int(NamedBarrierFwd.VTail))}, {hex(threads)} ;"
    assert vtail in rows[i]["sass"], vtail
    assert re.search(r"STS\.128 \[[^]]*\], RZ", rows[i]["sass"])


def test_plain_dense_kernel_has_no_zeroing():
    """A plain dense kernel (K/V rows past seqlen_k arrive as TMA zeros) has no VTail barrier: its
    SASS is left as it was (tools/kernel_fingerprint.py --compare checks every one)."""
    pytest.importorskip("cutlass")
    from flash4.kernels.common.barriers import NamedBarrierFwd

    sass = _build(PLAIN)["sass"]
    if sass is None:
        pytest.skip("cuobjdump not installed")
    assert f"BAR.SYNC.DEFER_BLOCKING {hex(int(NamedBarrierFwd.VTail))}," not in sass
