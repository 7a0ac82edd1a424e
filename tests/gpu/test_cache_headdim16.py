"""KV caches and paged pools at the sm_90 kernel head dims 16 / 32 / 48 / 80 / 112 on the GPU (marker
gpu; skipped without CUDA): FLASH4_CACHE_HEADDIM16=1, off by default until this file passes on
hardware (written 2026-12-05, compile-verified on the CPU: tests/cpu/test_cache_headdim16_cpu.py).

Doors: flash_attn_varlen_func with a page table (TMA page pieces and gathered pages; bit for bit the
same keys laid out contiguously; NaN in every slot outside the sequences leaks nowhere) and
flash_attn_with_kvcache (paged appends across page boundaries into NaN pools, decode and 4-token
steps, split-KV automatic and off; dense caches with cache_batch_idx and a NaN tail past
cache_seqlens). Every call writes into NaN-poisoned out / lse and is checked against the float32
reference by the 2x rule (LSE too)."""

import math

import pytest
import torch

from flash4 import flash_attn_with_kvcache
from flash4.reference import kvcache_ref, max_abs_err, varlen_row_mask

from gpu_helpers import BF16, DEV, I32, PAGED_LENS as LENS, check_fwd_varlen as check_fwd, make_varlen
from gpu_helpers import kvcache_append_across_pages as append_across_pages, paged_pool as paged
from gpu_helpers import run_poisoned_varlen as run_poisoned

NEW = (16, 32, 48, 80, 112)


@pytest.fixture(autouse=True)
def _cache_headdims_on(monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_HEADDIM16", "1")
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "1")
    monkeypatch.delenv("FLASH4_HEADDIM16", raising=False)
    monkeypatch.delenv("FLASH4_FAMILY", raising=False)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel head dims 16-112 of a cache are sm_90's (other GPUs keep 64/96/128/192/256)")


# ================================================================ flash_attn_varlen_func with a page table
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [5, 16, 64])
@pytest.mark.parametrize("d", NEW)
def test_varlen_paged(d, page_size, causal):
    """GQA 8 / 2: within the rule against the reference, and bit for bit the contiguous call."""
    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, d, seed=d + page_size)
    k_cache, v_cache, table, seqused_k = paged(k, v, cu_k, page_size, seed=d)
    out_p, lse_p = check_fwd(q, k_cache, v_cache, cu_q, None, causal, seqused_k=seqused_k, page_table=table)
    out_c, lse_c = run_poisoned(q, k, v, cu_q, cu_k, causal)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows]) and torch.equal(lse_p[:, rows], lse_c[:, rows])


@pytest.mark.parametrize("d, page_size", [(80, 5), (32, 16), (112, 64)])
def test_varlen_paged_nan_slots_do_not_leak(d, page_size):
    q, k, v, cu_q, cu_k = make_varlen(*LENS, 8, 2, d, seed=50 + d)
    clean = paged(k, v, cu_k, page_size, seed=9)
    poisoned = paged(k, v, cu_k, page_size, seed=9, fill=math.nan)
    out_c, lse_c = run_poisoned(q, clean[0], clean[1], cu_q, None, True, seqused_k=clean[3], page_table=clean[2])
    out_n, lse_n = check_fwd(q, poisoned[0], poisoned[1], cu_q, None, True, seqused_k=poisoned[3],
                             page_table=poisoned[2])
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_c[rows], out_n[rows]) and torch.equal(lse_c[:, rows], lse_n[:, rows])


# ================================================================ flash_attn_with_kvcache, paged
@pytest.mark.parametrize("num_splits", [0, 1], ids=["auto", "nosplit"])
@pytest.mark.parametrize("sq", [1, 4], ids=["decode", "spec4"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("d", NEW)
def test_kvcache_paged_append_across_pages(d, page_size, sq, num_splits):
    """gpu_helpers.kvcache_append_across_pages (test_small_pages' step) at these head dims: appends across page boundaries into a NaN pool, the
    attention within the rule, the same step again without the append bit for bit."""
    append_across_pages(page_size, d, sq, num_splits)


# ================================================================ flash_attn_with_kvcache, dense cache
@pytest.mark.parametrize("num_splits", [0, 1], ids=["auto", "nosplit"])
@pytest.mark.parametrize("batch_idx", [False, True], ids=["rows", "batch_idx"])
@pytest.mark.parametrize("d", NEW)
def test_kvcache_dense_decode(d, batch_idx, num_splits):
    """32 / 8 heads, one new token appended per sequence into a dense cache whose slots past
    cache_seqlens hold NaN: out / lse within the rule, and bit for bit the step over finite filler."""
    b, h, hk, cap = 4, 32, 8, 3000
    gen = torch.Generator(device=DEV).manual_seed(d)
    rows = torch.tensor([3, 0, 5, 1], dtype=I32, device=DEV) if batch_idx else None
    batch_cache = 6 if batch_idx else b
    starts = torch.tensor([0, 17, 1500, cap - 1], dtype=I32, device=DEV)
    q = torch.randn(b, 1, h, d, generator=gen, device=DEV, dtype=BF16)
    kn = torch.randn(b, 1, hk, d, generator=gen, device=DEV, dtype=BF16)
    vn = torch.randn_like(kn)
    k_base = torch.randn(batch_cache, cap, hk, d, generator=gen, device=DEV, dtype=BF16)
    v_base = torch.randn_like(k_base)
    results = []
    for fill in (0.5, math.nan):
        k_cache, v_cache = k_base.clone(), v_base.clone()
        for i, n in enumerate(starts.tolist()):
            row = int(rows[i]) if rows is not None else i
            k_cache[row, n:], v_cache[row, n:] = fill, fill  # past the valid keys: filler or NaN
        out = torch.full_like(q, math.nan)
        res, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, starts, cache_batch_idx=rows, causal=True,
                                           num_splits=num_splits, return_lse=True, out=out)
        torch.cuda.synchronize()
        assert res is out and not out.isnan().any() and not lse.isnan().any()
        lengths = [n + 1 for n in starts.tolist()]
        ref_out, ref_lse = kvcache_ref(q, k_cache, v_cache, lengths, cache_batch_idx=rows, causal=True)
        pt_out, pt_lse = kvcache_ref(q, k_cache, v_cache, lengths, cache_batch_idx=rows, causal=True, upcast=False)
        assert max_abs_err(out, ref_out) <= 2 * max_abs_err(pt_out, ref_out) + 1e-4
        assert max_abs_err(lse, ref_lse) <= 2 * max_abs_err(pt_lse, ref_lse) + 1e-3
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_switch_off_refuses(monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_HEADDIM16", "0")
    q = torch.randn(2, 1, 8, 80, device=DEV, dtype=BF16)
    cache = torch.randn(2, 64, 2, 80, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match="headdim 80 .* not supported here"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=10)
