"""BwdConfig.dq_swapab (speed candidate, off; docs/design/speed_candidates.md section 6): flash-attn-4's
head dim 128 non-causal backward tile, 80 x 128 with dQ^T = K^T dS^T. On the CPU: the config (off
everywhere, out of every shipped repr, built only where dq_swapab_ok), the smem budget and the
128-byte aligned LSE / D stages, the dQ^T fragment -> dQ tile map (pure), and the candidate's sm_90a
compile (0 spills, wgmma not serialized). Compile-verified, not run on hardware: the GPU A/B is
tools/ab_bwd_tiles.py (variant m80, d128 full cells)."""

import dataclasses
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import BwdConfig, select_bwd_config, shipped_bwd_configs  # noqa: E402, F401 (eval)
from flash4.config.sm90 import (BWD_SMEM_BUDGET, DQ_SWAPAB_TILE_M, dq_swapab_config,  # noqa: E402
                                stat_stage_rows)


def _candidate():
    cfg = dq_swapab_config(select_bwd_config(128, "bf16", False))
    assert cfg is not None
    return cfg


# ---------------------------------------------------------------------------------------- config
def test_off_everywhere_and_out_of_repr():
    for cfg in shipped_bwd_configs():
        assert not cfg.dq_swapab and "dq_swapab" not in repr(cfg)
    cfg = _candidate()
    assert repr(cfg).endswith(", dq_swapab=True)") and eval(repr(cfg)) == cfg


def test_candidate_fields():
    shipped = select_bwd_config(128, "bf16", False)
    cfg = _candidate()
    changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(shipped, f.name)}
    assert changed == {"tile_m", "dq_swapab"}
    assert (cfg.tile_m, cfg.tile_n, cfg.q_stages) == (DQ_SWAPAB_TILE_M, 128, 2) == (80, 128, 2)
    assert cfg.dq_row_pad == 0 and not cfg.dq_whole_tile and not cfg.dq_accum_order  # row-major postprocess
    assert cfg.smem_bytes() <= BWD_SMEM_BUDGET


def test_built_only_where_it_applies():
    assert dq_swapab_config(select_bwd_config(128, "fp16", False)) is not None
    for cfg in (select_bwd_config(128, "bf16", True), select_bwd_config(64, "bf16", False),
                select_bwd_config(96, "bf16", False), select_bwd_config(128, "bf16", False, deterministic=True)):
        assert dq_swapab_config(cfg) is None, cfg
    with pytest.raises(AssertionError):  # tile_m 80 needs the transposed dQ GEMM
        dataclasses.replace(select_bwd_config(128, "bf16", False), tile_m=80)
    with pytest.raises(AssertionError):  # causal: not built
        dataclasses.replace(_candidate(), causal=True)


def test_stat_stages_are_128_byte_aligned():
    """Each LSE / D stage starts 128 bytes apart (the TMA load's destination): 96 rows at tile_m 80;
    64 and 128 (the shipped tiles) keep their compact stages."""
    assert stat_stage_rows(80) == 96 and _candidate().stat_stage_rows == 96
    for m in (64, 128):
        assert stat_stage_rows(m) == m
    for m in range(16, 257, 16):
        assert stat_stage_rows(m) * 4 % 128 == 0 and 0 <= stat_stage_rows(m) - m < 32


def test_smem_bytes():
    """K, V 64 KiB; 2 Q + 2 dO stages of 80 x 128 (80 KiB); 2 dS^T buffers 128 x 80 (40 KiB); the
    unpadded fp32 dQ tile (40 KiB); 4 LSE / D stages of 96 rows (1.5 KiB)."""
    assert _candidate().smem_bytes() == 65536 + 81920 + 40960 + 40960 + 1536 == 230912


# ------------------------------------------------------------------------------- dQ^T partition
def test_dq_t_coords_tile_the_dq_tile_once():
    from flash4.kernels.sm90.bwd_step import dq_t_coords

    tile_m, hdim, threads = 80, 128, 256
    values = tile_m * 64 // 128  # 40 fp32 per thread: its warpgroup's 64 head dims x 80 queries / 128
    seen = {}
    for t in range(threads):
        for v in range(values):
            q, d = dq_t_coords(t, v)
            assert 0 <= q < tile_m and 0 <= d < hdim
            assert (t // 128) * 64 <= d < (t // 128 + 1) * 64  # warpgroup w: head dims [64 w, 64 w + 64)
            assert (q, d) not in seen, (t, v, seen.get((q, d)))
            seen[(q, d)] = (t, v)
    assert len(seen) == tile_m * hdim


def test_dq_t_staging_offsets():
    """The staging offset q * headdim + d (row-major, unpadded) of each value, relative to the
    thread's first, is the same for every thread (static offsets: one base register, immediates in
    the SASS: +512 B for v0, +32 B for v1, +4096 B per v2) and the whole tile is the accumulator's
    rows m_block * 80 .. + 80 in order (one bulk reduce-add of 40960 bytes)."""
    from flash4.kernels.sm90.bwd_step import dq_t_coords

    hdim = 128

    def offset(t, v):
        q, d = dq_t_coords(t, v)
        return q * hdim + d

    rel = [offset(0, v) - offset(0, 0) for v in range(40)]
    for t in range(256):
        assert [offset(t, v) - offset(t, 0) for v in range(40)] == rel
    assert 4 * rel[1] == 512 and 4 * rel[2] == 32 and 4 * rel[4] == 4096
    assert sorted(offset(t, v) for t in range(256) for v in range(40)) == list(range(80 * hdim))


def test_dq_t_store_bank_conflicts():
    """One 32-bit store per value: a warp's 32 lanes hit 8 head dims x 4 queries; at the unpadded
    128-float row pitch the bank is d % 32, so the 4 lanes 4k .. 4k + 3 (same head dim, other
    queries) share one: 4-way bank-conflicted, the price of the unpadded tile the smem budget leaves
    (a 4-float row pad would make it conflict-free but does not fit: BWD_SMEM_BUDGET)."""
    from flash4.kernels.sm90.bwd_step import dq_t_coords

    for warp in range(8):
        for v in range(40):
            banks = [(lambda q, d: (q * 128 + d) % 32)(*dq_t_coords(32 * warp + lane, v)) for lane in range(32)]
            assert max(banks.count(b) for b in set(banks)) == 4
    assert _candidate().smem_bytes() + 80 * 4 * 4 > BWD_SMEM_BUDGET


# --------------------------------------------------------------------------------------- compile
def test_dq_swapab_compile_clean():
    """The candidate compiles for sm_90a with 0 local-memory instructions, wgmma not serialized, and
    the expected HGMMA shapes: per step S^T, dP^T, dQ^T 8 x 64x80x16 each (K 128), dV, dK 5 x
    64x128x16 each (K 80), in the masked and unmasked loops."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import _cuobjdump, extract_cubin, resource_usage

    if _cuobjdump() is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    import re
    import subprocess
    import tempfile

    cubin = extract_cubin(compile_bwd(_candidate()))
    row = resource_usage(cubin)
    assert row["spills"] == 0 and row["stack_bytes"] == 0, row
    assert row["wgmma_serialized"] is False, row
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    shapes = re.findall(r"\bHGMMA\.(\d+x\d+x\d+)\b", sass)
    assert shapes.count("64x80x16") == 2 * 24 and shapes.count("64x128x16") == 2 * 10, set(shapes)
    assert not re.search(r"\b(LDL|STL)\b", sass)
