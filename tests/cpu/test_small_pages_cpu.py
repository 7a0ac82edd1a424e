"""Pages of any size >= 1 without a GPU: the paged layout choice (TMA page pieces or gathered rows,
the FLASH4_PAGE_GATHER_MAX switch), the plans of the doors that take a page table, the gather's
thread layout, validation of page sizes 1..N on both doors, and that the gathered
configs compile for sm_90a without spills. GPU twin: tests/gpu/test_small_pages.py."""

import pytest
import torch
from cpu_helpers import kv_args, paged_args, varlen_raises

from flash4 import env
from flash4.config import (MIN_PAGE_ROWS, PAGE_GATHER_MAX, PAGE_PREFETCH, TMA_PAGE_ROWS, SUPPORTED_HEADDIMS, paged_layout,
                           paged_page_rows, select_fwd_config, with_seq_layout)
from flash4.config.sm90 import FwdConfig, decode_plan
from flash4.validate import kvcache_support_error, varlen_support_error

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _small_pages_on(monkeypatch):
    """The gathered path is on by default; these tests also pin FLASH4_SMALL_PAGES=1 explicitly."""
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "1")


def test_small_pages_are_on_by_default(monkeypatch):
    """Any page size by default since the gathered path passed its GPU tests (H200, 2026-12-02);
    FLASH4_SMALL_PAGES=0 goes back to multiples of 8."""
    from flash4.config import served_page_rows

    assert served_page_rows() == 1
    monkeypatch.delenv("FLASH4_SMALL_PAGES")
    assert served_page_rows() == 1
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "0")
    assert served_page_rows() == 8


def test_constants():
    assert MIN_PAGE_ROWS == 8 and TMA_PAGE_ROWS == 8
    # page 16 gathered since the H200 A/B of 2026-12-02 (issue 25 item 3); the prefetch stays off
    assert PAGE_GATHER_MAX == 16 and PAGE_PREFETCH is True  # the look-ahead: on since 2026-12-03 evening


@pytest.mark.parametrize("page_size", range(1, 70))
@pytest.mark.parametrize("tile_n", [128, 112, 80])
def test_paged_layout_default(page_size, tile_n, monkeypatch):
    monkeypatch.delenv("FLASH4_PAGE_GATHER_MAX", raising=False)
    monkeypatch.delenv("FLASH4_PAGE_PREFETCH", raising=False)
    got = paged_layout(page_size, tile_n)
    if page_size % 8 or page_size <= PAGE_GATHER_MAX:
        assert got == {"page_rows": 0, "page_gather": True}
    else:
        assert got == {"page_rows": paged_page_rows(page_size, tile_n), "page_gather": False,
                       "page_prefetch": PAGE_PREFETCH}
        assert got["page_rows"] % TMA_PAGE_ROWS == 0 and tile_n % got["page_rows"] == 0


def test_paged_layout_switches(monkeypatch):
    assert paged_layout(16, 128, 16, False) == {"page_rows": 0, "page_gather": True}
    assert paged_layout(32, 128, 16, False) == {"page_rows": 32, "page_gather": False, "page_prefetch": False}
    assert paged_layout(32, 128, 16, True) == {"page_rows": 32, "page_gather": False, "page_prefetch": True}
    assert paged_layout(5, 128, 0, True) == {"page_rows": 0, "page_gather": True}  # prefetch: TMA pieces only
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "1")
    assert env.page_prefetch() is True and paged_layout(32, 128)["page_prefetch"]
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "maybe")
    with pytest.raises(ValueError, match="FLASH4_PAGE_PREFETCH='maybe': allowed 0/1"):
        env.page_prefetch()
    monkeypatch.delenv("FLASH4_PAGE_PREFETCH")
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "32")
    assert env.page_gather_max() == 32
    assert paged_layout(32, 128)["page_gather"] and not paged_layout(64, 128)["page_gather"]
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "-1")
    with pytest.raises(ValueError, match="FLASH4_PAGE_GATHER_MAX='-1' must be an integer >= 0"):
        env.page_gather_max()
    with pytest.raises(ValueError, match="page_size=0 must be >= 1"):
        paged_layout(0, 128, 0, False)


def test_config_paged_property_and_asserts():
    base = select_fwd_config(128, "bf16", True)
    gathered = with_seq_layout(base, varlen_q=True, seqused_k=True, page_gather=True)
    assert gathered.paged and not base.paged
    assert with_seq_layout(base, varlen_q=True, seqused_k=True, page_rows=16).paged
    with pytest.raises(AssertionError):
        with_seq_layout(base, varlen_q=True, seqused_k=True, page_gather=True, page_rows=16)
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, page_gather=True)  # paged K/V always come with seqused_k
    with pytest.raises(AssertionError):
        with_seq_layout(base, varlen_q=True, seqused_k=True, page_gather=True, page_prefetch=True)
    # repr round trip (the compile-cache key and the self-test's parser)
    assert "page_gather=True" in repr(gathered)


def test_gather_layout():
    from flash4.kernels.common.paged_gather import gather_layout

    for d in SUPPORTED_HEADDIMS:
        tile_n = select_fwd_config(d, "bf16", False).tile_n
        tpr, rows, passes = gather_layout(d, d, tile_n)
        assert tpr * rows == 128 and passes * rows == tile_n and passes <= tpr
        assert tpr == (4 if d == 96 else 8)
    assert gather_layout(192, 128, 128) == (8, 16, 8)
    assert gather_layout(128, 64, 128) == (8, 16, 8)


@pytest.mark.parametrize("page_size", [1, 3, 4, 5, 7, 12, 24])
def test_decode_plan_small_pages(page_size):
    plan = decode_plan(64, 1, 32, 8, 128, "bf16", True, page_size, 8192, 0, 90, 132)
    assert plan.cfg.paged and plan.cfg.seqused_k
    assert plan.cfg.page_gather == (page_size % 8 != 0)
    prefetched = decode_plan(64, 1, 32, 8, 128, "bf16", True, 16, 8192, 0, 90, 132, page_policy=(0, True))
    assert prefetched.cfg.page_prefetch and prefetched.cfg.page_rows == 16
    gathered = decode_plan(64, 1, 32, 8, 128, "bf16", True, 16, 8192, 0, 90, 132, page_policy=(16, False))
    assert gathered.cfg.page_gather and gathered.cfg.page_rows == 0


@pytest.mark.parametrize("page_size", [1, 2, 3, 4, 5, 6, 7, 9, 12, 15, 24, 33])
def test_validation_accepts_any_page_size(page_size):
    # past validation: only the CPU device is left to refuse, on both doors that take a page table
    assert "q is on cpu" in varlen_support_error(**paged_args(page_size=page_size))
    assert "q is on cpu" in kvcache_support_error(**kv_args(paged=True, page_size=page_size, s_cache=40, s_new=3))


def test_page_size_zero_refused():
    paged = paged_args()
    k = torch.randn(6, 0, 2, 64, dtype=BF16)
    varlen_raises(ValueError, ("page_size=0", "at least 1 row"), **dict(paged, k=k, v=k.clone()))


@pytest.mark.parametrize("spec", ["d128-causal-page4", "d64-decode-page1-split", "d256-page3",
                                  "d128-causal-page16-prefetch"])
def test_gathered_configs_compile_without_spills(spec, compiled_clean):
    """The gathered path compiles for sm_90a: cp.async (LDGSTS) and no register spill."""
    pytest.importorskip("cutlass")
    from flash4.compile.check import compile_check

    if spec == "d128-causal-page4":
        base = select_fwd_config(128, "bf16", True)
        cfg = with_seq_layout(base, varlen_q=True, seqused_k=True, **paged_layout(4, base.tile_n, 0))
    elif spec == "d64-decode-page1-split":
        cfg = decode_plan(8, 1, 32, 8, 64, "bf16", False, 1, 8192, 0, 90, 132).cfg
        assert cfg.split_kv and cfg.tile_m == 64
    elif spec == "d256-page3":
        base = select_fwd_config(256, "bf16", False)
        cfg = with_seq_layout(base, varlen_q=True, seqused_k=True, **paged_layout(3, base.tile_n, 0))
    else:
        base = select_fwd_config(128, "bf16", True)
        cfg = with_seq_layout(base, varlen_q=True, seqused_k=True, **paged_layout(16, base.tile_n, 0, True))
        assert cfg.page_prefetch
    assert cfg.page_gather or cfg.page_prefetch
    (row,) = compile_check([cfg])
    compiled_clean(row)


# ================================================================ the doors, with reference kernels (conftest.py)
@pytest.mark.parametrize("page_size", [1, 3, 5, 12])
def test_varlen_door_small_pages(cpu_kernels, page_size):
    import flash4
    from flash4.config import fwd_config
    from flash4.reference import attention_varlen_ref

    paged = paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33), page_size=page_size)
    out = flash4.flash_attn_varlen_func(**paged, max_seqlen_q=5, causal=True, check_seqlens=True)
    ref, _ = attention_varlen_ref(paged["q"], paged["k"], paged["v"], paged["cu_seqlens_q"], None, None,
                                  paged["seqused_k"], paged["page_table"], causal=True)
    assert torch.equal(out, ref.to(BF16))
    cfg = fwd_config(cpu_kernels[0]["request"], 90).cfg
    assert cfg.page_gather == (page_size % 8 != 0) and cfg.paged


@pytest.mark.parametrize("page_size", [1, 3, 5])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (3, 3)])
def test_kvcache_door_appends_across_small_pages(cpu_kernels, page_size, sq, s_new):
    import flash4
    from flash4.config import fwd_config
    from flash4.reference import kvcache_ref

    args = kv_args(b=3, sq=sq, s_new=s_new, paged=True, s_cache=40, page_size=page_size)
    seqlens = [0, page_size - 1 if page_size > 1 else 2, 40 - s_new]  # the appends cross page boundaries
    args["cache_seqlens"] = torch.tensor(seqlens, dtype=torch.int32)
    table = args["page_table"]
    k_exp, v_exp = args["k_cache"].clone(), args["v_cache"].clone()
    for b, start in enumerate(seqlens):
        for t in range(s_new):
            pos = start + t
            where = (int(table[b, pos // page_size]), pos % page_size)
            k_exp[where], v_exp[where] = args["k"][b, t], args["v"][b, t]
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, return_lse=True, check_seqlens=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], page_table=table, causal=True)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    plan = fwd_config(cpu_kernels[0]["request"], 90, num_sms=132)
    assert plan.cfg.page_gather and plan.cfg.seqused_k


@pytest.mark.parametrize("n_block_min", [0, 1, 3])
def test_paged_load_order_uses_each_blocks_own_entries(n_block_min):
    """fwd.load_paged's look-ahead (paged_gather.load_order, ENTRY_AHEAD): every K and V load of a
    tile uses the page-table entries of its own key block, for 1 to 9 blocks. The look-ahead once read
    the entries of the block after next (wrong pages from the third block on: H200 run of 2026-12-02)."""
    from flash4.kernels.common.paged_gather import load_order

    for n in range(1, 10):
        loads = load_order(n_block_min, n_block_min + n)
        assert [(kind, block) for kind, block, _ in loads][:1] == [("K", n_block_min + n - 1)]
        assert sorted(block for kind, block, _ in loads if kind == "K") == list(range(n_block_min, n_block_min + n))
        assert sorted(block for kind, block, _ in loads if kind == "V") == list(range(n_block_min, n_block_min + n))
        assert all(block == entry for _, block, entry in loads), loads
    assert any(block != entry for _, block, entry in load_order(0, 3, ahead=2))  # the old look-ahead fails
