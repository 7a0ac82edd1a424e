"""Paged prefill candidates (issue 25 items 1/3/6) without a GPU: the gathered path's producer
zero-fill (FwdConfig.gather_zero_fill, on by default for gathered pages), a third K/V stage for paged
configs (with_paged_kv_stages, off by default), their switches, and that the kernels compile for
sm_90a without spills: zero-fill has no consumer zeroing (no VTail barrier, no zero stores), its
cp.async carries the stage's swizzle and the src-size operand, and it cuts the producer's
steady-state instructions. GPU side: tests/gpu/test_paged.py,
test_small_pages.py, test_leak_fwd.py, tools/sanitize.py (racecheck, paged_16); speed: tools/ab_pages.py."""

import dataclasses
import math
import re

import pytest
import torch
from cpu_helpers import expected_prefill_paging

from flash4 import env
from flash4.config import (GATHER_ZERO_FILL, HDIMV_PAIRS, PAGE_GATHER_MAX, PAGE_PIECES_ALL_WARPS,
                           PAGE_PIECES_ALL_WARPS_MAX, PAGE_PREFETCH, PAGED_KV_STAGES, PAGED_KV_STAGES_SMALL_PIECES,
                           PREFILL_PAGE_GATHER_MAX, SMALL_PAGE_PIECE_ROWS, SMALL_PIECE_MIN_HEADDIM, SMALL_PIECE_ROWS,
                           SUPPORTED_HEADDIMS, fwd_config, paged_layout, select_fwd_config, with_seq_layout)
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


PAGE_SWITCHES = ("FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES", "FLASH4_PAGE_GATHER_MAX",
                 "FLASH4_PAGE_PREFETCH", "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_DIVIDE_FREE",
                 "FLASH4_PAGE_ROW_SHUFFLE")


@pytest.mark.parametrize("row_shuffle", [None, "0"])
@pytest.mark.parametrize("all_warps", [None, "0"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [3, 8, 16, 24, 32, 48, 128])
def test_fwd_plan_applies_the_switches(page, d, all_warps, row_shuffle, monkeypatch):
    """all_warps None: the shipped prefill policy (flash4.config.PAGE_PIECES_ALL_WARPS: TMA pieces of <= 32
    rows from the four producer warps, 2 stages; with flash4.config.PAGE_ROW_SHUFFLE, 8-row pieces by TMA
    at every head dim and the pieces of pages holding several (24; 48 below d128) with their row block
    shuffled, without the division); row_shuffle "0": FLASH4_PAGE_ROW_SHUFFLE=0, the rule before it (8-row
    pieces gathered below d128, the division for pages of several pieces); all_warps "0":
    FLASH4_PAGE_PIECES_ALL_WARPS=0, the previous rules (gathered up to page 16, one warp, 3 stages for
    pieces of <= 32 rows; no row shuffle either way). Expected values: cpu_helpers.expected_prefill_paging."""
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if all_warps is not None:
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", all_warps)
    if row_shuffle is not None:
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
    flag = None if all_warps is None else False
    shuffle_flag = None if row_shuffle is None else False
    cfg = fwd_config(_request(page, d), 90).cfg
    want = expected_prefill_paging(page, cfg.tile_n, d, all_warps=flag, row_shuffle=shuffle_flag)
    gathered, pieces4 = want["page_gather"], want["page_pieces_all_warps"]
    assert (cfg.page_rows, cfg.page_gather, cfg.page_prefetch, cfg.page_pieces_all_warps, cfg.page_divide_free,
            cfg.page_row_shuffle) == (want["page_rows"], gathered, want["page_prefetch"], pieces4,
                                      want["page_divide_free"], want["page_row_shuffle"])
    # the row shuffle, spelled out: the four-warp pieces of pages 24 (8-row pieces, every head dim) and 48
    # (16-row pieces, below d128) by default; nowhere with either switch off
    shuffled = all_warps is None and row_shuffle is None and (page == 24 or (page == 48 and d < 128))
    assert cfg.page_row_shuffle == shuffled
    # whole-page TMA pieces (8, 16, 32, 128; page 8 at d64 only with the row-shuffle rule) and the shuffled
    # pieces skip the division; not 24's / 48's otherwise
    assert cfg.page_divide_free == (not gathered and (cfg.page_rows == page or shuffled))
    assert cfg.page_prefetch == (not gathered and PAGE_PREFETCH)
    small_pieces = not gathered and cfg.page_rows <= SMALL_PAGE_PIECE_ROWS  # 3 stages with the look-ahead, one warp
    assert cfg.kv_stages == want["stages"] == (PAGED_KV_STAGES_SMALL_PIECES if small_pieces and PAGE_PREFETCH
                                               and not pieces4 else PAGED_KV_STAGES)  # d64 / d128 fit 3
    assert cfg.gather_zero_fill == (gathered and GATHER_ZERO_FILL)
    if page == 16:  # spelled out: the default four-warp pieces, or gathered rows with the switch off
        assert (cfg.page_gather, cfg.page_rows, cfg.page_pieces_all_warps) == (
            (False, 16, True) if all_warps is None else (True, 0, False))
    if page in (8, 24):  # 8-row pieces: by four warps at every head dim by default, at d128 only with
        # FLASH4_PAGE_ROW_SHUFFLE=0; one warp at page 24 with FLASH4_PAGE_PIECES_ALL_WARPS=0
        assert (cfg.page_gather, cfg.page_rows, cfg.page_pieces_all_warps) == (
            (False, 8, True) if all_warps is None and row_shuffle is None else
            ((True, 0, False) if d < 128 else (False, 8, True)) if all_warps is None else
            ((True, 0, False) if page == 8 else (False, 8, False)))
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "3")
    cfg = fwd_config(_request(page, d), 90).cfg
    assert cfg.kv_stages == 3 and cfg.gather_zero_fill == (gathered and GATHER_ZERO_FILL)
    assert (cfg.page_gather, cfg.page_pieces_all_warps, cfg.page_divide_free, cfg.page_row_shuffle) == (
        gathered, pieces4, want["page_divide_free"], shuffled)  # stages only
    monkeypatch.setenv("FLASH4_GATHER_ZERO_FILL", "0")
    assert not fwd_config(_request(page, d), 90).cfg.gather_zero_fill
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "2")
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "0")
    cfg = fwd_config(_request(page, d), 90).cfg
    # no look-ahead: no four-warp pieces and no head-dim rule, the gather limit back to PAGE_GATHER_MAX
    assert cfg.kv_stages == 2 and not cfg.page_prefetch and not cfg.page_pieces_all_warps
    assert cfg.page_gather == (page % 8 != 0 or page <= PAGE_GATHER_MAX)
    no_look_ahead = expected_prefill_paging(page, cfg.tile_n, d, all_warps=flag, prefetch=False,
                                            row_shuffle=shuffle_flag)
    assert cfg.page_gather == no_look_ahead["page_gather"]
    assert cfg.page_divide_free == no_look_ahead["page_divide_free"]  # TMA pieces without the look-ahead too
    # one warp: no row shuffle; whole pages only skip the division
    assert not cfg.page_row_shuffle and not no_look_ahead["page_row_shuffle"]
    assert cfg.page_divide_free == (not cfg.page_gather and cfg.page_rows == page)


# The paged prefill spelled out for pages 8..64 at d64 / d128 (tile_n 128): (page_rows, four warps, K/V
# stages, page_row_shuffle), or None for gathered rows, by (FLASH4_PAGE_PIECES_ALL_WARPS,
# FLASH4_PAGE_ROW_SHUFFLE, head dim). Default: the H200 A/B of 2026-12-05 (flash4.config, above
# PAGE_PIECES_ALL_WARPS) with the H100 A/B of the row shuffle (flash4.config.PAGE_ROW_SHUFFLE: 8-row pieces
# by TMA at every head dim, the pieces of pages 24 / 48 shuffled below d128, page 24's 8-row pieces at
# d128 too); row shuffle "0": the rule before it (8-row pieces gathered below d128, no shuffle); all warps
# "0": the rules before the four warps (the row shuffle needs them: the same plan either way).
_BEFORE_SHUFFLE = {
    128: {8: (8, True, 2, False), 16: (16, True, 2, False), 24: (8, True, 2, False), 32: (32, True, 2, False),
          48: (16, True, 2, False), 64: (64, False, 2, False)},
    64: {8: None, 16: (16, True, 2, False), 24: None, 32: (32, True, 2, False), 48: (16, True, 2, False),
         64: (64, False, 2, False)},
}
_ONE_WARP = {8: None, 16: None, 24: (8, False, 3, False), 32: (32, False, 3, False), 48: (16, False, 3, False),
             64: (64, False, 2, False)}
PREFILL_PAGING = {
    (None, None, 128): {8: (8, True, 2, False), 16: (16, True, 2, False), 24: (8, True, 2, True),
                        32: (32, True, 2, False), 48: (16, True, 2, False), 64: (64, False, 2, False)},
    (None, None, 64): {8: (8, True, 2, False), 16: (16, True, 2, False), 24: (8, True, 2, True),
                       32: (32, True, 2, False), 48: (16, True, 2, True), 64: (64, False, 2, False)},
    (None, "0", 128): _BEFORE_SHUFFLE[128],
    (None, "0", 64): _BEFORE_SHUFFLE[64],
    ("0", None, 128): _ONE_WARP, ("0", "0", 128): _ONE_WARP, ("0", None, 64): _ONE_WARP, ("0", "0", 64): _ONE_WARP,
}


@pytest.mark.parametrize("row_shuffle", [None, "0"])
@pytest.mark.parametrize("all_warps", [None, "0"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [8, 16, 24, 32, 48, 64])
def test_prefill_page_policy(page, d, all_warps, row_shuffle, monkeypatch):
    """The paged prefill plan of pages 8 / 16 / 24 / 32 / 48 / 64 at d64 and d128, default, with
    FLASH4_PAGE_ROW_SHUFFLE=0 and with FLASH4_PAGE_PIECES_ALL_WARPS=0 (PREFILL_PAGING);
    cpu_helpers.expected_prefill_paging agrees."""
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if all_warps is not None:
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", all_warps)
    if row_shuffle is not None:
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
    cfg = fwd_config(_request(page, d), 90).cfg
    spelled = PREFILL_PAGING[all_warps, row_shuffle, d][page]
    assert (None if cfg.page_gather else (cfg.page_rows, cfg.page_pieces_all_warps, cfg.kv_stages,
                                          cfg.page_row_shuffle)) == spelled
    if spelled is None:  # gathered rows: the producer zero-fill, 2 stages
        assert (cfg.page_rows, cfg.page_prefetch, cfg.kv_stages, cfg.gather_zero_fill, cfg.page_divide_free,
                cfg.page_row_shuffle) == (0, False, 2, GATHER_ZERO_FILL, False, False)
    else:  # TMA pieces with the look-ahead
        assert cfg.page_prefetch and not cfg.gather_zero_fill
    want = expected_prefill_paging(page, cfg.tile_n, d, all_warps=None if all_warps is None else False,
                                   row_shuffle=None if row_shuffle is None else False)
    assert (None if want["page_gather"] else (want["page_rows"], want["page_pieces_all_warps"], want["stages"],
                                              want["page_row_shuffle"])) == spelled
    # pieces that are whole pages, and the shuffled pieces (page 24's 8-row pieces; page 48's 16-row pieces
    # below d128), skip the division; not page 24's / 48's pieces otherwise
    assert cfg.page_divide_free == want["page_divide_free"] == (spelled is not None and (
        spelled[0] == page or spelled[3]))


def test_prefill_page_policy_env(monkeypatch):
    """prefill_page_policy() under the switches: the defaults (with flash4.config.PAGE_ROW_SHUFFLE no
    small-piece rule: 8-row pieces by TMA at every head dim); FLASH4_PAGE_ROW_SHUFFLE=0 or
    FLASH4_PAGE_DIVIDE_FREE=0 (the row shuffle needs it): the small-piece rule back;
    FLASH4_PAGE_PIECES_ALL_WARPS=0 (the previous rules); FLASH4_PAGE_GATHER_MAX set explicitly wins and
    turns the head-dim rule off (the four warps stay); no look-ahead, no four warps. Decode steps keep
    page_policy() (test_config_plans.py). plan(): (page_rows, four warps, K/V stages, page_row_shuffle)."""
    from flash4.config import PAGE_ROW_SHUFFLE, ROW_SHUFFLE_MIN_HEADDIM
    from flash4.config.sm90 import page_row_shuffle_policy, prefill_page_policy

    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert PAGE_PIECES_ALL_WARPS is True and PAGE_PREFETCH is True and PREFILL_PAGE_GATHER_MAX == 0
    assert PAGE_PIECES_ALL_WARPS_MAX == SMALL_PAGE_PIECE_ROWS == 32 and PAGE_GATHER_MAX == 16
    assert SMALL_PIECE_ROWS == 16 and SMALL_PIECE_MIN_HEADDIM == 128
    assert PAGE_ROW_SHUFFLE is True and ROW_SHUFFLE_MIN_HEADDIM == 128 and page_row_shuffle_policy() is True
    assert prefill_page_policy() == (0, True, True, False)
    # row_shuffle=False (the plan's, at head dims whose divide-free pieces spill): the small-piece rule kept
    assert prefill_page_policy(row_shuffle=False) == (0, True, True, True)

    def plan(page, d=128):
        cfg = fwd_config(_request(page, d), 90).cfg
        return None if cfg.page_gather else (cfg.page_rows, cfg.page_pieces_all_warps, cfg.kv_stages,
                                             cfg.page_row_shuffle)

    assert plan(8, 64) == (8, True, 2, False) and plan(24, 64) == (8, True, 2, True)
    assert plan(48, 64) == (16, True, 2, True) and plan(48) == (16, True, 2, False) and plan(24) == (8, True, 2, True)
    monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "1")  # set to the default: the same
    assert prefill_page_policy() == (0, True, True, False) and plan(8, 64) == (8, True, 2, False)
    for off in ("FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_PAGE_DIVIDE_FREE"):  # the small-piece rule back, no shuffle
        for name in PAGE_SWITCHES:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(off, "0")
        assert page_row_shuffle_policy() is False, off
        assert prefill_page_policy() == (0, True, True, True), off
        assert plan(8, 64) is None and plan(24, 64) is None and plan(48, 64) == (16, True, 2, False), off
        assert plan(8) == (8, True, 2, False) and plan(24) == (8, True, 2, False), off
        monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "16")  # explicit: no small-piece rule, still no shuffle
        assert prefill_page_policy() == (16, True, True, False), off
        assert plan(24, 64) == (8, True, 2, False), off
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "1")  # set to the default: the same
    assert prefill_page_policy() == (0, True, True, False) and plan(8, 64) == (8, True, 2, False)
    assert plan(16, 64) == (16, True, 2, False)
    monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")
    assert prefill_page_policy() == (PAGE_GATHER_MAX, True, False, False)
    assert plan(16) is None and plan(32) == (32, False, 3, False) and plan(24, 64) == (8, False, 3, False)
    monkeypatch.delenv("FLASH4_PAGE_PIECES_ALL_WARPS")
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "16")  # explicit: page 16 gathered again, page 24 at d64 not
    assert prefill_page_policy() == (16, True, True, False)
    assert plan(16) is None and plan(24, 64) == (8, True, 2, True) and plan(32, 64) == (32, True, 2, False)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "0")  # explicit 0: 8-row pieces at d64 too, by four warps
    assert prefill_page_policy() == (0, True, True, False)
    assert plan(8, 64) == (8, True, 2, False) and plan(16) == (16, True, 2, False)
    assert plan(64) == (64, False, 2, False) and plan(24, 64) == (8, True, 2, True)
    monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")  # the previous one-warp pieces, 3 stages, no shuffle
    assert prefill_page_policy() == (0, True, False, False)
    assert plan(16) == (16, False, PAGED_KV_STAGES_SMALL_PIECES, False) and plan(8, 64) == (8, False, 3, False)
    assert plan(24, 64) == (8, False, 3, False)
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "0")  # the four warps need the look-ahead: the previous rules
    assert prefill_page_policy() == (PAGE_GATHER_MAX, False, False, False)
    assert plan(16) is None and plan(24, 64) == (8, False, 2, False) and plan(32) == (32, False, 2, False)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_prefill_paged_layout(d, monkeypatch):
    """prefill_paged_layout (pure) for pages 8..256: paged_layout of the policy's (gather_max, prefetch),
    with pages whose pieces have < SMALL_PIECE_ROWS rows gathered below SMALL_PIECE_MIN_HEADDIM when the
    small-piece rule is on (FLASH4_PAGE_ROW_SHUFFLE=0: (0, True, True, True)); the policy's all_warps does
    not change the layout (with_page_pieces_all_warps). The default policy (flash4.config.PAGE_ROW_SHUFFLE)
    gathers no multiple of 8."""
    from flash4.config.sm90 import prefill_page_policy, prefill_paged_layout, with_page_pieces_all_warps

    tile_n = select_fwd_config(d, "bf16", True).tile_n
    assert tile_n == (80 if d == 256 else 128)
    gathered_by_rule = {}
    for gather_max, prefetch, small_piece_rule in ((0, True, True), (0, True, False), (16, True, False),
                                                   (16, False, False), (8, True, True), (16, True, True)):
        for page in range(8, 257):
            layouts = [prefill_paged_layout(page, tile_n, d, (gather_max, prefetch, all_warps, small_piece_rule))
                       for all_warps in (True, False)]
            assert layouts[0] == layouts[1], (page, gather_max, small_piece_rule)
            rows = math.gcd(page, tile_n)
            gathered = page % 8 != 0 or page <= gather_max or (small_piece_rule and rows < 16 and d < 128)
            want = ({"page_rows": 0, "page_gather": True} if gathered else
                    {"page_rows": rows, "page_gather": False, "page_prefetch": prefetch})
            assert layouts[0] == want, (page, gather_max, prefetch, small_piece_rule)
            if not small_piece_rule:
                assert layouts[0] == paged_layout(page, tile_n, gather_max, prefetch)
            if (gather_max, small_piece_rule) == (0, True) and page % 8 == 0 and layouts[0]["page_gather"]:
                gathered_by_rule.setdefault(d, []).append(page)
    # the small-piece rule's policy gathers exactly the pages of 8-row pieces (8, 24, 40, ...) below d128, no
    # multiple of 8 at d128 / d256 (d256's 80-key blocks give 8-row pieces too, pages 8, 24, 56, ...: TMA there)
    assert gathered_by_rule.get(d, []) == (list(range(8, 257, 16)) if d < 128 else [])
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for row_shuffle, policy in ((None, (0, True, True, False)), ("0", (0, True, True, True))):
        if row_shuffle is not None:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
        assert prefill_page_policy() == policy
        gathered = [page for page in range(8, 257, 8) if prefill_paged_layout(page, tile_n, d, policy)["page_gather"]]
        assert gathered == ([] if row_shuffle is None else gathered_by_rule.get(d, [])), row_shuffle
    # with_page_pieces_all_warps: TMA pieces of <= PAGE_PIECES_ALL_WARPS_MAX rows with the look-ahead only
    base = with_seq_layout(select_fwd_config(d, "bf16", True), varlen_q=True, seqused_k=True)
    for page in (8, 16, 32, 40, 48, 64, 128):
        for prefetch in (True, False):
            cfg = with_seq_layout(base, **paged_layout(page, tile_n, 0, prefetch))
            four = with_page_pieces_all_warps(cfg, True)
            assert four.page_pieces_all_warps == (prefetch and cfg.page_rows <= PAGE_PIECES_ALL_WARPS_MAX)
            assert with_page_pieces_all_warps(cfg, False) == cfg
            if not four.page_pieces_all_warps:
                assert four == cfg


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
    assert {"FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES", "FLASH4_PAGE_PIECES_ALL_WARPS",
            "FLASH4_PAGE_GATHER_MAX", "FLASH4_PAGE_PREFETCH", "FLASH4_PAGE_DIVIDE_FREE",
            "FLASH4_PAGE_ROW_SHUFFLE"} <= set(env.PLAN_VARIABLES)
