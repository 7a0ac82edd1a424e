"""Paged K/V through flash_attn_varlen_func on the GPU (page_table + seqused_k; marker gpu; skipped
without CUDA).

A paged call equals the same keys laid out contiguously (cu_seqlens_k) bit for bit, and is within
the rule against the float32 reference (gpu_helpers.check_fwd_varlen: NaN-poisoned out/lse, rows
outside every sequence unwritten): page sizes 8..256, every head dim (page pieces of
gcd(page_size, tile_n) rows per TMA copy), the interleaved K/V cache layouts (K and V as two views
of one tensor; vLLM's), seqused_k below the laid-out keys, the public function with check_seqlens
(a page index outside the cache raises), and the refusal of a backward through a paged cache.
Decode against a paged cache (flash_attn_with_kvcache): test_kvcache.py.
"""

import pytest
import torch

from flash4 import flash_attn_varlen_func
from flash4.config import SUPPORTED_HEADDIMS
from flash4.reference import paged_kv_cache, varlen_row_mask

from gpu_helpers import (DEV, I32, check_fwd_varlen as check_fwd, make_varlen, paged_tile_differs,
                         run_poisoned_varlen as run_poisoned)


# ================================================================ paged K/V
def paged_from(q, k, v, cu_q, cu_k, page_size, layout="separate", seed=0):
    return paged_kv_cache(k, v, cu_k, page_size, layout=layout, generator=torch.Generator().manual_seed(seed))


PAGED_LENS = ([5, 0, 300, 1, 129, 64], [1000, 7, 300, 0, 129, 1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [8, 16, 32, 64, 128, 256])
def test_paged_is_bitwise_contiguous(page_size, causal):
    """A paged call equals the same data laid out contiguously (cu_seqlens_k), bit for bit, and the
    reference; the page tails and unused table columns hold other (finite) data."""
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, 128, seed=page_size)
    k_cache, v_cache, table, seqused_k = paged_from(q, k, v, cu_q, cu_k, page_size, seed=page_size)
    out_p, lse_p = check_fwd(q, k_cache, v_cache, cu_q, None, causal, seqused_k=seqused_k, page_table=table)
    out_c, lse_c = run_poisoned(q, k, v, cu_q, cu_k, causal)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows]) and torch.equal(lse_p[:, rows], lse_c[:, rows])


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_paged_every_headdim(d, page):
    """The page piece per TMA copy is gcd(page_size, tile_n): 16 rows at d192 (tile_n 112) and d256 (80);
    pieces of <= 32 rows issued by the four producer warps (page 16 everywhere, page 64 at d192 / d256:
    flash4.config.PAGE_PIECES_ALL_WARPS)."""
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 4, 1, d, seed=d)
    k_cache, v_cache, table, seqused_k = paged_from(q, k, v, cu_q, cu_k, page, seed=d)
    out_p, _ = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    if paged_tile_differs(d):  # the portable family's d96 / d256 gather tile: another page layout, same config
        other = 16 if page != 16 else 64
        k16, v16, table16, used16 = paged_from(q, k, v, cu_q, cu_k, other, seed=d + 1)
        out_c, _ = run_poisoned(q, k16, v16, cu_q, None, True, seqused_k=used16, page_table=table16)
    else:
        out_c, _ = run_poisoned(q, k, v, cu_q, cu_k, True)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows])


@pytest.mark.parametrize("layout", ["interleaved", "vllm"])
def test_paged_interleaved_cache_layouts(layout):
    """K and V as two views of one cache tensor (page/token strides not their own sizes): equal to
    separate K/V tensors holding the same pages."""
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, 128, seed=21)
    sep = paged_from(q, k, v, cu_q, cu_k, 16, seed=5)
    inter = paged_from(q, k, v, cu_q, cu_k, 16, layout=layout, seed=5)
    assert torch.equal(sep[2], inter[2])  # same page table (same seed)
    assert inter[0].stride(1) == 2 * 2 * 128  # the token stride spans K and V
    out_s, lse_s = run_poisoned(q, sep[0], sep[1], cu_q, None, True, seqused_k=sep[3], page_table=sep[2])
    out_i, lse_i = check_fwd(q, inter[0], inter[1], cu_q, None, True, seqused_k=inter[3], page_table=inter[2])
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_s[rows], out_i[rows]) and torch.equal(lse_s[:, rows], lse_i[:, rows])


def test_paged_seqused_below_pages_and_public_api():
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, 128, seed=9)
    k_cache, v_cache, table, _ = paged_from(q, k, v, cu_q, cu_k, 64)
    seqused_k = torch.tensor([999, 0, 250, 0, 65, 1], dtype=I32, device=DEV)  # inside the laid-out keys
    check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 300, seqused_k=seqused_k, page_table=table,
                                 causal=True, check_seqlens=True)
    ref, _ = run_poisoned(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    assert torch.equal(out, ref)
    bad = table.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=.* is not a page of the cache"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, seqused_k=seqused_k, page_table=bad,
                               check_seqlens=True)


# ================================================================ backward (refused)
def test_paged_backward_raises():
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 4, 2, 64)
    k_cache, v_cache, table, seqused_k = paged_from(q, k, v, cu_q, cu_k, 16)
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, seqused_k=seqused_k, page_table=table)
    with pytest.raises(RuntimeError, match="no backward for a paged K/V cache"):
        out.sum().backward()
