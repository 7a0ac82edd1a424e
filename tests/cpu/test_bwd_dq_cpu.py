"""Backward dQ hand-off and wgmma-serialization guard (issue 11, d64 work), CPU only."""

import pytest

from flash4.compile.check import _wgmma_serialized
from flash4.config import (DQ_ROW_PAD, DQ_ROW_PAD_SPLIT, DQ_WHOLE_TILE_MAX_HEADDIM, bwd_smem_bytes,
                           select_bwd_config, shipped_bwd_configs)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_whole_tile_dq_up_to_d96(d):
    cfg = select_bwd_config(d, "bf16", True)
    assert cfg.dq_whole_tile == (d <= DQ_WHOLE_TILE_MAX_HEADDIM)
    # one bulk op per step needs the staged tile to be the accumulator's contiguous block: no pad
    assert cfg.dq_row_pad == (0 if cfg.dq_whole_tile else (DQ_ROW_PAD_SPLIT if cfg.split_headdim else DQ_ROW_PAD))
    assert cfg.smem_bytes() == bwd_smem_bytes(d, cfg.tile_m, cfg.tile_n, cfg.q_stages, cfg.split_headdim,
                                              None, cfg.transposed_dkv, cfg.do_stages)


def test_every_shipped_config_follows_the_rule():
    """The whole tile up to DQ_WHOLE_TILE_MAX_HEADDIM, and above it where shipped_dq_handoff turns
    dq_whole on (d128 dense, 2026-12-03)."""
    for cfg in shipped_bwd_configs():
        assert cfg.dq_whole_tile == (not cfg.split_headdim and (cfg.headdim <= DQ_WHOLE_TILE_MAX_HEADDIM
                                                                or cfg.dq_whole))


def _sass(hgmma: int, arrive: int) -> str:
    return "\n".join(["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;"] * hgmma
                     + ["WARPGROUP.ARRIVE ;"] * arrive)


def test_serialized_wgmma_detector():
    assert _wgmma_serialized(_sass(64, 64))  # one arrive per HGMMA: ptxas C7512
    assert not _wgmma_serialized(_sass(64, 10))  # one per GEMM
    assert not _wgmma_serialized(_sass(4, 4))  # too few HGMMAs to tell
