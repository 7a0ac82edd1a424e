"""The paged prefill's shipped kernels (flash4.config.PAGE_PIECES_ALL_WARPS: TMA page pieces from the
four producer warps for pieces of <= 32 rows, 2 K/V stages; 8-row pieces gathered below head dim 128)
compile for sm_90a at every head dim with 0 spills and wgmma not serialized. `python -m flash4
compile-check` builds the dense configs only (flash4.config.shipped_fwd_configs), so the kernels that
the varlen door's plan picks for page sizes 8, 16, 32 and 128 are compiled here, through the door's own
plan (flash4.config.fwd_config on meta tensors)."""

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
                 "FLASH4_PAGE_PIECES_ALL_WARPS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("page", [8, 16, 32, 128])
@pytest.mark.parametrize("headdim", SUPPORTED_HEADDIMS)
def test_paged_prefill_plan_rule(headdim, page):
    """Which loader the plan picks (no compile): the rule of flash4.config.PAGE_PIECES_ALL_WARPS."""
    from flash4.config import SMALL_PIECE_MIN_HEADDIM, paged_page_rows

    cfg = paged_prefill_plan(headdim, page)
    rows = paged_page_rows(page, cfg.tile_n)
    if rows < 16 and headdim < SMALL_PIECE_MIN_HEADDIM:
        assert cfg.page_gather and cfg.page_rows == 0 and not cfg.page_pieces_all_warps
    else:
        assert not cfg.page_gather and cfg.page_rows == rows and cfg.page_prefetch
        assert cfg.page_pieces_all_warps == (rows <= 32)
        assert cfg.kv_stages == 2  # four-warp pieces: 2 stages; larger pieces: PAGED_KV_STAGES (2)


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
