"""tools/ab_pages.py on the CPU (no GPU, nothing compiled): the variants of each page size, the
kernel list --precompile builds (what the device run loads), the NaN-tailed page pool, and the
report's check. The GPU run: python tools/ab_pages.py --cache-dir DIR --out FILE."""

import dataclasses
import math
import os
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ab_pages as tool  # noqa: E402


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for name in ("FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES", "FLASH4_PAGE_GATHER_MAX",
                 "FLASH4_PAGE_PREFETCH", "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_DIVIDE_FREE",
                 "FLASH4_PAGE_ROW_SHUFFLE"):
        monkeypatch.delenv(name, raising=False)
    # the cell (set_cell, main's --headdim / --full): d128 causal, put back after each test
    monkeypatch.setattr(tool, "HEADDIM", 128)
    monkeypatch.setattr(tool, "CAUSAL", True)


def _df(cfg, on=True):
    """cfg with FwdConfig.page_divide_free set to `on`."""
    return dataclasses.replace(cfg, page_divide_free=on)


def _dfs(cfg):
    """cfg with FwdConfig.page_divide_free and page_row_shuffle (the row block shuffled, no division)."""
    return dataclasses.replace(cfg, page_divide_free=True, page_row_shuffle=True)


def test_dry_run(capsys):
    assert tool.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "page   16 g_zf_s3" in text and "page   64 tma_pf" in text and "32 kernels" in text
    # the shipped whole-page pieces (2 stages) with a third K/V stage: "s3"
    for page in (16, 32, 64, 128):
        four = " four warps" if page <= 32 else ""
        assert f"page {page:4d} s3           tma pieces {page} prefetch{four} divide-free stages 3" in text, page
    # pages 16..128 are whole-page pieces: shipped divide-free, "div" the division back
    for page in (16, 32, 64, 128):
        four = " four warps" if page <= 32 else ""
        assert f"page {page:4d} shipped      tma pieces {page} prefetch{four} divide-free stages 2" in text
        assert f"page {page:4d} div          tma pieces {page} prefetch{four} stages 2" in text
    assert " df " not in text


def test_variants(monkeypatch):
    v16, v32, v64, v128 = (tool.variants(p) for p in (16, 32, 64, 128))
    # since 2026-12-05 (H200 A/B, flash4.config.PAGE_PIECES_ALL_WARPS): pages 16 and 32 prefill by TMA
    # pieces with the look-ahead, issued by all four producer warps, 2 stages
    # since 2026-12-05 night (flash4.config.PAGE_DIVIDE_FREE) whole-page pieces without the division:
    # shipped is tma_pf4 with page_divide_free, "div" (second) that kernel with the division back
    for v, rows in ((v16, 16), (v32, 32)):
        assert list(v)[:2] == ["shipped", "div"] and v["shipped"] == _df(v["tma_pf4"]) and v["div"] == v["tma_pf4"]
        shipped = v["shipped"]
        assert (shipped.page_rows, shipped.page_gather, shipped.page_prefetch, shipped.page_pieces_all_warps,
                shipped.kv_stages, shipped.page_divide_free) == (rows, False, True, True, 2, True)
        assert not shipped.gather_zero_fill and "df" not in v
    # FLASH4_PAGE_PIECES_ALL_WARPS=0: the previous rules, page 16 gathered with the producer zero-fill
    # (no div / df variant: no TMA pieces), page 32 by one warp with 3 stages (since 2026-12-03 evening),
    # divide-free; the other variants unchanged
    monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")
    off16, off32 = tool.variants(16), tool.variants(32)
    assert off16["shipped"] == off16["g_zf"] == v16["g_zf"] and off16["shipped"].gather_zero_fill
    assert "div" not in off16 and "df" not in off16
    assert off32["shipped"] == _df(off32["tma_pf_s3"]) and off32["tma_pf_s3"] == v32["tma_pf_s3"]
    assert off32["div"] == off32["tma_pf_s3"] and off32["shipped"].kv_stages == 3 and "df" not in off32
    # s3 (shipped whole-page pieces on 2 stages with a third): where shipped has them, not off
    assert "s3" not in off16 and "s3" not in off32
    for v in (v16, v32, v64, v128):
        assert v["s3"] == dataclasses.replace(v["shipped"], kv_stages=3) and v["shipped"].kv_stages == 2
    for off, on in ((off16, v16), (off32, v32)):
        assert {k: c for k, c in off.items() if k not in ("shipped", "div")} == {
            k: c for k, c in on.items() if k not in ("shipped", "div", "s3")}
    monkeypatch.delenv("FLASH4_PAGE_PIECES_ALL_WARPS")
    assert v16["g"].page_gather and not v16["g"].gather_zero_fill and "g" not in v32
    assert v16["g_zf_s3"].kv_stages == 3 and v16["tma_s3"].kv_stages == 3 and v16["tma"].page_rows == 16
    # since 2026-12-03 evening: the look-ahead everywhere (tma_pf_s3: with 3 stages at pieces of <= 32 rows)
    assert v32["tma_pf_s3"].kv_stages == 3 and v32["tma"].page_rows == 32 and v32["tma_pf"].page_prefetch
    assert v64["shipped"] == _df(v64["tma_pf"]) and v64["div"] == v64["tma_pf"] and v64["tma_pf"].page_rows == 64
    assert "tma_pf_s3" not in v64 and v128["shipped"] == _df(v128["tma_pf"]) and v128["div"] == v128["tma_pf"]
    assert v128["tma"].page_rows == 128 and v128["tma_pf"].page_prefetch and "tma_pf_s3" not in v128
    # a gathered kernel does not depend on the page size: one compile serves every page size
    assert v16["g_zf"] == v32["g_zf"] == v64["g_zf"] == v128["g_zf"]
    assert v16["g_zf_s3"] == v128["g_zf_s3"] and v16["g_zf_s3"].gather_zero_fill
    assert v16["g_cl"] == v128["g_cl"] and v16["g_cl"].gather_clamp_late and not v16["g_zf"].gather_clamp_late
    assert v16["g_ps"] == v128["g_ps"] and v16["g_ps"].gather_ptr_shuffle and not v16["g_zf"].gather_ptr_shuffle
    # the four-warp TMA issue (page_pieces_all_warps): tma_pf / tma_pf_s3 with the switch, pages <= 32
    for v in (v16, v32):
        assert v["tma_pf4"] == dataclasses.replace(v["tma_pf"], page_pieces_all_warps=True)
        assert v["tma_pf4_s3"] == dataclasses.replace(v["tma_pf_s3"], page_pieces_all_warps=True)
    assert "tma_pf4" not in v64 and not any(c.page_pieces_all_warps for c in (*v16.values(), *v32.values())
                                            if c not in (v16["tma_pf4"], v16["tma_pf4_s3"], v32["tma_pf4"],
                                                         v32["tma_pf4_s3"], v16["shipped"], v32["shipped"],
                                                         v16["s3"], v32["s3"]))
    # page_divide_free in the shipped config and its s3 only (every page here is a whole-page piece at tile_n 128)
    for v in (v16, v32, v64, v128):
        assert [name for name, c in v.items() if c.page_divide_free] == ["shipped", "s3"]
    for cfg in [c for v in (v16, v32, v64, v128) for c in v.values()]:
        assert cfg.paged and cfg.causal and cfg.headdim == 128 and cfg.varlen_q and cfg.seqused_k
        assert cfg.smem_bytes() + 1024 <= 227 * 1024


@pytest.mark.parametrize("all_warps", [None, "0"])
def test_plan_configs_cover_every_variant(monkeypatch, all_warps):
    if all_warps is not None:
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", all_warps)
    # 24 kernels without page_divide_free (each page's shipped config, its "div", is a variant), and the
    # shipped divide-free kernels of the pages of TMA pieces: 16, 32, 64, 128 (page 16 gathered with
    # FLASH4_PAGE_PIECES_ALL_WARPS=0), and "s3", those of them on 2 stages with a third (page 32 has 3
    # with FLASH4_PAGE_PIECES_ALL_WARPS=0)
    configs = tool.plan_configs()
    assert len(configs) == len(set(configs)) == (32 if all_warps is None else 29)
    assert [c.page_rows for c in configs if c.page_divide_free and c.kv_stages == 2] == (
        [16, 32, 64, 128] if all_warps is None else [64, 128])
    assert [c.page_rows for c in configs if c.page_divide_free and c.kv_stages == 3] == (
        [16, 32, 64, 128] if all_warps is None else [32, 64, 128])
    assert configs[0] == tool.contiguous_config() and configs[0].varlen_k
    for page in tool.PAGES:
        assert set(tool.variants(page).values()) <= set(configs)


# The shipped variant of each page size on the d64 / d128 cells (causal or full), by
# (FLASH4_PAGE_PIECES_ALL_WARPS, FLASH4_PAGE_ROW_SHUFFLE, head dim): the H200 A/B of 2026-12-05
# (flash4.config, above PAGE_PIECES_ALL_WARPS) with the H100 A/B of the row shuffle
# (flash4.config.PAGE_ROW_SHUFFLE: 8-row pieces by TMA at d64 too, the four-warp pieces of pages holding
# several shuffled below d128 and for 8-row pieces at d128); row shuffle "0": the rule before it; all warps
# "0": the rules before the four warps (no row shuffle either way). "+df": that variant with
# page_divide_free (whole-page TMA pieces, flash4.config.PAGE_DIVIDE_FREE); "+dfs": with page_divide_free
# and page_row_shuffle.
_ONE_WARP = {8: "g_zf", 16: "g_zf", 24: "tma_pf_s3", 32: "tma_pf_s3+df", 48: "tma_pf_s3", 64: "tma_pf+df"}
SHIPPED = {
    (None, None, 128): {8: "tma_pf4+df", 16: "tma_pf4+df", 24: "tma_pf4+dfs", 32: "tma_pf4+df", 48: "tma_pf4",
                        64: "tma_pf+df"},
    (None, None, 64): {8: "tma_pf4+df", 16: "tma_pf4+df", 24: "tma_pf4+dfs", 32: "tma_pf4+df", 48: "tma_pf4+dfs",
                       64: "tma_pf+df"},
    (None, "0", 128): {8: "tma_pf4+df", 16: "tma_pf4+df", 24: "tma_pf4", 32: "tma_pf4+df", 48: "tma_pf4",
                       64: "tma_pf+df"},
    (None, "0", 64): {8: "g_zf", 16: "tma_pf4+df", 24: "g_zf", 32: "tma_pf4+df", 48: "tma_pf4", 64: "tma_pf+df"},
    ("0", None, 128): _ONE_WARP, ("0", "0", 128): _ONE_WARP, ("0", None, 64): _ONE_WARP, ("0", "0", 64): _ONE_WARP,
}


def _shipped_as(v, spelled):
    """The config SHIPPED's entry names among the variants v."""
    name, _, plus = spelled.partition("+")
    return {"": lambda c: c, "df": _df, "dfs": _dfs}[plus](v[name])


@pytest.mark.parametrize("row_shuffle", [None, "0"])
@pytest.mark.parametrize("all_warps", [None, "0"])
@pytest.mark.parametrize("d, causal", [(128, True), (128, False), (64, True), (64, False)])
def test_cells_and_piece_rows(monkeypatch, d, causal, all_warps, row_shuffle):
    """set_cell (--headdim / --full): every variant and the shipped config on that cell; tma_pf_s3 /
    tma_pf4 / tma_pf4_s3 wherever the pieces have <= 32 rows (page 48: 16-row pieces), "g" at pages <= 16;
    shipped TMA pieces without the row shuffle get page_divide_free flipped as "div" (whole pages: shipped
    has it) or "df" (pages of several pieces that shipped divides), and those of several pieces "dfs";
    shipped with the row shuffle (page 24; page 48 at d64) gets "nos" (the division back, no shuffle: what
    FLASH4_PAGE_ROW_SHUFFLE=0 ships where it loads TMA pieces) and none of div / df / dfs / s3; gathered
    shipped pages none of them."""
    from cpu_helpers import expected_prefill_paging

    if all_warps is not None:
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", all_warps)
    if row_shuffle is not None:
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
    tool.set_cell(d, causal)
    assert (tool.HEADDIM, tool.CAUSAL) == (d, causal)
    assert tool.contiguous_config().headdim == d and tool.contiguous_config().causal == causal
    for page in (8, 16, 24, 32, 48, 64):
        v = tool.variants(page)
        rows = math.gcd(page, 128)
        assert ("tma_pf_s3" in v) == ("tma_pf4" in v) == ("tma_pf4_s3" in v) == (rows <= 32), page
        assert ("g" in v) == (page <= 16) and v["tma"].page_rows == rows
        spelled = SHIPPED[all_warps, row_shuffle, d][page]
        name, _, plus = spelled.partition("+")
        assert v["shipped"] == _shipped_as(v, spelled), page
        want = expected_prefill_paging(page, 128, d, all_warps=None if all_warps is None else False,
                                       row_shuffle=None if row_shuffle is None else False)
        assert (v["shipped"].page_gather, v["shipped"].page_pieces_all_warps, v["shipped"].kv_stages,
                v["shipped"].page_divide_free, v["shipped"].page_row_shuffle) == (
            want["page_gather"], want["page_pieces_all_warps"], want["stages"], want["page_divide_free"],
            want["page_row_shuffle"])
        assert v["shipped"].page_divide_free == bool(plus) == (not want["page_gather"] and (
            rows == page or want["page_row_shuffle"]))
        assert v["shipped"].page_row_shuffle == (plus == "dfs") == want["page_row_shuffle"]
        flip = [n for n in ("div", "df", "nos") if n in v]
        if want["page_gather"]:
            assert flip == [] and "dfs" not in v, page
        elif plus == "dfs":  # shuffled: "nos" second, the division back without the shuffle
            assert flip == ["nos"] and list(v)[1] == "nos" and v["nos"] == v[name], page
            assert "dfs" not in v and "s3" not in v, page
            monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "0")
            before = tool.shipped_config(page)  # the rule off: "nos", or gathered (d64's 8-row pieces)
            monkeypatch.delenv("FLASH4_PAGE_ROW_SHUFFLE")
            assert before == (v["g_zf"] if d < 128 and rows < 16 else v["nos"]), page
        else:
            assert flip == (["div"] if plus else ["df"]) and list(v)[1] == flip[0], page
            assert v[flip[0]] == _df(v["shipped"], not plus) and v[flip[0]] == (v[name] if plus else _df(v[name]))
            assert ("dfs" in v) == (rows < page), page  # pages of several pieces: the row shuffle offered
            if rows < page:
                assert v["dfs"] == _dfs(v[name]), page
        for cfg in v.values():
            assert cfg.paged and cfg.causal == causal and cfg.headdim == d and cfg.varlen_q and cfg.seqused_k
            assert cfg.smem_bytes() + 1024 <= 227 * 1024


def test_main_takes_the_cell(capsys, monkeypatch):
    assert tool.main(["--dry-run", "--headdim", "64", "--full", "--pages", "8,48"]) == 0
    text = capsys.readouterr().out
    assert "full, d64" in text and (tool.HEADDIM, tool.CAUSAL) == (64, False)
    # 8-row pieces below d128 by TMA since the row-shuffle rule (flash4.config.PAGE_ROW_SHUFFLE): page 8's
    # are whole pages, without the division; "div" the division back
    assert "page    8 shipped      tma pieces 8 prefetch four warps divide-free stages 2" in text
    assert "page    8 div          tma pieces 8 prefetch four warps stages 2" in text
    # page 48 is three 16-row pieces: shipped shuffles their row block below d128, "nos" the division back
    assert "page   48 shipped      tma pieces 16 prefetch four warps divide-free row shuffle stages 2" in text
    assert "page   48 nos          tma pieces 16 prefetch four warps stages 2" in text
    assert "page   48 tma_pf4_s3" in text  # 16-row pieces: the four-warp variants
    for name in ("df ", "dfs", "div", "s3 "):  # shuffled: no other flip
        assert f"page   48 {name}" not in text, name
    assert "page    8 df" not in text and "page    8 nos" not in text and "tma_pf4_df" not in text
    # FLASH4_PAGE_ROW_SHUFFLE=0: the rule before it, page 8 gathered (the small-piece rule; tma_pf4_df its
    # A/B, which the default ships) and page 48 with the division ("df" / "dfs" without it)
    monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "0")
    assert tool.main(["--dry-run", "--headdim", "64", "--full", "--pages", "8,48"]) == 0
    text = capsys.readouterr().out
    assert "page    8 shipped      gather gather_zero_fill stages 2" in text  # 8-row pieces below d128: gathered
    assert "page    8 tma_pf4_df   tma pieces 8 prefetch four warps divide-free stages 2" in text
    assert "page   48 shipped      tma pieces 16 prefetch four warps stages 2" in text
    # page 48 is three 16-row pieces: shipped with the division, "df" without it
    assert "page   48 df           tma pieces 16 prefetch four warps divide-free stages 2" in text
    assert "page   48 dfs          tma pieces 16 prefetch four warps divide-free row shuffle stages 2" in text
    assert "page    8 df" not in text and "page    8 div" not in text  # gathered: neither
    assert " nos " not in text
    monkeypatch.delenv("FLASH4_PAGE_ROW_SHUFFLE")
    # --headdim's default is the module's HEADDIM at the call (d64 now): named, and causal without --full
    assert tool.main(["--dry-run", "--headdim", "128", "--pages", "8"]) == 0
    text = capsys.readouterr().out
    assert "causal, d128" in text
    assert "page    8 shipped      tma pieces 8 prefetch four warps divide-free stages 2" in text
    assert "page    8 div          tma pieces 8 prefetch four warps stages 2" in text


def test_shipped_follows_the_switches(monkeypatch):
    # the default (PAGE_PIECES_ALL_WARPS), whole pages without the division (PAGE_DIVIDE_FREE)
    assert tool.shipped_config(16) == _df(tool.variants(16)["tma_pf4"]) == _df(tool.variants(16)["div"])
    assert tool.shipped_config(32) == _df(tool.variants(32)["tma_pf4"])
    assert tool.shipped_config(48) == tool.variants(48)["tma_pf4"]  # three 16-row pieces a page: the division
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "3")
    assert tool.shipped_config(16) == _df(tool.variants(16)["tma_pf4_s3"])
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "16")  # set explicitly, it wins: page 16 gathered
    assert tool.shipped_config(16) == tool.variants(16)["g_zf_s3"]
    assert tool.shipped_config(32) == _df(tool.variants(32)["tma_pf4_s3"])  # the four warps stay
    monkeypatch.delenv("FLASH4_PAGE_GATHER_MAX")
    monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")  # off: page 16 gathered as before
    assert tool.shipped_config(16) == tool.variants(16)["g_zf_s3"]
    assert tool.shipped_config(32) == _df(tool.variants(32)["tma_pf_s3"])
    monkeypatch.setenv("FLASH4_GATHER_ZERO_FILL", "0")
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "2")
    assert tool.shipped_config(16) == tool.variants(16)["g"]
    monkeypatch.delenv("FLASH4_PAGE_PIECES_ALL_WARPS")
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "0")  # the four-warp pieces need the look-ahead
    assert tool.shipped_config(16) == tool.variants(16)["g"]
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "1")
    assert tool.shipped_config(16) == _df(tool.variants(16)["tma_pf4"])
    assert tool.shipped_config(64) == _df(tool.variants(64)["tma_pf"])
    # FLASH4_PAGE_DIVIDE_FREE=0: the division everywhere; shipped is the plain variant, "df" flips it on
    monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "0")
    for page, name in ((16, "tma_pf4"), (48, "tma_pf4"), (64, "tma_pf")):
        v = tool.variants(page)
        assert tool.shipped_config(page) == v["shipped"] == v[name] and not v["shipped"].page_divide_free
        assert list(v)[1] == "df" and "div" not in v and v["df"] == _df(v[name]), page
    monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "1")  # set to the default: the same
    assert tool.shipped_config(16) == _df(tool.variants(16)["tma_pf4"])
    monkeypatch.delenv("FLASH4_PAGE_DIVIDE_FREE")
    # d64 (flash4.config.PAGE_ROW_SHUFFLE): page 8's whole-page pieces by the four warps without the
    # division, page 24's 8-row and page 48's 16-row pieces with their row block shuffled
    tool.set_cell(64, True)
    assert tool.shipped_config(8) == _df(tool.variants(8)["tma_pf4"])
    assert tool.shipped_config(24) == _dfs(tool.variants(24)["tma_pf4"]) == tool.variants(24)["shipped"]
    assert tool.shipped_config(48) == _dfs(tool.variants(48)["tma_pf4"])
    for off in ("FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_PAGE_DIVIDE_FREE"):
        # the row shuffle off (it needs FLASH4_PAGE_DIVIDE_FREE): page 8 gathered again (the head-dim rule)
        # unless FLASH4_PAGE_GATHER_MAX is set, page 48 with the division
        monkeypatch.setenv(off, "0")
        assert tool.shipped_config(8) == tool.variants(8)["g"]  # FLASH4_GATHER_ZERO_FILL=0 still set
        assert tool.shipped_config(24) == tool.variants(8)["g"]  # one gathered kernel for every page size
        assert tool.shipped_config(48) == tool.variants(48)["tma_pf4"] and "df" in tool.variants(48)
        monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "0")
        # 8-row pieces: whole pages (page_divide_free, unless that is what is off), page 24 with the division
        assert tool.shipped_config(8) == _df(tool.variants(8)["tma_pf4"], off != "FLASH4_PAGE_DIVIDE_FREE"), off
        assert tool.shipped_config(24) == tool.variants(24)["tma_pf4"], off
        monkeypatch.delenv("FLASH4_PAGE_GATHER_MAX")
        monkeypatch.delenv(off)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "0")  # the row shuffle on: explicit 0 changes nothing here
    assert tool.shipped_config(8) == _df(tool.variants(8)["tma_pf4"])
    assert tool.shipped_config(24) == _dfs(tool.variants(24)["tma_pf4"])


def test_paged_pool_lays_out_the_keys():
    lengths = [5, 16, 17, 1]
    cu = torch.tensor([0, 5, 21, 38, 39], dtype=torch.int32)
    k = torch.randn(39, 2, 8, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc, vc, table, used = tool.paged_pool(k, v, cu, 16, torch.Generator().manual_seed(0))
    assert used.tolist() == lengths and kc.shape == (1 + 1 + 2 + 1, 16, 2, 8)
    for b, n in enumerate(lengths):
        for j in range(n):
            where = (int(table[b, j // 16]), j % 16)
            assert torch.equal(kc[where], k[int(cu[b]) + j]) and torch.equal(vc[where], v[int(cu[b]) + j])
        tail = (int(table[b, (n - 1) // 16]), slice(n % 16 or 16, 16))
        assert kc[tail].isnan().all() and vc[tail].isnan().all()  # past the sequence: NaN


def test_failures_and_report():
    ok = {"config": "x", "out_bitwise": True, "lse_bitwise": True, "out_reldiff": 0.0, "tflops": 500.0,
          "vs_contiguous": 0.96}
    bad = dict(ok, lse_bitwise=False, out_reldiff=math.nan, vs_contiguous=0.8)
    rows = [{"page": 16, "contiguous_tflops": 520.0, "variants": {"shipped": ok, "g": bad}}]
    assert tool.failures(rows) == ["page 16 g"]
    text = tool.format_row(rows[0])
    assert "0.960x contiguous (met)" in text and "NOT bitwise" in text


def test_variants_selection(capsys, monkeypatch):
    """--variants keeps the named variants and shipped, in every mode; an unknown name is an error."""
    only = ["tma_pf4", "tma_pf4_s3"]
    assert list(tool.variants(16, only)) == ["shipped", "tma_pf4", "tma_pf4_s3"]
    assert list(tool.variants(64, only)) == ["shipped"]
    # the page_divide_free flip by name: "div" where shipped has it (page 16), "df" where not (page 48)
    assert list(tool.variants(16, ["div", "df"])) == ["shipped", "div"]
    assert list(tool.variants(48, ["div", "df"])) == ["shipped", "df"]
    # page 24's shipped shuffles its 8-row pieces (flash4.config.PAGE_ROW_SHUFFLE): "nos" is its flip
    assert list(tool.variants(24, ["div", "df", "dfs", "nos"])) == ["shipped", "nos"]
    assert list(tool.variants(48, ["nos", "dfs"])) == ["shipped", "dfs"]
    # contiguous, four candidates and both pages' shipped (tma_pf4 with page_divide_free: kernels of their own)
    assert len(tool.plan_configs((16, 32), only)) == 7
    # page 16's shipped gathered, page 32's tma_pf_s3 (one warp) with page_divide_free: 7 kernels too
    monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")
    assert len(tool.plan_configs((16, 32), only)) == 7
    monkeypatch.delenv("FLASH4_PAGE_PIECES_ALL_WARPS")
    # FLASH4_PAGE_DIVIDE_FREE=0: both pages' shipped is their tma_pf4 (no kernel of its own)
    monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "0")
    assert len(tool.plan_configs((16, 32), only)) == 5
    monkeypatch.delenv("FLASH4_PAGE_DIVIDE_FREE")
    assert tool.main(["--dry-run", "--pages", "16,32", "--variants", *only]) == 0
    text = capsys.readouterr().out
    assert "page   32 tma_pf4_s3" in text and "page   32 div" not in text
    assert tool.main(["--dry-run", "--pages", "16,48", "--variants", "div", "df"]) == 0
    text = capsys.readouterr().out
    assert "page   16 div          tma pieces 16 prefetch four warps stages 2" in text
    assert "page   48 df           tma pieces 16 prefetch four warps divide-free stages 2" in text
    # 16-row pieces either way, the page size a run-time value: page 48's df is page 16's shipped kernel
    # and page 48's shipped page 16's div (contiguous and those two: 3 kernels)
    assert tool.variants(48)["df"] == tool.variants(16)["shipped"] and tool.variants(48)["shipped"] == tool.variants(
        16)["div"]
    assert "page   16 tma_pf4" not in text and "3 kernels" in text
    with pytest.raises(SystemExit):
        tool.main(["--dry-run", "--pages", "16", "--variants", "bogus"])


@pytest.mark.parametrize("off", [None, "FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_PAGE_DIVIDE_FREE"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_small_piece_rule_variant(monkeypatch, headdim, off):
    """tma_pf4_df: only where the shipped plan gathers a multiple of 8 by the small-piece rule (8-row
    pieces below SMALL_PIECE_MIN_HEADDIM: d64 pages 8 / 24 / 40), which since flash4.config.PAGE_ROW_SHUFFLE
    applies only with FLASH4_PAGE_ROW_SHUFFLE=0 or FLASH4_PAGE_DIVIDE_FREE=0 (off): the four-warp pieces
    with page_divide_free, and page_row_shuffle where a page holds several pieces; nowhere else. By default
    those pages ship exactly that config (page 8 with "div", pages 24 / 40 with "nos" as their flip)."""
    from flash4.config import SMALL_PIECE_MIN_HEADDIM

    tool.set_cell(headdim, True)  # the fixture puts the cell back
    pages = (8, 16, 24, 32, 40, 48, 64, 128)
    default = {page: tool.variants(page) for page in pages}
    if off is not None:
        monkeypatch.setenv(off, "0")
    for page in pages:
        v = tool.variants(page)
        got = v.get("tma_pf4_df")
        ruled = off is not None and headdim < SMALL_PIECE_MIN_HEADDIM and page in (8, 24, 40)
        assert (got is not None) == ruled, (headdim, page)
        if ruled:
            assert got.page_rows == 8 and got.page_prefetch and got.page_pieces_all_warps, got
            assert got.page_divide_free and got.page_row_shuffle == (page != 8), got
            assert v["shipped"].page_gather
            assert default[page]["shipped"] == got and not default[page]["shipped"].page_gather
            assert list(default[page])[1] == ("div" if page == 8 else "nos")
        if off is None and headdim < SMALL_PIECE_MIN_HEADDIM and page in (8, 24, 40):  # the rule off by default
            assert v["shipped"] == dataclasses.replace(v["tma_pf4"], page_divide_free=True,
                                                       page_row_shuffle=page != 8)
