"""flash4.config.PAGE_ROW_SHUFFLE on the CPU (no GPU, nothing compiled): the paged prefill's four-warp TMA
pieces of pages that hold several pieces take their row block from the lane that looked the piece up
(FwdConfig.page_divide_free with page_row_shuffle: no division in the piece loop) below head dim
ROW_SHUFFLE_MIN_HEADDIM, and for pieces of fewer than SMALL_PIECE_ROWS rows at every head dim; with it
the small-piece rule is off (8-row pieces load by TMA below d128 instead of being gathered). On by default
(H100 A/B in flash4.config, above PAGE_ROW_SHUFFLE), only while page_divide_free's switch is on;
FLASH4_PAGE_ROW_SHUFFLE=0 restores the previous plan exactly. Decode steps are unchanged. The pure helper
with_page_row_shuffle, the switch and its environment, the plans. The compiled kernels:
tests/cpu/test_paged_prefill_compile.py::test_row_shuffle_plans_compile_clean; speed: tools/ab_pages.py
variants nos / dfs / tma_pf4_df."""

import dataclasses
import math
import pathlib
import re

import pytest
import torch
from cpu_helpers import expected_prefill_paging

import flash4
from flash4 import env
from flash4.config import (COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS,
                           GATHER_ZERO_FILL, PAGE_DIVIDE_FREE, PAGE_GATHER_MAX, PAGE_PIECES_ALL_WARPS_MAX,
                           PAGE_PREFETCH, PAGE_ROW_SHUFFLE, ROW_SHUFFLE_MIN_HEADDIM, SMALL_PIECE_ROWS,
                           SUPPORTED_HEADDIMS, fwd_config, select_fwd_config, with_seq_layout)
from flash4.config import sm90
from flash4.config.sm90 import (KERNEL_HEADDIMS, decode_plan, page_row_shuffle_policy, prefill_page_policy,
                                with_l2_kv_heads, with_page_row_shuffle)
from flash4.geometry import window_sides
from flash4.request import DECODE, Request, SeqSpec

BF16, I32 = torch.bfloat16, torch.int32
NHEADS, NHEADS_K = 32, 8
PAGE_SWITCHES = ("FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_PAGE_DIVIDE_FREE", "FLASH4_PAGE_PIECES_ALL_WARPS",
                 "FLASH4_PAGE_GATHER_MAX", "FLASH4_PAGE_PREFETCH", "FLASH4_PAGED_KV_STAGES", "FLASH4_GATHER_ZERO_FILL",
                 "FLASH4_FWD_SWITCHES", "FLASH4_HEADDIM16", "FLASH4_CACHE_HEADDIM16")
REPO = pathlib.Path(flash4.__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _prefill(page: int, d: int, causal: bool = True):
    """The varlen door's paged prefill request (meta tensors, GQA 32 / 8)."""
    meta, i32 = dict(device="meta", dtype=BF16), dict(device="meta", dtype=I32)
    kc = torch.empty(64, page, NHEADS_K, d, **meta)
    return Request.varlen(torch.empty(1024, NHEADS, d, **meta), kc, torch.empty_like(kc), torch.empty(5, **i32), None,
                          512, seqused_k=torch.empty(4, **i32), page_table=torch.empty(4, 16, **i32), causal=causal)


def _plan(page: int, d: int, causal: bool = True):
    return fwd_config(_prefill(page, d, causal), 90).cfg


def _decode_step(page: int, d: int):
    seq = SeqSpec(DECODE, seqused_k=torch.empty(4, device="meta", dtype=I32),
                  page_table=torch.empty(4, 16, device="meta", dtype=I32))
    kc = torch.empty(64, page, 8, d, device="meta", dtype=BF16)
    q = torch.empty(4, 1, 32, d, device="meta", dtype=BF16)
    return Request.kvcache(q, kc, torch.empty_like(kc), causal=True).with_seq(seq)


# ================================================================ defaults, environment
def test_default_and_env(monkeypatch):
    """PAGE_ROW_SHUFFLE is on below ROW_SHUFFLE_MIN_HEADDIM = 128 (and for pieces of < SMALL_PIECE_ROWS
    rows); FLASH4_PAGE_ROW_SHUFFLE (a plan variable: the prepared calls key on it) turns it off with 0 and
    back on with 1; page_row_shuffle_policy() needs page_divide_free's switch (FLASH4_PAGE_DIVIDE_FREE=0
    turns it off whatever FLASH4_PAGE_ROW_SHUFFLE says)."""
    assert PAGE_ROW_SHUFFLE is True and ROW_SHUFFLE_MIN_HEADDIM == 128 and SMALL_PIECE_ROWS == 16
    assert PAGE_DIVIDE_FREE is True
    assert env.page_row_shuffle() is None and page_row_shuffle_policy() is True
    for value, want in (("0", False), ("off", False), ("false", False), ("no", False), ("1", True), ("yes", True),
                        ("on", True), ("true", True)):
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", value)
        assert env.page_row_shuffle() is want and page_row_shuffle_policy() is want, value
    monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "sometimes")
    with pytest.raises(ValueError, match="FLASH4_PAGE_ROW_SHUFFLE"):
        env.page_row_shuffle()
    for value in (None, "1"):
        if value is None:
            monkeypatch.delenv("FLASH4_PAGE_ROW_SHUFFLE")
        else:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", value)
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "0")
        assert page_row_shuffle_policy() is False, value
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "1")
        assert page_row_shuffle_policy() is True, value
    assert "FLASH4_PAGE_ROW_SHUFFLE" in env.PLAN_VARIABLES


def test_env_tables():
    """FLASH4_PAGE_ROW_SHUFFLE is in env.py's table and README's environment table, and every variable of
    env.py's table is in README's."""
    doc = (REPO / "src" / "flash4" / "env.py").read_text().split('"""')[1]
    in_env = set(re.findall(r"^\| (FLASH4_[A-Z0-9_]+) \|", doc, re.M))
    in_readme = set(re.findall(r"^\| `(FLASH4_[A-Z0-9_]+)` \|", (REPO / "README.md").read_text(), re.M))
    assert "FLASH4_PAGE_ROW_SHUFFLE" in in_env and "FLASH4_PAGE_ROW_SHUFFLE" in in_readme
    assert in_env <= in_readme, sorted(in_env - in_readme)


# ================================================================ with_page_row_shuffle (pure)
def _rule(cfg, page: int, headdim: int, on: bool) -> bool:
    """flash4.config's rule, written out: on, four-warp TMA pieces, several a page, below head dim 128 or
    pieces of < 16 rows, not a head dim whose divide-free pieces spill."""
    spill = getattr(sm90, "PAGE_DIVIDE_FREE_SPILL_HEADDIMS", ())
    return bool(on and cfg.page_pieces_all_warps and 0 < cfg.page_rows < page and cfg.headdim not in spill
                and (headdim < 128 or cfg.page_rows < 16))


def test_with_page_row_shuffle_is_pure_and_follows_the_rule(monkeypatch):
    """with_page_row_shuffle(cfg, page_size, headdim, on) over pages 8..256 (multiples of 8) and head dims
    16..256 (multiples of 8, each on the kernel head dim that serves it): page_divide_free and
    page_row_shuffle set (nothing else changed) exactly by the rule, else cfg itself; idempotent; never
    reads the environment (the switch arrives as `on`); gathered, dense and one-warp configs unchanged."""
    headdims = range(16, 257, 8)
    kernel = {h: min(k for k in KERNEL_HEADDIMS if k >= h) for h in headdims}
    shuffled = {}
    for env_value in (None, "0"):  # the environment must not matter
        if env_value is not None:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", env_value)
            monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", env_value)
        for h in headdims:
            base = with_seq_layout(select_fwd_config(kernel[h], "bf16", True), varlen_q=True, seqused_k=True)
            others = (base, with_seq_layout(base, page_gather=True), select_fwd_config(kernel[h], "bf16", True))
            for page in range(8, 257, 8):
                rows = math.gcd(page, base.tile_n)
                tma = with_seq_layout(base, page_rows=rows, page_prefetch=True)
                four = dataclasses.replace(tma, page_pieces_all_warps=True) if rows <= PAGE_PIECES_ALL_WARPS_MAX \
                    else tma
                for cfg in (tma, four, with_seq_layout(base, page_rows=rows), *others):
                    for on in (True, False):
                        got = with_page_row_shuffle(cfg, page, h, on)
                        if _rule(cfg, page, h, on):
                            assert got == dataclasses.replace(cfg, page_divide_free=True, page_row_shuffle=True)
                            assert "page_row_shuffle=True" in repr(got)
                            if env_value is None:
                                shuffled.setdefault(h, []).append(page)
                        else:
                            assert got is cfg, (h, page, cfg, on)
                        assert with_page_row_shuffle(got, page, h, on) == got  # idempotent
                        assert with_page_row_shuffle(cfg, page, h, on) == got  # the same answer again
                    assert with_page_row_shuffle(cfg, page, h, False) is cfg
                # already divide-free (a whole page's switch): the shuffle adds only its own field
                df = dataclasses.replace(four, page_divide_free=True)
                assert with_page_row_shuffle(df, page, h, True) == (
                    dataclasses.replace(df, page_row_shuffle=True) if _rule(four, page, h, True) else df)
    # spelled out, tile_n 128 / 112 / 80: d64 every page of several pieces of <= 32 rows (not 192's 64-row
    # or 256's 128-row pieces); d128 only 8-row pieces (pages 24, 40, ..., 248); d192 / d256 the 8-row
    # pieces of 112- / 80-key blocks
    several_small = [p for p in range(8, 257, 8) if math.gcd(p, 128) < p and math.gcd(p, 128) <= 32]
    assert several_small[:8] == [24, 40, 48, 56, 72, 80, 88, 96] and 192 not in several_small
    assert shuffled[64] == shuffled[96] == several_small
    assert shuffled[128] == list(range(24, 257, 16))
    assert shuffled[192] == [24, 40, 72, 88, 104, 120, 136, 152, 184, 200, 216, 232, 248]
    assert shuffled[256] == [24, 56, 72, 88, 104, 136, 152, 168, 184, 216, 232, 248]
    # the head dim given decides, on the kernel's key blocks: d120 on the d128 kernel (128-key blocks) as d64,
    # d136 on the d192 kernel (112-key blocks) as d192
    assert shuffled[120] == shuffled[64] and shuffled[136] == shuffled[192]
    assert shuffled[16] == shuffled[64]


# ================================================================ the plans
@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_plan_follows_the_rule(monkeypatch, d):
    """The varlen door's paged prefill over pages 8..256 (multiples of 8) at each supported head dim:
    page_row_shuffle exactly where with_page_row_shuffle's rule puts it (cpu_helpers.expected_prefill_paging
    agrees), no multiple of 8 gathered; FLASH4_PAGE_ROW_SHUFFLE=0: nowhere, and the small-piece rule's
    gathered pages back below d128."""
    for flag in (None, "0"):
        if flag is not None:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", flag)
        for page in range(8, 257, 8):
            cfg = _plan(page, d)
            rows = math.gcd(page, cfg.tile_n)
            assert cfg.page_gather == (flag == "0" and rows < 16 and d < 128), (page, cfg)
            want = expected_prefill_paging(page, cfg.tile_n, d, row_shuffle=None if flag is None else False)
            assert (cfg.page_gather, cfg.page_rows, cfg.page_pieces_all_warps, cfg.page_divide_free,
                    cfg.page_row_shuffle) == (want["page_gather"], want["page_rows"], want["page_pieces_all_warps"],
                                              want["page_divide_free"], want["page_row_shuffle"]), page
            shuffled = flag is None and cfg.page_pieces_all_warps and rows < page and (d < 128 or rows < 16)
            assert cfg.page_row_shuffle == shuffled, (page, cfg)
            assert cfg.page_divide_free == (not cfg.page_gather and (rows == page or shuffled)), (page, cfg)


@pytest.mark.parametrize("headdim", [16, 32, 48, 64, 80, 96, 112, 128])
def test_plan_at_kernel_head_dims(monkeypatch, headdim):
    """The sm_90 kernel head dims (FLASH4_HEADDIM16 / FLASH4_CACHE_HEADDIM16: multiples of 16 up to 128)
    below d128 take the rule like d64, but not those whose divide-free pieces spill
    (flash4.config.PAGE_DIVIDE_FREE_SPILL_HEADDIMS: no page_divide_free, no row shuffle, the small-piece
    rule kept there)."""
    spill = getattr(sm90, "PAGE_DIVIDE_FREE_SPILL_HEADDIMS", ())
    monkeypatch.setenv("FLASH4_HEADDIM16", "1")
    monkeypatch.setenv("FLASH4_CACHE_HEADDIM16", "1")
    for page in (8, 16, 24, 32, 48, 64, 96, 128):
        cfg = _plan(page, headdim)
        assert cfg.headdim == headdim and cfg.tile_n == 128
        rows = math.gcd(page, 128)
        if headdim in spill:
            assert not cfg.page_divide_free and not cfg.page_row_shuffle, cfg
            assert cfg.page_gather == (rows < 16 and headdim < 128), cfg
        else:
            shuffled = rows < page and rows <= 32 and (headdim < 128 or rows < 16)
            assert not cfg.page_gather and cfg.page_row_shuffle == shuffled, (page, cfg)
            assert cfg.page_divide_free == (rows == page or shuffled), (page, cfg)


# The paged prefill before the row-shuffle rule (FLASH4_PAGE_ROW_SHUFFLE=0), spelled out at d64 / d128
# (tile_n 128, 2 K/V stages, the look-ahead): (page_rows, four warps, page_divide_free), or None for
# gathered rows (the small-piece rule: 8-row pieces below d128, with the producer's zero-fill).
PREVIOUS = {
    64: {8: None, 16: (16, True, True), 24: None, 32: (32, True, True), 48: (16, True, False), 64: (64, False, True),
         96: (32, True, False), 128: (128, False, True)},
    128: {8: (8, True, True), 16: (16, True, True), 24: (8, True, False), 32: (32, True, True), 48: (16, True, False),
          64: (64, False, True), 96: (32, True, False), 128: (128, False, True)},
}
# What the rule changes (the default): d64's 8-row pages by TMA (page 8 whole pages, page 24 shuffled), the
# four-warp pieces of pages holding several shuffled below d128 (48, 96) and for 8-row pieces at d128 (24).
CHANGED = {64: {8: (8, True, True), 24: (8, True, True), 48: (16, True, True), 96: (32, True, True)},
           128: {24: (8, True, True)}}
SHUFFLED = {64: {24, 48, 96}, 128: {24}}


def _previous(page: int, d: int, causal: bool, table=PREVIOUS):
    """The full config of PREVIOUS's (or another table's) entry: the door's config, built by hand."""
    base = with_seq_layout(with_l2_kv_heads(select_fwd_config(d, "bf16", causal), NHEADS, NHEADS_K), varlen_q=True,
                           seqused_k=True, kv_stages=2)
    entry = table[d][page]
    if entry is None:
        return with_seq_layout(base, page_gather=True, gather_zero_fill=GATHER_ZERO_FILL)
    rows, four, divide_free = entry
    return with_seq_layout(base, page_rows=rows, page_prefetch=True, page_pieces_all_warps=four,
                           page_divide_free=divide_free)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [8, 16, 24, 32, 48, 64, 96, 128])
def test_row_shuffle_off_is_the_previous_plan(monkeypatch, page, d, causal):
    """FLASH4_PAGE_ROW_SHUFFLE=0 gives exactly the config the plan had with the rule off (PREVIOUS, built by
    hand; the same as flash4.config.PAGE_ROW_SHUFFLE = False with the variable unset, and as
    cpu_helpers.expected_prefill_paging without the rule); the default differs from it exactly where
    CHANGED says, by page_divide_free and page_row_shuffle (or TMA pieces for gathered rows)."""
    default = _plan(page, d, causal)
    monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "0")
    off = _plan(page, d, causal)
    assert off == _previous(page, d, causal), (off, _previous(page, d, causal))
    assert not off.page_row_shuffle and "page_row_shuffle" not in repr(off)
    want = expected_prefill_paging(page, off.tile_n, d, row_shuffle=False)
    assert (None if want["page_gather"] else (want["page_rows"], want["page_pieces_all_warps"],
                                              want["page_divide_free"])) == PREVIOUS[d][page]
    monkeypatch.delenv("FLASH4_PAGE_ROW_SHUFFLE")
    monkeypatch.setattr(sm90, "PAGE_ROW_SHUFFLE", False)  # the rule off in flash4.config: the same plan
    assert _plan(page, d, causal) == off
    monkeypatch.setattr(sm90, "PAGE_ROW_SHUFFLE", True)
    monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "1")  # set to the default: the default
    assert _plan(page, d, causal) == default
    # the default: PREVIOUS but for CHANGED
    table = {d: {**PREVIOUS[d], **CHANGED[d]}}
    assert default == dataclasses.replace(_previous(page, d, causal, table), page_row_shuffle=page in SHUFFLED[d])
    assert default.page_row_shuffle == (page in SHUFFLED[d])
    if page not in CHANGED[d]:
        assert default == off
    elif PREVIOUS[d][page] is not None:  # the same TMA pieces, the division gone
        assert default == dataclasses.replace(off, page_divide_free=True, page_row_shuffle=page in SHUFFLED[d])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [8, 16, 24, 32, 48, 64, 96, 128])
def test_divide_free_off_turns_the_row_shuffle_off(monkeypatch, page, d):
    """FLASH4_PAGE_DIVIDE_FREE=0 (the shuffled loop is page_divide_free's general path): no row shuffle
    and no page_divide_free, even with FLASH4_PAGE_ROW_SHUFFLE=1; the plan is PREVIOUS with the division
    everywhere (the small-piece rule back at d64)."""
    monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "0")
    for flag in (None, "1", "0"):
        if flag is not None:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", flag)
        assert page_row_shuffle_policy() is False and prefill_page_policy() == (0, True, True, True), flag
        cfg = _plan(page, d)
        assert not cfg.page_row_shuffle and not cfg.page_divide_free, (flag, cfg)
        assert cfg == dataclasses.replace(_previous(page, d, True), page_divide_free=False), flag


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [8, 16, 24, 32, 48, 64, 96, 128])
def test_decode_plans_unaffected(monkeypatch, page, d):
    """A paged decode step keeps page_policy() (pages of <= PAGE_GATHER_MAX rows gathered, TMA pieces from
    warp 0): never page_row_shuffle, the same plan with FLASH4_PAGE_ROW_SHUFFLE unset, 0 or 1
    (decode_plan's, page_divide_free on whole pages)."""
    plans = []
    for flag in (None, "0", "1"):
        if flag is not None:
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", flag)
        plans.append(fwd_config(_decode_step(page, d), 90, 132))
    assert plans[0] == plans[1] == plans[2]
    want = decode_plan(4, 1, 32, 8, d, "bf16", True, page, 16 * page, 0, 90, 132, window_sides(None, True),
                       page_policy=(PAGE_GATHER_MAX, PAGE_PREFETCH), gather_zero_fill=GATHER_ZERO_FILL,
                       divide_free=PAGE_DIVIDE_FREE,
                               combine_policy=(COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS))
    cfg = plans[0].cfg
    assert plans[0] == want and not cfg.page_row_shuffle and not cfg.page_pieces_all_warps
    assert cfg.page_gather == (page <= PAGE_GATHER_MAX)
    assert cfg.page_divide_free == (not cfg.page_gather and cfg.page_rows == page)
