"""FwdConfig.page_divide_free on the CPU (no GPU, nothing compiled): TMA page pieces that are whole
pages (page_rows == page_size: pages 8..128 at tile_n 128) find their page without the run-time
division by the page size, on by default since 2026-12-05 night (flash4.config.PAGE_DIVIDE_FREE,
FLASH4_PAGE_DIVIDE_FREE=0 turns it off). The pure helper with_page_divide_free, the switch
(FLASH4_FWD_SWITCHES=page_divide_free), and the plans of the varlen door's paged prefill and of a
decode step. Its SASS: tests/cpu/test_paged_prefill_compile.py::test_page_divide_free_sass; GPU:
tests/gpu/test_speed_switches.py::test_page_divide_free; speed: tools/ab_pages.py variants df / div / nos.
With flash4.config.PAGE_ROW_SHUFFLE the paged prefill's four-warp pieces of pages holding several get
page_divide_free with page_row_shuffle too (FLASH4_PAGE_ROW_SHUFFLE=0, or FLASH4_PAGE_DIVIDE_FREE=0, turns
that off): test_page_row_shuffle_cpu.py."""

import dataclasses
import os
import sys

import pytest
import torch
from cpu_helpers import expected_page_divide_free, expected_prefill_paging

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ab_pages  # noqa: E402  (tools/: the varlen door's paged prefill plan for a page size)
from flash4 import env  # noqa: E402
from flash4.config import (COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS,  # noqa: E402
                           GATHER_ZERO_FILL, PAGE_DIVIDE_FREE, PAGE_GATHER_MAX, PAGE_PREFETCH,
                           FwdConfig, fwd_config, paged_layout, select_fwd_config, shipped_fwd_configs,
                           with_seq_layout)
from flash4.config.sm90 import (decode_plan, page_divide_free_policy, with_fwd_switches,  # noqa: E402
                                with_page_divide_free)
from flash4.constants import FWD_SPEED_SWITCHES  # noqa: E402
from flash4.geometry import window_sides  # noqa: E402
from flash4.request import DECODE, Request, SeqSpec  # noqa: E402

BF16, I32 = torch.bfloat16, torch.int32
PAGE_SWITCHES = ("FLASH4_PAGE_DIVIDE_FREE", "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_GATHER_MAX",
                 "FLASH4_PAGE_PREFETCH", "FLASH4_PAGED_KV_STAGES", "FLASH4_GATHER_ZERO_FILL", "FLASH4_FWD_SWITCHES",
                 "FLASH4_PAGE_ROW_SHUFFLE")
PAGES = (8, 16, 24, 32, 48, 64, 128, 256)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _tma(d=128, page_rows=16, prefetch=True, **kw):
    """A varlen paged config loading TMA pieces of page_rows rows."""
    return with_seq_layout(select_fwd_config(d, "bf16", True), varlen_q=True, seqused_k=True, page_rows=page_rows,
                           page_prefetch=prefetch, **kw)


def _gathered(d=128):
    return with_seq_layout(select_fwd_config(d, "bf16", True), varlen_q=True, seqused_k=True, page_gather=True)


# ================================================================ defaults, environment, config field
def test_default_and_env(monkeypatch):
    """PAGE_DIVIDE_FREE is on; FLASH4_PAGE_DIVIDE_FREE (a plan variable: the prepared calls key on it)
    turns it off with 0 and back on with 1; page_divide_free is a forward speed switch."""
    assert PAGE_DIVIDE_FREE is True
    assert env.page_divide_free() is None and page_divide_free_policy() is True
    for value, want in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", value)
        assert env.page_divide_free() is want and page_divide_free_policy() is want, value
    assert "FLASH4_PAGE_DIVIDE_FREE" in env.PLAN_VARIABLES
    assert FWD_SPEED_SWITCHES.index("page_row_shuffle") == FWD_SPEED_SWITCHES.index("page_divide_free") + 1


def test_field_off_out_of_repr_and_tma_pieces_only():
    """Off by default and out of the repr (the compile-cache key of every earlier config is kept); on,
    in the repr and round-tripping; refused without TMA page pieces (dense, packed, gathered)."""
    cfg = _tma()
    assert not cfg.page_divide_free and "page_divide_free" not in repr(cfg)
    on = dataclasses.replace(cfg, page_divide_free=True)
    assert repr(on).endswith(", page_divide_free=True)") and eval(repr(on)) == on
    assert not any(c.page_divide_free for c in shipped_fwd_configs())  # dense configs: no page table
    for other in (select_fwd_config(128, "bf16", True), _gathered(),
                  with_seq_layout(select_fwd_config(64), varlen_q=True, varlen_k=True)):
        with pytest.raises(AssertionError):
            dataclasses.replace(other, page_divide_free=True)
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, page_divide_free=True)


# ================================================================ with_page_divide_free (pure)
@pytest.mark.parametrize("page_rows", [8, 16, 32, 64, 128])
def test_with_page_divide_free(page_rows):
    """with_page_divide_free(cfg, page_size, on): page_divide_free set (and nothing else changed) exactly
    when on and 0 < cfg.page_rows == page_size; else cfg itself, never turned off."""
    for prefetch in (True, False):
        cfg = _tma(page_rows=page_rows, prefetch=prefetch)
        for page in range(1, 513):
            got = with_page_divide_free(cfg, page, True)
            if page == page_rows:
                assert got == dataclasses.replace(cfg, page_divide_free=True), page
                assert with_page_divide_free(got, page, True) == got  # idempotent
            else:
                assert got == cfg, page
            assert with_page_divide_free(cfg, page, False) == cfg
            assert got.page_divide_free == expected_page_divide_free(page, page_rows, True)
        on = dataclasses.replace(cfg, page_divide_free=True)
        assert with_page_divide_free(on, 2 * page_rows, False) == with_page_divide_free(on, 3 * page_rows, True) == on
    for cfg in (_gathered(), select_fwd_config(128, "bf16", True), _tma(page_rows=0, prefetch=False)):
        for page in (0, 8, 16, 64, 128):
            assert with_page_divide_free(cfg, page, True) == cfg, (cfg, page)


def test_switch_applies_to_tma_pieces_only():
    """FLASH4_FWD_SWITCHES=page_divide_free (with_fwd_switches): set on any config of TMA page pieces
    (the kernel keeps the division behind a run-time branch for pages of several pieces), never on
    dense, packed or gathered configs."""
    for rows in (8, 16, 128):
        cfg = _tma(page_rows=rows)
        assert with_fwd_switches(cfg, ("page_divide_free",)) == dataclasses.replace(cfg, page_divide_free=True)
        assert with_fwd_switches(cfg, ()) == cfg
    for cfg in (select_fwd_config(128, "bf16", True), _gathered(),
                with_seq_layout(select_fwd_config(64), varlen_q=True, varlen_k=True)):
        assert with_fwd_switches(cfg, ("page_divide_free",)) == cfg


def test_switch_reaches_the_plan(monkeypatch):
    """FLASH4_FWD_SWITCHES=page_divide_free turns it on for the paged prefill of pages of several
    pieces (page 48: 16-row pieces), which the default leaves off."""
    plain = ab_pages.shipped_config(48, headdim=128, causal=True)
    assert plain.page_rows == 16 and not plain.page_divide_free
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "page_divide_free")
    assert ab_pages.shipped_config(48, headdim=128, causal=True) == dataclasses.replace(plain, page_divide_free=True)


# ================================================================ the plans
# The paged prefill's pieces without the division, spelled out: tile_n 128 at d64 / d128, so pieces of
# gcd(page, 128) rows. Whole pages (page_divide_free: 8, 16, 32, 64, 128; d64's page 8 by TMA since the
# row-shuffle rule, flash4.config.PAGE_ROW_SHUFFLE), and the four-warp pieces of pages holding several,
# their row block shuffled (page_divide_free and page_row_shuffle: page 24's 8-row pieces at every head
# dim, page 48's 16-row pieces below d128); not page 48 at d128 nor page 256 (one warp's 128-row pieces).
PREFILL_WHOLE_PAGES = {64: {8, 16, 32, 64, 128}, 128: {8, 16, 32, 64, 128}}
PREFILL_ROW_SHUFFLE = {64: {24, 48}, 128: {24}}
PREFILL_DIVIDE_FREE = {d: PREFILL_WHOLE_PAGES[d] | PREFILL_ROW_SHUFFLE[d] for d in (64, 128)}
# Without the row shuffle (FLASH4_PAGE_ROW_SHUFFLE=0, or FLASH4_PAGE_DIVIDE_FREE=0: it needs that switch)
# the small-piece rule gathers the 8-row pieces below d128 again.
PREFILL_GATHERED_WITHOUT_SHUFFLE = {64: {8, 24}, 128: set()}
# Shuffled at every supported head dim (causal, GQA 8 / 2): d192's 112-key and d256's 80-key blocks cut
# page 24 into 8-row pieces (shuffled) and pages 32..256 into 16-row pieces (not at those head dims).
ROW_SHUFFLE_PAGES = {64: {24, 48}, 96: {24, 48}, 128: {24}, 192: {24}, 256: {24}}
# A decode step keeps page_policy() (pages of <= PAGE_GATHER_MAX = 16 rows gathered).
DECODE_DIVIDE_FREE = {64: {32, 64, 128}, 128: {32, 64, 128}}


@pytest.mark.parametrize("flag", [None, "0", "1"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", PAGES)
def test_paged_prefill_plan(monkeypatch, page, d, causal, flag):
    """flash_attn_varlen_func's paged prefill plan (meta tensors, tools/ab_pages.py shipped_config): on
    for the TMA pieces that are whole pages (8, 16, 32, 64, 128) and, with page_row_shuffle, for the
    shuffled pieces (24; 48 at d64); not 48 at d128, 256, nor gathered pages. FLASH4_PAGE_DIVIDE_FREE=0:
    off everywhere, the row shuffle too (it needs the switch), so the plan is FLASH4_PAGE_ROW_SHUFFLE=0's
    (d64's 8-row pieces gathered again) with page_divide_free off; "1": the default."""
    default = ab_pages.shipped_config(page, headdim=d, causal=causal)
    if flag is not None:
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", flag)
    cfg = ab_pages.shipped_config(page, headdim=d, causal=causal)
    want = expected_prefill_paging(page, cfg.tile_n, d, divide_free=None if flag is None else flag == "1")
    assert cfg.tile_n == 128 and (cfg.page_rows, cfg.page_gather) == (want["page_rows"], want["page_gather"])
    assert cfg.page_gather == (flag == "0" and page in PREFILL_GATHERED_WITHOUT_SHUFFLE[d])
    assert cfg.page_divide_free == want["page_divide_free"] == (flag != "0" and page in PREFILL_DIVIDE_FREE[d])
    assert cfg.page_row_shuffle == want["page_row_shuffle"] == (flag != "0" and page in PREFILL_ROW_SHUFFLE[d])
    if cfg.page_divide_free:  # whole pages, or the shuffled pieces of pages holding several
        assert not cfg.page_gather and (cfg.page_rows == page) == (not cfg.page_row_shuffle)
    assert default.page_divide_free == (page in PREFILL_DIVIDE_FREE[d])
    assert default.page_row_shuffle == (page in PREFILL_ROW_SHUFFLE[d])
    if flag == "0":  # the plan without the row shuffle, page_divide_free off
        monkeypatch.delenv("FLASH4_PAGE_DIVIDE_FREE")
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "0")
        before = ab_pages.shipped_config(page, headdim=d, causal=causal)
        assert cfg == dataclasses.replace(before, page_divide_free=False)
        assert not before.page_row_shuffle and before.page_divide_free == (
            page in PREFILL_WHOLE_PAGES[d] - PREFILL_GATHERED_WITHOUT_SHUFFLE[d])
    else:
        assert cfg == default


@pytest.mark.parametrize("flag", [None, "0"])
@pytest.mark.parametrize("page", PAGES)
def test_paged_prefill_plan_other_head_dims(monkeypatch, page, flag):
    """At every supported head dim: whole-page TMA pieces (d192's 112-key and d256's 80-key blocks cut
    pages 32 / 128 into 16-row pieces: not there) and the shuffled pieces (ROW_SHUFFLE_PAGES) exactly;
    FLASH4_PAGE_DIVIDE_FREE=0: neither, 8-row pieces gathered below d128 again."""
    from flash4.config import SUPPORTED_HEADDIMS

    if flag is not None:
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", flag)
    assert set(ROW_SHUFFLE_PAGES) == set(SUPPORTED_HEADDIMS)
    for d in SUPPORTED_HEADDIMS:
        cfg = ab_pages.shipped_config(page, headdim=d, causal=True, nheads=8, nheads_k=2)
        shuffled = flag is None and page in ROW_SHUFFLE_PAGES[d]
        assert cfg.page_row_shuffle == shuffled, (d, cfg)
        assert cfg.page_divide_free == (flag is None and not cfg.page_gather and (
            cfg.page_rows == page or shuffled)), (d, cfg)
        assert cfg.page_gather == (flag == "0" and d < 128 and page in (8, 24)), (d, cfg)
        want = expected_prefill_paging(page, cfg.tile_n, d, divide_free=flag != "0")
        assert (cfg.page_gather, cfg.page_divide_free, cfg.page_row_shuffle) == (
            want["page_gather"], want["page_divide_free"], want["page_row_shuffle"]), d


def _decode_step(page: int, d: int, window=None):
    seq = SeqSpec(DECODE, seqused_k=torch.empty(4, device="meta", dtype=I32),
                  page_table=torch.empty(4, 16, device="meta", dtype=I32))
    kc = torch.empty(64, page, 8, d, device="meta", dtype=BF16)
    q = torch.empty(4, 1, 32, d, device="meta", dtype=BF16)
    return Request.kvcache(q, kc, torch.empty_like(kc), causal=True, window_size=window).with_seq(seq)


@pytest.mark.parametrize("flag", [None, "0"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", PAGES)
def test_decode_plan(monkeypatch, page, d, flag):
    """A paged decode step (flash_attn_with_kvcache's plan): on for the TMA pieces that are whole pages
    (32, 64, 128: pages <= 16 are gathered there), off with FLASH4_PAGE_DIVIDE_FREE=0; the plan is
    decode_plan(..., divide_free=page_divide_free_policy()), whose default (divide_free=False) leaves it off."""
    if flag is not None:
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", flag)
    plan = fwd_config(_decode_step(page, d), 90, 132)
    args = (4, 1, 32, 8, d, "bf16", True, page, 16 * page, 0, 90, 132, window_sides(None, True))
    policy = dict(page_policy=(PAGE_GATHER_MAX, PAGE_PREFETCH), gather_zero_fill=GATHER_ZERO_FILL,
                  combine_policy=(COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS))
    assert plan == decode_plan(*args, **policy, divide_free=flag is None)
    assert plan.cfg.page_divide_free == (flag is None and page in DECODE_DIVIDE_FREE[d])
    assert plan.cfg.page_divide_free == expected_page_divide_free(page, plan.cfg.page_rows, flag != "0")
    off = decode_plan(*args, **policy)  # divide_free's default
    assert not off.cfg.page_divide_free and off.cfg == dataclasses.replace(plan.cfg, page_divide_free=False)
    assert off.cfg.page_rows == (paged_layout(page, off.cfg.tile_n, PAGE_GATHER_MAX, PAGE_PREFETCH).get("page_rows", 0))


def test_contiguous_and_packed_plans_stay_off():
    """No page table, no page_divide_free: dense, packed varlen and a contiguous-cache decode step."""
    meta = dict(device="meta", dtype=BF16)
    q = torch.empty(2, 300, 8, 128, **meta)
    assert not fwd_config(Request.dense(q, q, q, causal=True), 90).cfg.page_divide_free
    cu = torch.empty(3, device="meta", dtype=I32)
    qv = torch.empty(600, 8, 128, **meta)
    assert not fwd_config(Request.varlen(qv, qv, qv, cu, cu, 300, 300, causal=True), 90).cfg.page_divide_free
    seq = SeqSpec(DECODE, seqused_k=torch.empty(4, device="meta", dtype=I32))
    kc = torch.empty(4, 4096, 8, 128, **meta)
    step = Request.kvcache(torch.empty(4, 1, 32, 128, **meta), kc, kc, causal=True).with_seq(seq)
    plan = fwd_config(step, 90, 132)
    assert plan.cfg.page_rows == 0 and not plan.cfg.page_divide_free
    assert decode_plan(4, 1, 32, 8, 128, "bf16", True, 0, 4096, 0, 90, 132, window_sides(None, True),
                       divide_free=True) == decode_plan(4, 1, 32, 8, 128, "bf16", True, 0, 4096, 0, 90, 132,
                                                        window_sides(None, True))


def test_page_row_shuffle_switch(monkeypatch):
    """FwdConfig.page_row_shuffle: off by default on a config and out of the repr while off (the
    whole-page kernels keep their code), in the repr when on, refused without TMA page pieces;
    with_fwd_switches sets it on TMA-piece configs only. The paged prefill plans have it exactly where
    flash4.config.PAGE_ROW_SHUFFLE puts it (ROW_SHUFFLE_PAGES), nowhere with FLASH4_PAGE_ROW_SHUFFLE=0."""
    from flash4.config.sm90 import with_fwd_switches

    cfg = _tma()
    assert not cfg.page_row_shuffle and "page_row_shuffle" not in repr(cfg)
    on = dataclasses.replace(cfg, page_divide_free=True, page_row_shuffle=True)
    assert repr(on).endswith("page_divide_free=True, page_row_shuffle=True)") and eval(repr(on)) == on
    assert with_fwd_switches(cfg, ("page_row_shuffle",)) == dataclasses.replace(cfg, page_row_shuffle=True)
    dense = select_fwd_config(64, "bf16", True)
    assert with_fwd_switches(dense, ("page_row_shuffle",)) == dense
    with pytest.raises(AssertionError):
        dataclasses.replace(dense, page_row_shuffle=True)
    for flag in (None, "0"):
        if flag is not None:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", flag)
        for page in (8, 16, 24, 32, 48, 64, 128, 256):
            for d in (64, 128, 192, 256):
                got = ab_pages.shipped_config(page, headdim=d)
                assert got.page_row_shuffle == (flag is None and page in ROW_SHUFFLE_PAGES[d]), (page, d, flag)
                assert ("page_row_shuffle=True" in repr(got)) == got.page_row_shuffle


@pytest.mark.parametrize("page", [32, 64])
def test_spill_headdims_prefill_only(monkeypatch, page):
    """flash4.config.PAGE_DIVIDE_FREE_SPILL_HEADDIMS (d112) holds for the paged prefill only: a d112 decode
    step's whole-page pieces keep page_divide_free (its 64-row decode tiles compile without spills, the
    prefill's 128-row ones spilled 8 local-memory instructions), the prefill's are without it."""
    from flash4.config import PAGE_DIVIDE_FREE_SPILL_HEADDIMS

    monkeypatch.delenv("FLASH4_CACHE_HEADDIM16", raising=False)
    assert PAGE_DIVIDE_FREE_SPILL_HEADDIMS == (112,)
    step = fwd_config(_decode_step(page, 112), 90, 132).cfg
    assert step.headdim == 112 and step.page_rows == page and step.page_divide_free, step
    prefill = ab_pages.shipped_config(page, headdim=112, causal=True, nheads=8, nheads_k=2)
    assert prefill.headdim == 112 and prefill.page_rows == page and not prefill.page_divide_free, prefill
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage

    cubin = extract_cubin(compile_fwd(step))
    res = resource_usage(cubin) if cubin is not None else {}
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0, (step, res)
