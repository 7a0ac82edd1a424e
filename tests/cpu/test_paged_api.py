"""Paged K/V (flash_attn_varlen_func with page_table and seqused_k; flash-attn-4's and vLLM's
layout) without a GPU: the paged argument errors and page-table value checks, the paged reference
and layout helpers against brute force, and the door's plumbing (metadata made contiguous, no
backward, windows) with the reference in place of the kernels (conftest.py)."""

import pytest
import torch
from cpu_helpers import F64, I32, cu, naive_varlen, paged_args, seqlens_ok, seqlens_raises, varlen_args, varlen_raises

import flash4
from flash4.autograd import PAGED_BACKWARD_ERROR
from flash4.reference import (PAGED_LAYOUTS, attention_varlen_ref, gather_paged, paged_kv_cache, paged_kv_to_varlen)
from flash4.validate import varlen_support_error

BF16 = torch.bfloat16


# ================================================================ paged argument errors
def test_paged_needs_seqused_k_and_no_cu_seqlens_k():
    paged = paged_args()
    varlen_raises(ValueError, ("cu_seqlens_k must be None when page_table is given",),
                  **dict(paged, cu_seqlens_k=cu([20, 0, 33])))
    varlen_raises(ValueError, ("seqused_k (batch,) int32 is required with page_table",), **dict(paged, seqused_k=None))
    args = varlen_args()
    varlen_raises(ValueError, ("cu_seqlens_k is None; it is required unless K/V are paged",),
                  **dict(args, cu_seqlens_k=None))


def test_empty_pages_refused():
    paged = paged_args()
    k = torch.randn(6, 0, 2, 64, dtype=BF16)
    varlen_raises(ValueError, ("page_size=0", "at least 1 row"), **dict(paged, k=k, v=k.clone()))


@pytest.mark.parametrize("page_size", [1, 3, 4, 5, 7, 8, 12, 16, 20, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
def test_supported_page_sizes_and_interleaved_layouts(page_size, layout, monkeypatch):
    """Any page size >= 1 by default (pages that are not multiples of 8: the gathered path); multiples
    of 8 only with FLASH4_SMALL_PAGES=0."""
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "0")
    error = varlen_support_error(**paged_args(page_size=page_size, layout=layout))
    if page_size % 8:
        assert "FLASH4_SMALL_PAGES=0" in error and f"page_size={page_size}" in error
    else:
        assert "q is on cpu" in error
    monkeypatch.delenv("FLASH4_SMALL_PAGES")
    assert "q is on cpu" in varlen_support_error(**paged_args(page_size=page_size, layout=layout))


def test_check_seqlens_page_indices():
    paged = paged_args()
    num_pages = paged["k"].shape[0]
    kw = dict(seqused_k=paged["seqused_k"], page_table=paged["page_table"], num_pages=num_pages, page_size=16)
    bad = paged["page_table"].clone()
    bad[2, 2] = num_pages  # sequence 2 (33 keys) uses pages 0..2 of its row
    seqlens_raises((f"page_table[2, 2]={num_pages} is not a page of the cache", f"num_pages = {num_pages}",
                    "uses pages 0..2"), paged, **dict(kw, page_table=bad))
    bad = paged["page_table"].clone()
    bad[0, 0] = -1
    seqlens_raises(("page_table[0, 0]=-1",), paged, **dict(kw, page_table=bad))
    fine = paged["page_table"].clone()
    fine[1, :] = 10 ** 6  # sequence 1 has no keys: its row is never read
    fine[0, 2] = -5  # sequence 0 (20 keys) reads pages 0..1 only
    seqlens_ok(paged, **dict(kw, page_table=fine))


# ================================================================ the reference and the layout helpers
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_reference_equals_contiguous(layout, page_size, causal):
    args = varlen_args((3, 0, 5, 2), (40, 0, 17, 1), d=16, dtype=F64)
    k_cache, v_cache, table, seqused_k = paged_kv_cache(args["k"], args["v"], args["cu_seqlens_k"], page_size,
                                                        layout=layout)
    paged = attention_varlen_ref(args["q"], k_cache, v_cache, args["cu_seqlens_q"], None, None, seqused_k, table,
                                 causal=causal, compute_dtype=F64)
    packed = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                  causal=causal, compute_dtype=F64)
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    # the brute force reading the paged storage itself
    out_n, lse_n = _naive_paged(args["q"], k_cache, v_cache, table, [0, 3, 3, 8], [3, 0, 5, 2], [40, 0, 17, 1], causal)
    torch.testing.assert_close(paged[0], out_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(paged[1], lse_n, rtol=1e-12, atol=1e-12)


def _naive_paged(q, k_cache, v_cache, table, offs_q, lens_q, lens_k, causal):
    page_size = k_cache.shape[1]
    hk = k_cache.shape[2]

    def key_of(b, j):
        page = int(table[b, j // page_size])
        return k_cache[page, j % page_size], v_cache[page, j % page_size]

    dummy = torch.zeros(1, hk, q.shape[2], dtype=F64)
    return naive_varlen(q, dummy, dummy, offs_q, lens_q, None, lens_k, 0.25, causal, key_of=key_of)


@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_paged_layout_round_trip(layout, page_size):
    args = varlen_args((1, 1, 1, 1), (70, 0, 16, 3), hk=2, d=64)
    seqused = torch.tensor([65, 0, 16, 2], dtype=I32)
    for used in (None, seqused):
        gen = torch.Generator().manual_seed(7)
        k_cache, v_cache, table, seqused_k = paged_kv_cache(args["k"], args["v"], args["cu_seqlens_k"], page_size,
                                                            used, layout=layout, generator=gen)
        lengths = [70, 0, 16, 3] if used is None else seqused.tolist()
        assert seqused_k.dtype == I32 and seqused_k.tolist() == lengths
        assert table.dtype == I32 and table.shape == (4, max(-(-n // page_size) for n in lengths) + 1)
        num_pages = k_cache.shape[0]
        assert k_cache.shape == v_cache.shape == (num_pages, page_size, 2, 64) and k_cache.stride(-1) == 1
        assert ((table >= 0) & (table < num_pages)).all()
        used_pages = [int(table[b, i]) for b, n in enumerate(lengths) for i in range(-(-n // page_size))]
        assert len(set(used_pages)) == len(used_pages)  # no page shared between sequences
        k_back, v_back, cu_back = paged_kv_to_varlen(k_cache, v_cache, table, seqused_k)
        keep = torch.cat([torch.arange(o, o + n) for o, n in zip([0, 70, 70, 86], lengths)])
        assert torch.equal(k_back, args["k"][keep]) and torch.equal(v_back, args["v"][keep])
        assert cu_back.tolist() == cu(lengths).tolist()
        if layout == "interleaved":
            assert k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
            assert k_cache.stride(1) == 2 * 2 * 64 and v_cache.data_ptr() - k_cache.data_ptr() == 2 * 64 * 2
        if layout == "vllm":
            assert k_cache.stride(1) == 2 * 2 * 64 and k_cache.stride(2) == 2 * 64
            assert v_cache.data_ptr() - k_cache.data_ptr() == 64 * 2


def test_paged_layout_permutes_pages_and_fills_the_rest():
    k = torch.arange(64 * 2 * 8, dtype=torch.float32).view(64, 2, 8)
    k_cache, _, table, _ = paged_kv_cache(k, k, cu([64]), 8, spare_pages=0, generator=torch.Generator().manual_seed(1))
    assert sorted(table[0, :8].tolist()) == list(range(8)) and table[0, :8].tolist() != list(range(8))
    k_cache, _, table, _ = paged_kv_cache(k, k, cu([60]), 8, fill=float("nan"))
    tail = k_cache[table[0, 7], 4:]
    assert tail.isnan().all() and not k_cache[table[0, 7], :4].isnan().any()
    assert gather_paged(k_cache, table[0], 60).equal(k[:60])
    with pytest.raises(ValueError, match="layout must be one of"):
        paged_kv_cache(k, k, cu([64]), 8, layout="bad")


# ================================================================ API plumbing with reference kernels
def test_varlen_func_paged_and_non_contiguous_metadata(cpu_kernels):
    paged = paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33), layout="interleaved")
    table = torch.zeros(3, 2 * paged["page_table"].shape[1], dtype=I32)[:, ::2]
    table.copy_(paged["page_table"])  # a non-contiguous page_table is made contiguous
    out = flash4.flash_attn_varlen_func(**dict(paged, page_table=table), max_seqlen_q=5, causal=True)
    ref, _ = attention_varlen_ref(paged["q"], paged["k"], paged["v"], paged["cu_seqlens_q"], None, None,
                                  paged["seqused_k"], paged["page_table"], causal=True)
    assert torch.equal(out, ref.to(BF16))
    assert cpu_kernels[0]["page_table"].is_contiguous() and cpu_kernels[0]["cu_seqlens_k"] is None


def test_paged_backward_raises(cpu_kernels):
    paged = paged_args()
    q = paged["q"].requires_grad_()
    out = flash4.flash_attn_varlen_func(**paged)  # the forward runs
    assert out.requires_grad
    with pytest.raises(RuntimeError) as err:
        out.float().sum().backward()
    assert str(err.value) == PAGED_BACKWARD_ERROR
    with torch.no_grad():
        assert not flash4.flash_attn_varlen_func(**paged).requires_grad


def test_paged_varlen_routes_the_window(cpu_kernels):
    paged = paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33))
    out = flash4.flash_attn_varlen_func(**paged, causal=True, window_size=(6, -1))
    ref, _ = attention_varlen_ref(paged["q"], paged["k"], paged["v"], paged["cu_seqlens_q"], None, None,
                                  paged["seqused_k"], paged["page_table"], causal=True, window_size=(6, -1))
    assert torch.equal(out, ref.to(BF16)) and cpu_kernels[0]["window_size"] == (6, None)
