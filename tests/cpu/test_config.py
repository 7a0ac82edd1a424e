"""Config selection and block ranges: pure functions, checked on the CPU.

flash4.geometry's formulas run on device Int32 values in the kernel; here they run on Python ints
and are compared with a brute-force walk of the (bottom-right aligned) causal mask (more in
tests/cpu/test_geometry.py).
"""

import dataclasses

import pytest

pytest.importorskip("cutlass")

from flash4.config import (  # noqa: E402
    BWD_SUPPORTED_HEADDIMS,
    SUPPORTED_HEADDIMS,
    select_bwd_config,
    select_fwd_config,
    shipped_bwd_configs,
    shipped_fwd_configs,
    short_seq_fwd_config,
    SHORT_SEQLEN_K,
)
from flash4 import geometry as block_info  # noqa: E402

SMEM_LIMIT = 227 * 1024


def test_shipped_configs_fit_and_cover_the_api():
    fwd = shipped_fwd_configs()
    assert {c.headdim for c in fwd} == set(SUPPORTED_HEADDIMS)
    for c in fwd:
        assert c.smem_bytes() <= SMEM_LIMIT and c.tile_m % 64 == 0 and c.tile_n % 16 == 0
        assert c.exp2_emu_frac == 0.0  # ablation-chosen default
        if c.persistent:  # the short-sequence configs (select_fwd_config(seqlen_k=...))
            assert c.lpt and c == short_seq_fwd_config(select_fwd_config(c.headdim, c.dtype, c.causal))
        else:
            assert c.lpt == c.causal  # LPT tile order for causal on the plain grid
    bwd = shipped_bwd_configs()
    assert {c.headdim for c in bwd} == set(BWD_SUPPORTED_HEADDIMS)
    assert all(c.smem_bytes() <= SMEM_LIMIT for c in bwd)
    assert {c.deterministic for c in bwd} == {False, True}


@pytest.mark.parametrize("select", [select_fwd_config, select_bwd_config])
def test_unsupported_arch_and_headdim_raise(select):
    with pytest.raises(ValueError, match="sm_75"):
        select(128, "bf16", False, arch=75)
    with pytest.raises(ValueError, match="headdim=72"):
        select(72, "bf16", False)  # sm90's kernels take multiples of 16 (flash4.config.sm90.KERNEL_HEADDIMS)


def test_bwd_covers_every_forward_headdim():
    """Every head dim the forward takes trains: 192 uses the transposed-dK/dV kernel (96 keys per
    CTA), other head dims > 128 the split-headdim kernel (64 keys per CTA)."""
    assert set(BWD_SUPPORTED_HEADDIMS) == set(SUPPORTED_HEADDIMS)
    for d in BWD_SUPPORTED_HEADDIMS:
        cfg = select_bwd_config(d)
        assert cfg.transposed_dkv == (d == 192)
        if d == 192:
            assert not cfg.split_headdim and cfg.tile_n == 96
        else:
            assert cfg.split_headdim == (d > 128) and cfg.tile_n == (64 if d > 128 else 128)
        assert cfg.smem_bytes() <= SMEM_LIMIT - 1024 and cfg.q_stages >= 1


def visible(i, j, sq, sk):
    return j <= i + sk - sq


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (129, 1000), (1000, 129), (4096, 1000), (1, 128), (333, 777)])
@pytest.mark.parametrize("tile_m,tile_n", [(128, 128), (192, 128), (128, 80)])
def test_causal_block_ranges_match_brute_force(sq, sk, tile_m, tile_n):
    """Blocks >= n_block_max are fully masked; blocks < n_block_min_causal_mask need no causal mask;
    only the blocks in between (the diagonal) are masked."""
    for m in range(-(-sq // tile_m)):
        rows = range(m * tile_m, min((m + 1) * tile_m, sq))
        n_max = block_info.n_block_max(m, sq, sk, tile_m, tile_n, True)
        n_mask = min(block_info.n_block_min_causal_mask(m, sq, sk, tile_m, tile_n), max(n_max - 1, 0))
        for n in range(-(-sk // tile_n)):
            cols = range(n * tile_n, min((n + 1) * tile_n, sk))
            any_visible = any(visible(i, j, sq, sk) for i in rows for j in cols)
            all_visible = all(visible(i, j, sq, sk) for i in rows for j in cols)
            if n >= n_max:
                assert not any_visible, (m, n)
            else:
                assert any_visible or n == n_max - 1 and not any(
                    visible(i, j, sq, sk) for i in rows for j in range(sk)), (m, n)
            if n < n_mask:
                assert all_visible, (m, n)


def test_non_causal_visits_every_key_block():
    assert block_info.n_block_max(5, 1000, 1000, 128, 128, False) == 8


def test_bwd_query_step_and_stages():
    """d64 bf16 takes 128-query steps (fp16 spills there: 64); d256 fits one Q/dO stage only."""
    assert select_bwd_config(64, "bf16").tile_m == 128
    assert select_bwd_config(64, "fp16").tile_m == 64
    assert all(select_bwd_config(d, dt).tile_m == 64 for d in (96, 128, 192, 256) for dt in ("bf16", "fp16"))
    assert select_bwd_config(256).q_stages == 1
    assert all(select_bwd_config(d).q_stages == 2 for d in (64, 96, 128, 192))


@pytest.mark.parametrize("d", BWD_SUPPORTED_HEADDIMS)
def test_bwd_swizzle_atom_tiles_headdim_halves(d):
    """The K (and split-headdim Q/dO) smem atom must tile headdim/2: the dQ (dK, dV) wgmma of each
    warpgroup reads one half. 96 and 192 need the atom chosen for the half."""
    from flash4.kernels.sm90.bwd import _half_split_atom_cols

    cols = _half_split_atom_cols(d) or d
    width = next(w for w in (64, 32, 16, 8) if cols % w == 0)  # 16-bit columns per swizzle row
    half = d // 2
    assert d % width == 0 and (half % width == 0 or width % half == 0)  # the half is whole atoms or a divisor of one
    assert _half_split_atom_cols(d) is None or d in (96, 192)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_short_sequence_forward_configs(dtype):
    """seqlen_k <= SHORT_SEQLEN_K: d64 (causal with 128-row tiles) and d128 causal run persistent; d128
    non-causal takes pv_zero_init + flat_tile_order (shipped_tile_work, since 2026-12-05); other head
    dims, longer keys and window / softcap / sink / Dv != D keep the long-sequence config."""
    for d in SUPPORTED_HEADDIMS:
        for causal in (False, True):
            long = select_fwd_config(d, dtype, causal)
            # above SHORT_SEQLEN_K keys: the d128 non-causal forward takes the vote-first softmax
            vote = d == 128 and not causal
            assert select_fwd_config(d, dtype, causal, seqlen_k=SHORT_SEQLEN_K + 1) == (
                dataclasses.replace(long, softmax_vote_first=True) if vote else long)
            assert select_fwd_config(d, dtype, causal, seqlen_k=None) == long
            for sk in (1, 129, SHORT_SEQLEN_K):
                short = select_fwd_config(d, dtype, causal, seqlen_k=sk)
                if d == 64 or (d == 128 and causal):
                    assert short == dataclasses.replace(long, persistent=True, lpt=True,
                                                        tile_m=128 if (d == 64 and causal) else long.tile_m)
                elif d == 128:
                    assert short == dataclasses.replace(long, pv_zero_init=True, flat_tile_order=True)
                else:
                    assert short == long
    for kw in ({"local": True}, {"softcap": True}, {"sink": True}, {"headdim_v": 128}):
        assert not select_fwd_config(64, dtype, True, seqlen_k=512, **kw).persistent
    shipped = shipped_fwd_configs()
    for d, causal in ((64, False), (64, True), (128, True)):
        assert select_fwd_config(d, dtype, causal, seqlen_k=SHORT_SEQLEN_K) in shipped
