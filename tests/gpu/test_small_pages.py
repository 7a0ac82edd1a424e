"""Paged K/V with pages of any size >= 1 on the GPU (marker gpu; skipped without CUDA).

Pages that are not multiples of 8 rows are gathered row by row (FwdConfig.page_gather,
kernels/common/paged_gather.py); multiples of 8 keep TMA page pieces unless FLASH4_PAGE_GATHER_MAX
sends them to the gather too (the A/B switch of issue 25 item 3). Every call writes into NaN-poisoned
out / lse and is checked against the float32 reference (err <= 2 x PyTorch same-dtype err + atol,
LSE too), and a paged call equals the same keys laid out contiguously bit for bit.
Doors: flash_attn_varlen_func (page_table + seqused_k; also vLLM's decode shape) and
flash_attn_with_kvcache (decode and speculative steps, appends across page boundaries, split-KV
automatic and off). Pages 1, 3, 4, 5, 12, 16, 24; causal and not; GQA; head dims 64 / 128 (every
head dim and fp16 once); cache slots outside the sequences poisoned with NaN must not leak.
"""

import math

import pytest
import torch

from flash4 import flash_attn_varlen_func
from flash4.config import SUPPORTED_HEADDIMS
from flash4.reference import varlen_row_mask

from gpu_helpers import check_fwd_varlen as check_fwd, make_varlen
from gpu_helpers import PAGED_LENS as LENS, kvcache_append_across_pages, paged_pool as paged
from gpu_helpers import paged_tile_differs, run_poisoned_varlen as run_poisoned


@pytest.fixture(autouse=True)
def _small_pages_on(monkeypatch):
    """Page sizes that are not multiples of 8 are opt-in (FLASH4_SMALL_PAGES=1, flash4.env) until
    this file passes on the H200."""
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "1")

PAGES = (1, 3, 4, 5, 12, 16, 24)


# ================================================================ flash_attn_varlen_func
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", PAGES)
def test_varlen_small_pages(page_size, causal, d):
    """GQA 8 / 2 heads: within the rule against the reference, and bit for bit the contiguous call."""
    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, d, seed=page_size)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, page_size, seed=page_size)
    out_p, lse_p = check_fwd(q, k_cache, v_cache, cu_q, None, causal, seqused_k=seqused_k, page_table=table)
    out_c, lse_c = run_poisoned(q, k, v, cu_q, cu_k, causal)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows]) and torch.equal(lse_p[:, rows], lse_c[:, rows])


@pytest.mark.parametrize("page_size", [1, 5, 12])
def test_varlen_small_pages_nan_slots_do_not_leak(page_size):
    """Every cache slot outside the sequences (page tails, spare pages) holds NaN: the results are
    bit for bit those over finite filler."""
    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, 128, seed=40 + page_size)
    clean = paged(k, v, cu_k, page_size, seed=7)
    poisoned = paged(k, v, cu_k, page_size, seed=7, fill=math.nan)
    assert torch.equal(clean[2], poisoned[2])
    out_c, lse_c = run_poisoned(q, clean[0], clean[1], cu_q, None, True, seqused_k=clean[3], page_table=clean[2])
    out_n, lse_n = check_fwd(q, poisoned[0], poisoned[1], cu_q, None, True, seqused_k=poisoned[3],
                             page_table=poisoned[2])
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_c[rows], out_n[rows]) and torch.equal(lse_c[:, rows], lse_n[:, rows])


@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_gathered_pages_every_headdim(d):
    """Every head dim through the gather (page 3): threads per row 8 (4 at d96), tile_n 112 / 80."""
    q, k, v, cu_q, cu_k = make_varlen(*LENS, 4, 1, d, seed=d)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, 3, seed=d)
    out_p, _ = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    if paged_tile_differs(d):  # the portable family's d96 / d256 gather tile: another page layout, same config
        k5, v5, table5, used5 = paged(k, v, cu_k, 5, seed=d + 1)
        out_c, _ = run_poisoned(q, k5, v5, cu_q, None, True, seqused_k=used5, page_table=table5)
    else:
        out_c, _ = run_poisoned(q, k, v, cu_q, cu_k, True)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows])


def test_gathered_pages_fp16_and_public_door():
    """fp16, page 5, through the public function (check_seqlens on)."""
    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, 128, dtype=torch.float16, seed=3)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, 5, seed=3)
    ref, _ = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 300, seqused_k=seqused_k, page_table=table,
                                 causal=True, check_seqlens=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("page_size", [1, 4])
def test_varlen_decode_shape_small_pages(page_size):
    """vLLM's decode through the varlen door: q (B, H, D), cu_seqlens_q = arange(B + 1), max_seqlen_q 1.
    Within the rule against the reference, and bit for bit the same call over a pool whose unused
    slots hold finite filler instead of NaN. (Not bit for bit the contiguous call: a decode plan's
    split count follows the cache's capacity, here the page table's, so the two sum in other orders;
    H200 2026-12-02: equal to 1 bf16 ulp, both within the rule.)"""
    b, h, hk, d = 6, 32, 8, 128
    lens_k = [1, 17, 300, 1000, 4, 2049]
    q, k, v, cu_q, cu_k = make_varlen([1] * b, lens_k, h, hk, d, seed=page_size)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, page_size, seed=page_size, fill=math.nan)
    out_p, lse_p = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    k_clean, v_clean, table_clean, _ = paged(k, v, cu_k, page_size, seed=page_size)
    assert torch.equal(table_clean, table)
    out_c, lse_c = check_fwd(q, k_clean, v_clean, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)


@pytest.mark.parametrize("page_size", [16, 32])
def test_page_gather_switch_is_bitwise_tma(page_size, monkeypatch):
    """FLASH4_PAGE_GATHER_MAX sends pages of 16 / 32 rows to the gather (the A/B of issue 25 item 3):
    the same bits as their TMA page pieces."""
    from flash4.config.sm90 import decode_plan

    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, 128, seed=60 + page_size)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, page_size, seed=page_size, fill=math.nan)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "0")
    out_t, lse_t = run_poisoned(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "32")
    decode_plan.cache_clear()
    out_g, lse_g = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_t[rows], out_g[rows]) and torch.equal(lse_t[:, rows], lse_g[:, rows])


GATHER_SWITCHES = {  # (FLASH4_GATHER_ZERO_FILL, FLASH4_PAGED_KV_STAGES); the default: zero-fill, 2 stages
    "plain": ("0", "2"), "s3": ("0", "3"), "zf_s3": ("1", "3"),
}


@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("page_size", [1, 3, 16])  # 1: one key row per page
@pytest.mark.parametrize("switches", list(GATHER_SWITCHES))
def test_gather_candidates_bitwise(switches, page_size, d, monkeypatch):
    """The paged prefill switches of issue 25 (tools/ab_pages.py: producer zero-fill off, a third K/V
    stage) against the default gathered path (zero-fill, 2 stages), NaN in every slot outside the
    sequences: the same bits, and within the rule against the reference. d96: 4 threads per row and
    a 64-byte swizzle; d128: 8 threads per row, 128-byte swizzle (4 kernels each, the page size
    does not change a gathered kernel)."""
    from flash4.config.sm90 import decode_plan

    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, d, seed=80 + page_size)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, page_size, seed=page_size, fill=math.nan)
    out_d, lse_d = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    for name, value in zip(("FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES"), GATHER_SWITCHES[switches]):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "16")
    decode_plan.cache_clear()
    out_s, lse_s = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_d[rows], out_s[rows]) and torch.equal(lse_d[:, rows], lse_s[:, rows])


# ================================================================ flash_attn_with_kvcache
@pytest.mark.parametrize("num_splits", [0, 1], ids=["auto", "nosplit"])
@pytest.mark.parametrize("sq", [1, 4], ids=["decode", "spec4"])
@pytest.mark.parametrize("page_size, d", [(p, 128) for p in PAGES] + [(p, 64) for p in (1, 5, 24)])
def test_kvcache_small_pages_append_across_pages(page_size, d, sq, num_splits):
    """32 / 8 heads; sq new tokens appended at lengths that put them across page boundaries, into a
    pool whose unused slots are NaN; the attention against the reference; the same step again
    without the append gives the same bits (gpu_helpers.kvcache_append_across_pages)."""
    kvcache_append_across_pages(page_size, d, sq, num_splits)
