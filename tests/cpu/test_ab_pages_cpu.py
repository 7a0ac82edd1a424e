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
    for name in ("FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES",
                 "FLASH4_PAGE_GATHER_MAX", "FLASH4_PAGE_PREFETCH"):
        monkeypatch.delenv(name, raising=False)


def test_dry_run(capsys):
    assert tool.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "page   16 g_zf_s3" in text and "page   64 tma_pf" in text and "24 kernels" in text


def test_variants():
    v16, v32, v64, v128 = (tool.variants(p) for p in (16, 32, 64, 128))
    assert list(v16)[0] == "shipped" and v16["shipped"].page_gather and v16["shipped"].gather_zero_fill
    assert v16["shipped"] == v16["g_zf"]  # the default gathered path today
    assert v16["g"].page_gather and not v16["g"].gather_zero_fill and "g" not in v32
    assert v16["g_zf_s3"].kv_stages == 3 and v16["tma_s3"].kv_stages == 3 and v16["tma"].page_rows == 16
    # since 2026-12-03 evening: the look-ahead everywhere, with 3 stages at pieces of <= 32 rows
    assert v32["shipped"] == v32["tma_pf_s3"] and v32["tma"].page_rows == 32 and v32["tma_pf"].page_prefetch
    assert v64["shipped"] == v64["tma_pf"] and v64["tma_pf"].page_rows == 64 and "tma_pf_s3" not in v64
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
                                                         v32["tma_pf4_s3"]))
    for cfg in [c for v in (v16, v32, v64, v128) for c in v.values()]:
        assert cfg.paged and cfg.causal and cfg.headdim == 128 and cfg.varlen_q and cfg.seqused_k
        assert cfg.smem_bytes() + 1024 <= 227 * 1024


def test_plan_configs_cover_every_variant():
    configs = tool.plan_configs()
    assert len(configs) == len(set(configs)) == 24
    assert configs[0] == tool.contiguous_config() and configs[0].varlen_k
    for page in tool.PAGES:
        assert set(tool.variants(page).values()) <= set(configs)


def test_shipped_follows_the_switches(monkeypatch):
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "3")
    assert tool.shipped_config(16) == tool.variants(16)["g_zf_s3"]
    monkeypatch.setenv("FLASH4_GATHER_ZERO_FILL", "0")
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", "2")
    assert tool.shipped_config(16) == tool.variants(16)["g"]
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "1")
    assert tool.shipped_config(64) == tool.variants(64)["tma_pf"]


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


def test_variants_selection(capsys):
    """--variants keeps the named variants and shipped, in every mode; an unknown name is an error."""
    only = ["tma_pf4", "tma_pf4_s3"]
    assert list(tool.variants(16, only)) == ["shipped", "tma_pf4", "tma_pf4_s3"]
    assert list(tool.variants(64, only)) == ["shipped"]
    assert len(tool.plan_configs((16, 32), only)) == 7  # contiguous, the two pages' shipped, four candidates
    assert tool.main(["--dry-run", "--pages", "16,32", "--variants", *only]) == 0
    assert "page   32 tma_pf4_s3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(["--dry-run", "--pages", "16", "--variants", "bogus"])
