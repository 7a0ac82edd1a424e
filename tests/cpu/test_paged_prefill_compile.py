"""The paged prefill's shipped kernels (flash4.config.PAGE_PIECES_ALL_WARPS: TMA page pieces from the
four producer warps for pieces of <= 32 rows, 2 K/V stages; with flash4.config.PAGE_ROW_SHUFFLE 8-row
pieces by TMA at every head dim too, gathered below head dim 128 only with FLASH4_PAGE_ROW_SHUFFLE=0)
compile for sm_90a at every head dim with 0 spills and wgmma not serialized. `python -m flash4
compile-check` builds the dense configs only (flash4.config.shipped_fwd_configs), so the kernels that
the varlen door's plan picks for page sizes 8, 16, 32 and 128 are compiled here, through the door's own
plan (flash4.config.fwd_config on meta tensors). TMA pieces that are whole pages find their page without
the run-time division by the page size (FwdConfig.page_divide_free, flash4.config.PAGE_DIVIDE_FREE):
test_page_divide_free_sass checks the producer's loops in the SASS."""

import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ab_pages  # noqa: E402  (tools/: the door's plan for a page size)
from flash4.config import SUPPORTED_HEADDIMS  # noqa: E402


def paged_prefill_plan(headdim: int, page: int):
    """The forward config flash_attn_varlen_func's plan picks for a causal paged prefill, GQA 8 / 2 (meta
    tensors; tools/ab_pages.py shipped_config)."""
    return ab_pages.shipped_config(page, headdim=headdim, causal=True, nheads=8, nheads_k=2)


@pytest.fixture(autouse=True)
def _no_page_overrides(monkeypatch):
    for name in ("FLASH4_PAGE_GATHER_MAX", "FLASH4_PAGE_PREFETCH", "FLASH4_PAGED_KV_STAGES", "FLASH4_FWD_SWITCHES",
                 "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_DIVIDE_FREE", "FLASH4_PAGE_ROW_SHUFFLE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("row_shuffle", [None, "0"])
@pytest.mark.parametrize("page", [8, 16, 32, 128])
@pytest.mark.parametrize("headdim", SUPPORTED_HEADDIMS)
def test_paged_prefill_plan_rule(monkeypatch, headdim, page, row_shuffle):
    """Which loader the plan picks (no compile): the rule of flash4.config.PAGE_PIECES_ALL_WARPS; pieces
    that are whole pages without the division (PAGE_DIVIDE_FREE: not d192's / d256's pieces of 16 rows
    from 112- / 80-key blocks at pages 32, 128). Page 8's 8-row pieces by TMA at every head dim
    (flash4.config.PAGE_ROW_SHUFFLE), gathered below SMALL_PIECE_MIN_HEADDIM with FLASH4_PAGE_ROW_SHUFFLE=0
    (the small-piece rule); none of these pages holds several four-warp pieces with the row shuffle."""
    from flash4.config import SMALL_PIECE_MIN_HEADDIM, paged_page_rows

    if row_shuffle is not None:
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
    cfg = paged_prefill_plan(headdim, page)
    rows = paged_page_rows(page, cfg.tile_n)
    assert not cfg.page_row_shuffle
    if row_shuffle == "0" and rows < 16 and headdim < SMALL_PIECE_MIN_HEADDIM:
        assert cfg.page_gather and cfg.page_rows == 0 and not cfg.page_pieces_all_warps
        assert not cfg.page_divide_free and page == 8
    else:
        assert not cfg.page_gather and cfg.page_rows == rows and cfg.page_prefetch
        assert cfg.page_pieces_all_warps == (rows <= 32)
        assert cfg.kv_stages == 2  # four-warp pieces: 2 stages; larger pieces: PAGED_KV_STAGES (2)
        assert cfg.page_divide_free == (rows == page)
        assert cfg.page_divide_free == (page in (8, 16) or (page in (32, 128) and headdim <= 128))


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("headdim", SUPPORTED_HEADDIMS)
def test_paged_prefill_compiles_clean(headdim, page):
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage

    cfg = paged_prefill_plan(headdim, page)
    assert cfg.page_pieces_all_warps, cfg
    cubin = extract_cubin(compile_fwd(cfg))
    res = resource_usage(cubin) if cubin is not None else {}
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0 and not res["wgmma_serialized"], (cfg, res)


def _utmaldg_loops(sass: str, innermost: bool = False) -> list:
    """[[instruction, ...], ...]: the bodies of the loops (cpu_helpers.sass_loops: backward branches;
    innermost: cpu_helpers.sass_innermost_loops) that issue a TMA load (UTMALDG), in the order of their
    branches."""
    from cpu_helpers import sass_innermost_loops, sass_lines, sass_loops

    lines = sass_lines(sass)
    loops = sass_innermost_loops(sass) if innermost else sass_loops(sass)
    bodies = [[ins for _, ins in lines[a:b + 1]] for a, b in loops]
    return [body for body in bodies if any("UTMALDG" in ins for ins in body)]


def test_page_divide_free_sass():
    """sm_90a, the door's d64 page-16 causal paged prefill (four-warp 16-row TMA pieces) with
    FwdConfig.page_divide_free on (the shipped plan) and off: 0 spills and the same registers either
    way; off, every loop issuing a UTMALDG finds the piece's page by the signed division (I2F.RP,
    MUFU.RCP, F2I: I2F in each of them); on, at least one such loop (the whole-page path) is at most
    24 instructions without I2F or MUFU.RCP (pages of several pieces keep the division behind a run-time
    branch around the loop); with FwdConfig.page_row_shuffle too, every innermost one is (pages of several
    pieces take the row block from the lane that looked the piece up). H100 ncu 2026-12-05 evening: ~22 of the ~48 producer instructions per piece were the
    division (docs/design/small_pages.md)."""
    import dataclasses

    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cfg = ab_pages.shipped_config(16, headdim=64, causal=True)
    assert cfg.page_rows == 16 and cfg.page_pieces_all_warps and cfg.page_divide_free, cfg  # the shipped plan
    got = {}
    for name, flags in (("on", dict(page_divide_free=True)), ("off", dict(page_divide_free=False)),
                        ("shuffle", dict(page_divide_free=True, page_row_shuffle=True))):
        cubin = extract_cubin(compile_fwd(dataclasses.replace(cfg, **flags)))
        res = resource_usage(cubin) if cubin is not None else {}
        sass = sass_text(cubin) if cubin is not None else None
        if not res or sass is None:
            pytest.skip("cuobjdump not installed: resources and SASS not checked")
        got[name] = res, _utmaldg_loops(sass), _utmaldg_loops(sass, innermost=True)
    (res_on, loops_on, _), (res_off, loops_off, _), (res_sh, _, inner_sh) = got["on"], got["off"], got["shuffle"]
    for res in (res_on, res_off, res_sh):
        assert res["spills"] == 0 and not res["wgmma_serialized"], res
        assert res["registers"] == res_off["registers"], (res, res_off)
    assert loops_off and all(any("I2F" in ins for ins in body) for body in loops_off), [len(b) for b in loops_off]

    def lean(body):
        return len(body) <= 24 and not any("I2F" in ins or "MUFU.RCP" in ins for ins in body)

    assert any(lean(body) for body in loops_on), [(len(b), sum("I2F" in ins for ins in b)) for b in loops_on]
    # FwdConfig.page_row_shuffle (in the plan for the four-warp pieces of pages holding several below d128,
    # flash4.config.PAGE_ROW_SHUFFLE; here on page 16's kernel): every piece loop, whole pages and pages of
    # several pieces
    # (the row block shuffled from the lane that looked the piece up), for K and V and in both producers:
    # no division inside
    assert len(inner_sh) >= 4 and all(lean(body) for body in inner_sh), [
        (len(b), sum("I2F" in ins for ins in b)) for b in inner_sh]


@pytest.mark.parametrize("headdim, page", [(64, 8), (64, 24), (64, 48), (128, 24)])
def test_row_shuffle_plans_compile_clean(headdim, page):
    """The kernels the plan picks since flash4.config.PAGE_ROW_SHUFFLE where it picked others before: d64
    page 8 (whole pages by four-warp TMA pieces without the division; gathered before) and the shuffled
    four-warp pieces of pages holding several (d64 pages 24 / 48, d128 page 24: page_divide_free with
    page_row_shuffle), against the same pieces with the division (tools/ab_pages.py "div" / "nos"). sm_90a:
    0 spills, wgmma not serialized, the same registers; with the row shuffle every innermost loop issuing
    a UTMALDG is shorter than each of the division's and has no I2F / MUFU.RCP, at page 8 at least one
    (the whole-page path; the general path keeps the division behind a run-time branch). When written:
    d64 16-20 instructions against 49-52, d128 page 24 27-33 against 43-47 (no I2F in d128's division
    loops either: the length tells them apart)."""
    import dataclasses

    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cfg = paged_prefill_plan(headdim, page)
    assert (cfg.page_gather, cfg.page_pieces_all_warps, cfg.page_divide_free, cfg.page_row_shuffle) == (
        False, True, True, page != 8), cfg
    got = []
    for c in (cfg, dataclasses.replace(cfg, page_divide_free=False, page_row_shuffle=False)):
        cubin = extract_cubin(compile_fwd(c))
        res = resource_usage(cubin) if cubin is not None else {}
        sass = sass_text(cubin) if cubin is not None else None
        if not res or sass is None:
            pytest.skip("cuobjdump not installed: resources and SASS not checked")
        assert res["spills"] == 0 and not res["wgmma_serialized"], (c, res)
        got.append((res, _utmaldg_loops(sass, innermost=True)))
    (res, inner), (res_div, inner_div) = got
    assert res["registers"] == res_div["registers"], (res, res_div)
    assert inner and inner_div, cfg

    def lean(body):
        return len(body) < min(len(b) for b in inner_div) and not any("I2F" in ins or "MUFU.RCP" in ins
                                                                        for ins in body)

    shape = [(len(b), lean(b)) for b in inner], [len(b) for b in inner_div]
    assert (all if cfg.page_row_shuffle else any)(lean(body) for body in inner), shape


# Every kernel head dim (flash4.config.sm90.KERNEL_HEADDIMS: the multiples of 16 up to 128 with
# FLASH4_CACHE_HEADDIM16, and 192 / 256): the paged prefill's plan follows the rule of tests/cpu/cpu_helpers
# expected_prefill_paging (d112: no page_divide_free / row shuffle, PAGE_DIVIDE_FREE_SPILL_HEADDIMS), and the
# kernels of the head dims that test_paged_prefill_compiles_clean does not build compile clean at the page
# sizes of each loader: whole 8- / 16-row pages, 8- / 16-row pieces of 24- / 48-row pages. The d112
# divide-free kernels spilled 8 / 22 local-memory instructions (2026-12-05 late night): this is the gate.
KERNEL_ONLY_HEADDIMS = (16, 32, 48, 80, 112)


@pytest.mark.parametrize("page", [8, 16, 24, 32, 48, 96, 128])
@pytest.mark.parametrize("headdim", sorted(set(KERNEL_ONLY_HEADDIMS) | set(SUPPORTED_HEADDIMS)))
def test_paged_prefill_plan_every_kernel_headdim(headdim, page):
    from cpu_helpers import expected_prefill_paging

    cfg = paged_prefill_plan(headdim, page)
    want = expected_prefill_paging(page, cfg.tile_n, headdim)
    got = {name: getattr(cfg, name) for name in want if name != "stages"}
    assert got == {name: v for name, v in want.items() if name != "stages"}, (headdim, page, cfg)
    if headdim == 112:
        assert not cfg.page_divide_free and not cfg.page_row_shuffle
        assert cfg.page_gather == (page in (8, 24))


@pytest.mark.parametrize("page", [8, 16, 24, 48])
@pytest.mark.parametrize("headdim", KERNEL_ONLY_HEADDIMS)
def test_paged_prefill_kernel_headdims_compile_clean(headdim, page):
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage

    cfg = paged_prefill_plan(headdim, page)
    cubin = extract_cubin(compile_fwd(cfg))
    res = resource_usage(cubin) if cubin is not None else {}
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0 and not res["wgmma_serialized"], (cfg, res)
