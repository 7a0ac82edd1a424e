"""The backward's row-wise passes (kernels/common/bwd_preprocess.py: preprocess with the dQ accumulator's
zeroing, dQ postprocess) compile for sm_90a for every backward head dim and value head dim pair,
dense and varlen, bf16 and fp16 (CPU only; the GPU tests check what they compute)."""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import BWD_SUPPORTED_HEADDIMS, HDIMV_PAIRS  # noqa: E402

PAIRS = sorted({(d, d) for d in BWD_SUPPORTED_HEADDIMS} | set(HDIMV_PAIRS))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", PAIRS)
def test_rowwise_passes_compile(d, dv, dtype, varlen, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path))
    from flash4.compile import cache

    assert callable(cache.get_bwd_preprocess_runner(dv, dtype, 90, varlen=varlen, headdim_q=d))
    assert callable(cache.get_bwd_postprocess_runner(d, dtype, 90, varlen=varlen))


def test_preprocess_rejects_odd_headdim():
    """The row passes take multiples of 16 (the sm90 kernel head dims, d80 / d48 included: a row's
    last pass predicated, row_passes / full_pass); other widths are refused."""
    from flash4.kernels.common.bwd_preprocess import (BackwardPostprocess, BackwardPreprocess, full_pass,
                                                      row_passes)

    with pytest.raises(AssertionError):
        BackwardPreprocess(72, None)
    with pytest.raises(AssertionError):
        BackwardPostprocess(40, None)
    BackwardPreprocess(80, None), BackwardPostprocess(48, None)
    assert (row_passes(80), full_pass(80, 0), full_pass(80, 2)) == (3, True, False)
    assert (row_passes(64), full_pass(64, 1)) == (2, True)
    assert (row_passes(16), full_pass(16, 0)) == (1, False)


def test_accum_order_configs():
    """dQ in accumulator order exactly where the whole tile is reduced at once with the dense layout
    (d64, d96, and d128 where dq_whole ships); packed layouts and the other head dims keep row-major dQ."""
    from flash4.config import select_bwd_config, shipped_bwd_configs, with_seq_layout

    for cfg in shipped_bwd_configs():
        assert cfg.dq_accum_order == (cfg.dq_whole_tile and not (cfg.varlen_q or cfg.seqused_q)), cfg
        assert cfg.dq_accum_order == ((cfg.headdim <= 96 or cfg.dq_whole) and not cfg.varlen_q
                                      and not cfg.seqused_q), cfg
    for d in (64, 96):
        assert select_bwd_config(d).dq_accum_order
        assert not with_seq_layout(select_bwd_config(d), varlen_q=True, varlen_k=True).dq_accum_order


def test_accum_order_postprocess_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path))
    from flash4.compile import cache
    from flash4.config import shipped_bwd_configs

    keys = {(c.headdim, c.dtype, c.tile_m, c.dq_handoff_per_wg) for c in shipped_bwd_configs() if c.dq_accum_order}
    assert {k[0] for k in keys} == {64, 96, 128}  # d128: dq_whole (shipped_dq_handoff, 2026-12-03)
    for headdim, dtype, tile_m, halves in sorted(keys):
        assert callable(cache.get_bwd_postprocess_runner(headdim, dtype, 90, accum_tile_m=tile_m, wg_halves=halves))
    with pytest.raises(ValueError, match="dense layouts only"):
        cache.get_bwd_postprocess_runner(64, "bf16", 90, varlen=True, accum_tile_m=128)
