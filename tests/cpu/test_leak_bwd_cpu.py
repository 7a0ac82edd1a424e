"""The backward's tail zeroing (issue 25, item 1) on the CPU: the zero-fill layout fits every K / V /
Q / dO tile of the backward configs, ragged kernels (varlen / seqused) compile clean with the
zeroing (the Tail barrier over both consumer warpgroups, 16-byte zero stores) in each work split
(StepRegs, StepSplitHd, StepDkvT), and a plain dense kernel has none of it. The GPU side (poisoned
memory gives bitwise the clean gradients) is tests/gpu/test_leak_bwd.py."""

import re

import pytest
from cpu_helpers import compiled_row

from flash4.config import BWD_SUPPORTED_HEADDIMS, HDIMV_PAIRS, select_bwd_config, with_seq_layout

CONSUMER_THREADS = 256


def _bwd_tiles():
    """(rows, cols) of every K, V (tile_n rows) and Q, dO (tile_m rows) stage of the backward configs."""
    cfgs = [select_bwd_config(d, "bf16", c, deterministic=det, local=loc)
            for d in BWD_SUPPORTED_HEADDIMS for c in (False, True) for det in (False, True) for loc in (False, True)]
    cfgs += [select_bwd_config(d, "bf16", c, headdim_v=dv) for d, dv in HDIMV_PAIRS for c in (False, True)]
    tiles = set()
    for c in cfgs:
        tiles |= {(c.tile_n, c.headdim), (c.tile_n, c.hdim_v), (c.tile_m, c.headdim), (c.tile_m, c.hdim_v)}
    return sorted(tiles)


@pytest.mark.parametrize("rows, cols", _bwd_tiles())
def test_zero_layout_tiles_the_stage(rows, cols):
    pytest.importorskip("cutlass")
    from flash4.kernels.sm90.bwd_step import zero_threads

    used, per_row = zero_threads(CONSUMER_THREADS, rows, cols, 8)
    assert used % 128 == 0 and 0 < used <= CONSUMER_THREADS
    assert (cols // 8) % per_row == 0 and used % per_row == 0
    assert rows % (used // per_row) == 0


# One ragged kernel per work split: StepRegs (d64, 128-query steps, seqused), StepSplitHd (d256,
# seqused), StepDkvT (d192, packed only).
RAGGED = [
    with_seq_layout(select_bwd_config(64, "bf16", False), varlen_q=True, varlen_k=True, seqused_q=True,
                    seqused_k=True),
    with_seq_layout(select_bwd_config(256, "bf16", True), varlen_q=True, varlen_k=True, seqused_q=True,
                    seqused_k=True),
    with_seq_layout(select_bwd_config(192, "bf16", True), varlen_q=True, varlen_k=True),
]
PLAIN = select_bwd_config(128, "bf16", True)


def _build(cfg) -> dict:
    """A compile_check-style row of cfg plus its SASS text (cpu_helpers.compiled_row)."""
    from flash4.compile.cache import compile_bwd

    return compiled_row(compile_bwd(cfg), cfg)


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("cutlass")
    return [_build(cfg) for cfg in RAGGED]


@pytest.mark.parametrize("i", range(len(RAGGED)), ids=["d64-regs-seqused", "d256-split-seqused", "d192-dkvT"])
def test_ragged_kernels_compile_clean(rows, i, compiled_clean):
    """No spill, HGMMA, wgmmas not serialized; the Tail barrier (id 7) over the 256 consumer threads
    (the K/V tail once, the Q/dO tail in each mask phase's step) and 16-byte zero stores."""
    from flash4.kernels.common.barriers import NamedBarrierBwd

    compiled_clean(rows[i])
    tail = f"BAR.SYNC.DEFER_BLOCKING {hex(int(NamedBarrierBwd.Tail))}, {hex(CONSUMER_THREADS)} ;"
    assert rows[i]["sass"].count(tail) >= 2, tail
    assert re.search(r"STS\.128 \[[^]]*\], RZ", rows[i]["sass"])


def test_plain_dense_kernel_has_no_zeroing():
    """A plain dense kernel (rows past the lengths arrive as TMA zeros) has no Tail barrier and no
    zero stores: its SASS is left as it was (tools/kernel_fingerprint.py --compare checks every one)."""
    pytest.importorskip("cutlass")
    from flash4.kernels.common.barriers import NamedBarrierBwd

    sass = _build(PLAIN)["sass"]
    if sass is None:
        pytest.skip("cuobjdump not installed")
    assert f"BAR.SYNC.DEFER_BLOCKING {hex(int(NamedBarrierBwd.Tail))}," not in sass
    assert not re.search(r"STS\.128 \[[^]]*\], RZ", sass)
