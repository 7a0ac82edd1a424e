"""The paged prefill's shipped kernels (flash4.config.PAGE_PIECES_ALL_WARPS: TMA page pieces from the
four producer warps for pieces of <= 32 rows, 2 K/V stages; 8-row pieces gathered below head dim 128)
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
                 "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_DIVIDE_FREE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("page", [8, 16, 32, 128])
@pytest.mark.parametrize("headdim", SUPPORTED_HEADDIMS)
def test_paged_prefill_plan_rule(headdim, page):
    """Which loader the plan picks (no compile): the rule of flash4.config.PAGE_PIECES_ALL_WARPS; pieces
    that are whole pages without the division (PAGE_DIVIDE_FREE: not d192's / d256's pieces of 16 rows
    from 112- / 80-key blocks at pages 32, 128)."""
    from flash4.config import SMALL_PIECE_MIN_HEADDIM, paged_page_rows

    cfg = paged_prefill_plan(headdim, page)
    rows = paged_page_rows(page, cfg.tile_n)
    if rows < 16 and headdim < SMALL_PIECE_MIN_HEADDIM:
        assert cfg.page_gather and cfg.page_rows == 0 and not cfg.page_pieces_all_warps
        assert not cfg.page_divide_free
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
    # FwdConfig.page_row_shuffle (candidate, off): every piece loop, whole pages and pages of several pieces
    # (the row block shuffled from the lane that looked the piece up), for K and V and in both producers:
    # no division inside
    assert len(inner_sh) >= 4 and all(lean(body) for body in inner_sh), [
        (len(b), sum("I2F" in ins for ins in b)) for b in inner_sh]
