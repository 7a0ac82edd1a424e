"""Paged prefill candidates (issue 25 items 1/3/6) without a GPU: the gathered path's producer
zero-fill (FwdConfig.gather_zero_fill, on by default for gathered pages), a third K/V stage for paged
configs (with_paged_kv_stages, off by default), their switches, and that the kernels compile for
sm_90a without spills: zero-fill has no consumer zeroing (no VTail barrier, no zero stores), its
cp.async carries the stage's swizzle and the src-size operand, and it cuts the producer's
steady-state instructions. GPU side: tests/gpu/test_paged.py,
test_small_pages.py, test_leak_fwd.py, tools/sanitize.py (racecheck, paged_16); speed: tools/ab_pages.py."""

import dataclasses
import re

import pytest
import torch

from flash4 import env
from flash4.config import (GATHER_ZERO_FILL, HDIMV_PAIRS, PAGE_PREFETCH, PAGED_KV_STAGES, PAGED_KV_STAGES_SMALL_PIECES,
                           SMALL_PAGE_PIECE_ROWS, SUPPORTED_HEADDIMS, fwd_config,
                           paged_layout, paged_page_rows, select_fwd_config, with_seq_layout)
from flash4.config.sm90 import (FWD_SMEM_OVERHEAD, FwdConfig, decode_plan, fwd_smem_fits, gather_policy,
                                with_gather, with_paged_kv_stages)
from flash4.arch import capacity


def _paged(d=128, page=16, dv=None, **kw):
    base = select_fwd_config(d, "bf16", True, headdim_v=dv)
    return with_seq_layout(base, varlen_q=True, seqused_k=True, **paged_layout(page, base.tile_n, 16, False), **kw)


def _request(page: int, d: int = 128):
    from flash4.request import Request

    meta, i32 = dict(device="meta", dtype=torch.bfloat16), dict(device="meta", dtype=torch.int32)
    kc = torch.empty(64, page, 8, d, **meta)
    return Request.varlen(torch.empty(1024, 32, d, **meta), kc, torch.empty_like(kc), torch.empty(5, **i32), None,
                          512, seqused_k=torch.empty(4, **i32), page_table=torch.empty(4, 16, **i32), causal=True)


# ================================================================ policy and configs (pure)
def test_defaults():
    # zero-fill is equivalent bit for bit (V rows past seqlen_k 0, K rows masked) and faster on the
    # H200: on; a third stage gained nothing there (tools/ab_pages.py, 2026-12-02 night): 2
    assert GATHER_ZERO_FILL is True and PAGED_KV_STAGES == 2


def test_switches_need_page_gather_and_stay_out_of_repr():
    tma = _paged(page=64)
    with pytest.raises(AssertionError):
        dataclasses.replace(tma, gather_zero_fill=True)
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, gather_zero_fill=True)
    g = _paged(page=4)
    assert "gather_" not in repr(g)  # off: the repr (compile-cache key) of every earlier config is kept
    on = with_gather(g, True)
    assert on.gather_zero_fill and "gather_zero_fill=True" in repr(on)
    assert with_gather(on, False) == g
    assert with_gather(tma, True) == tma  # TMA page pieces: unchanged


def test_gather_policy_env(monkeypatch):
    monkeypatch.delenv("FLASH4_GATHER_ZERO_FILL", raising=False)
    assert gather_policy() is GATHER_ZERO_FILL
    monkeypatch.setenv("FLASH4_GATHER_ZERO_FILL", "0")
    assert gather_policy() is False
    monkeypatch.setenv("FLASH4_GATHER_ZERO_FILL", "sometimes")
    with pytest.raises(ValueError, match="FLASH4_GATHER_ZERO_FILL='sometimes'"):
        gather_policy()


def test_paged_kv_stages_env(monkeypatch):
    monkeypatch.delenv("FLASH4_PAGED_KV_STAGES", raising=False)
    assert env.paged_kv_stages() is None
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "3")
    assert env.paged_kv_stages() == 3
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "4")
    with pytest.raises(ValueError, match="FLASH4_PAGED_KV_STAGES='4': allowed 2 or 3"):
        env.paged_kv_stages()


def test_smem_model():
    # H200 ncu of the page-16 forward: 164.86 KB of dynamic smem for smem_bytes() = 160 KiB
    assert _paged().smem_bytes() + FWD_SMEM_OVERHEAD == 164864
    three = dataclasses.replace(_paged(), kv_stages=3)
    assert three.smem_bytes() + FWD_SMEM_OVERHEAD == 230400 <= capacity(90).smem_per_block == 232448
    assert fwd_smem_fits(three)


@pytest.mark.parametrize("d, dv", [(d, None) for d in SUPPORTED_HEADDIMS] + list(HDIMV_PAIRS))
@pytest.mark.parametrize("page", [4, 16, 64])
def test_third_stage_where_smem_allows(d, dv, page):
    cfg = _paged(d, page, dv)
    got = with_paged_kv_stages(cfg, 3)
    fits = (d, dv) in ((64, None), (96, None), (128, None), (128, 64), (64, 128))
    assert got.kv_stages == (3 if fits else 2), (d, dv, got.smem_bytes())
    assert fwd_smem_fits(got)
    assert with_paged_kv_stages(cfg, 2) == cfg
    plain = select_fwd_config(d, "bf16", True, headdim_v=dv)
    assert with_paged_kv_stages(plain, 3) == plain  # not paged: unchanged
    persistent = dataclasses.replace(cfg, persistent=True)
    assert with_paged_kv_stages(persistent, 3) == persistent


@pytest.mark.parametrize("page", [3, 16, 32, 128])
def test_fwd_plan_applies_the_switches(page, monkeypatch):
    for name in ("FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES", "FLASH4_PAGE_GATHER_MAX",
                 "FLASH4_PAGE_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    cfg = fwd_config(_request(page), 90).cfg
    gathered = page % 8 != 0 or page <= 16
    small_pieces = not gathered and cfg.page_rows <= SMALL_PAGE_PIECE_ROWS  # 3 stages with the look-ahead
    assert cfg.page_gather == gathered and cfg.page_prefetch == (not gathered and PAGE_PREFETCH)
    assert cfg.kv_stages == (PAGED_KV_STAGES_SMALL_PIECES if small_pieces and PAGE_PREFETCH else 2)
    assert cfg.gather_zero_fill == (gathered and GATHER_ZERO_FILL)
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "3")
    cfg = fwd_config(_request(page), 90).cfg
    assert cfg.kv_stages == 3 and cfg.gather_zero_fill == (gathered and GATHER_ZERO_FILL)
    monkeypatch.setenv("FLASH4_GATHER_ZERO_FILL", "0")
    assert not fwd_config(_request(page), 90).cfg.gather_zero_fill
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "2")
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "0")
    cfg = fwd_config(_request(page), 90).cfg
    assert cfg.kv_stages == 2 and not cfg.page_prefetch


def test_decode_plan_takes_the_gather_policy():
    plan = decode_plan(64, 1, 32, 8, 128, "bf16", True, 4, 8192, 0, 90, 132, page_policy=(16, False),
                       gather_zero_fill=True)
    assert plan.cfg.page_gather and plan.cfg.gather_zero_fill
    plan = decode_plan(64, 1, 32, 8, 128, "bf16", True, 4, 8192, 0, 90, 132, page_policy=(16, False))
    assert plan.cfg.page_gather and not plan.cfg.gather_zero_fill
    plan = decode_plan(64, 1, 32, 8, 128, "bf16", True, 64, 8192, 0, 90, 132, page_policy=(16, False),
                       gather_zero_fill=True)
    assert not plan.cfg.page_gather and not plan.cfg.gather_zero_fill  # TMA pieces: no gather fields


def test_swizzle_helpers():
    pytest.importorskip("cutlass")
    from flash4.kernels.common.paged_gather import apply_swizzle, pointer_swizzle

    assert pointer_swizzle("!cute.ptr<bf16, smem, align<1024>, S<3,4,3>>") == (3, 4, 3)
    with pytest.raises(AssertionError, match="no swizzle"):
        pointer_swizzle("!cute.ptr<bf16, smem, align<16>>")
    for addr in range(0, 4096, 16):  # 128-byte swizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8)
        row, chunk = addr // 128, (addr % 128) // 16
        assert apply_swizzle(addr, (3, 4, 3)) == row * 128 + (chunk ^ (row % 8)) * 16
        assert apply_swizzle(addr, (2, 4, 3)) == addr ^ (((addr >> 7) & 3) << 4)  # 64-byte rows
        assert apply_swizzle(addr, (0, 4, 3)) == addr


# ================================================================ compiled (sm_90a SASS)
BASE = _paged(page=16)  # the gathered page-16 forward as shipped before zero-fill
CANDIDATES = {
    "g": BASE,
    "g_zf": with_gather(BASE, True),
    "g_zf_s3": dataclasses.replace(with_gather(BASE, True), kv_stages=3),
    "d96_zf": with_gather(_paged(96, 4), True),  # 4 threads per row, 64-byte swizzle
    "tma32_s3": dataclasses.replace(_paged(page=32), kv_stages=3),
    "d256_zf": with_gather(_paged(256, 4), True),  # 80-key blocks: 5 passes
    "d64_zf_s3": dataclasses.replace(with_gather(_paged(64, 4), True), kv_stages=3),  # 3 warpgroups
    "decode_d64_page1_zf": decode_plan(8, 1, 32, 8, 64, "bf16", False, 1, 8192, 0, 90, 132,
                                       gather_zero_fill=True).cfg,  # 1 warpgroup, split-KV
}


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("cutlass")
    from cpu_helpers import compiled_row

    from flash4.compile.cache import compile_fwd

    return {name: compiled_row(compile_fwd(cfg), cfg) for name, cfg in CANDIDATES.items()}


def producer_segments(sass: str) -> list[int]:
    """Instruction counts of the SASS between consecutive cp.async commits (ARRIVES.LDGSTSBAR): the
    gathered producer's first K load, then one K and one V load of its steady-state loop, then the
    tile's last V."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    marks = [i for i, ln in enumerate(lines) if "ARRIVES.LDGSTSBAR" in ln]
    return [b - a for a, b in zip([0] + marks, marks)]


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_candidates_compile_clean(rows, name, compiled_clean):
    compiled_clean(rows[name])
    sass = rows[name]["sass"]
    if CANDIDATES[name].page_gather:
        assert "LDGSTS" in sass
    if CANDIDATES[name].gather_zero_fill:
        from flash4.kernels.common.barriers import NamedBarrierFwd

        # no consumer writes a stage: no VTail barrier, no 16-byte zero stores
        assert f"BAR.SYNC.DEFER_BLOCKING {hex(int(NamedBarrierFwd.VTail))}," not in sass
        assert not re.search(r"STS\.128 \[[^]]*\], RZ", sass)
        # cp.async with src-size: ptxas's zero-fill form (a predicate operand), and the swizzle xor
        assert re.search(r"LDGSTS\.E\.BYPASS\.128 \[[^]]*\], desc\[[^]]*\]\[[^]]*\], P\d", sass)
        assert re.search(r"LOP3\.LUT R\d+, R\d+, 0x[37]0, R\d+, 0x78", sass)


def test_zero_v_tail_still_there_without_zero_fill(rows):
    from flash4.kernels.common.barriers import NamedBarrierFwd

    assert f"BAR.SYNC.DEFER_BLOCKING {hex(int(NamedBarrierFwd.VTail))}," in rows["g"]["sass"]


def test_zero_fill_cuts_the_producer_loop(rows):
    """Steady-state K + V loads of the d128 page-16 producer (SASS between cp.async commits, 2026-12-02):
    507 instructions without zero-fill, 429 with it (ptxas folds the zero-fill into LDGSTS's predicate
    operand; no branch per row); 16 cp.async and 16 shuffles per load either way."""
    base = producer_segments(rows["g"]["sass"])
    lean = producer_segments(rows["g_zf"]["sass"])
    assert len(base) == len(lean) == 4
    assert lean[1] + lean[2] < base[1] + base[2], (base, lean)


def test_switches_are_plan_variables():
    """flash4.memo keys prepared calls by the plan's environment: a switch flipped between calls
    (tools, GPU tests) must reach the plan."""
    assert {"FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES"} <= set(env.PLAN_VARIABLES)
