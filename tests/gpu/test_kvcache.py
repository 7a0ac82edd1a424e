"""The KV cache on the GPU: flash_attn_with_kvcache, the decode step (marker gpu; skipped without CUDA).

Each call writes into a NaN-filled out: the caches after the in-place append equal the expected
ones (plain indexing), out and lse are within the rule against the float32 reference
(flash4.reference.kvcache_ref: max |x - ref| <= 2 * max |PyTorch same-dtype - ref| + atol).
Coverage: dense caches of 1..64k keys (32 query / 8 KV heads, d128), one new query, speculative
steps of 4 and no append; a paged page-64 cache (random page permutation, vLLM's interleaved
layout too) with lengths 0..40k, reproducible bit for bit without the append; split-KV automatic,
off and forced; an int cache_seqlens and cache_batch_idx into a strided cache; no recompiles over
50 random paged decode steps; a decode step captured in a CUDA graph and replayed after its inputs
changed in place (dense and paged).
"""

import math
import random

import pytest
import torch

from flash4 import flash_attn_with_kvcache
from flash4.reference import gather_paged, kvcache_ref, max_abs_err

from gpu_helpers import BF16, DEV, I32, compile_count


# ================================================================ KV cache (decode)
def kv_inputs(b, sq, s_new, h, hk, d, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, device=DEV, dtype=BF16)
    kn = torch.randn(b, s_new, hk, d, generator=gen, device=DEV, dtype=BF16)
    vn = torch.randn(b, s_new, hk, d, generator=gen, device=DEV, dtype=BF16)
    return q, kn, vn


def append_expected(k_cache, v_cache, kn, vn, cache_seqlens, page_table=None, rows=None):
    """The caches after the append, by plain indexing (a copy)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    page_size = k_cache.shape[1]
    for b, start in enumerate(cache_seqlens):
        for t in range(kn.shape[1]):
            pos = start + t
            where = ((int(page_table[b, pos // page_size]), pos % page_size) if page_table is not None
                     else (rows[b] if rows is not None else b, pos))
            k_cache[where], v_cache[where] = kn[b, t], vn[b, t]
    return k_cache, v_cache


def check_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, page_table=None, causal=True, num_splits=0,
                  cache_batch_idx=None):
    """flash_attn_with_kvcache into a NaN-filled out: the cache after the append and the attention
    against the float32 reference (2x-PyTorch rule)."""
    seqlens = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * q.shape[0]
    s_new = 0 if kn is None else kn.shape[1]
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else None
    k_exp, v_exp = (append_expected(k_cache, v_cache, kn, vn, seqlens, page_table, rows) if s_new
                    else (k_cache.clone(), v_cache.clone()))
    out = torch.full_like(q, math.nan)
    res, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, page_table,
                                       cache_batch_idx=cache_batch_idx, causal=causal, num_splits=num_splits,
                                       return_lse=True, out=out)
    torch.cuda.synchronize()
    assert res is out and not out.isnan().any() and not lse.isnan().any()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "the append wrote the wrong cache slots"
    lengths = [n + s_new for n in seqlens]
    ref_out, ref_lse = kvcache_ref(q, k_cache, v_cache, lengths, page_table, cache_batch_idx, causal=causal)
    pt_out, pt_lse = kvcache_ref(q, k_cache, v_cache, lengths, page_table, cache_batch_idx, causal=causal,
                                 upcast=False)
    out_err, pt_err = max_abs_err(out, ref_out), max_abs_err(pt_out, ref_out)
    assert out_err <= 2 * pt_err + 1e-4, (out_err, pt_err)
    lse_err, lse_pt_err = max_abs_err(lse, ref_lse), max_abs_err(pt_lse, ref_lse)
    assert lse_err <= 2 * lse_pt_err + 1e-3, (lse_err, lse_pt_err)
    return out, lse


@pytest.mark.parametrize("num_splits", [0, 1], ids=["auto", "nosplit"])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (4, 4), (1, 0)], ids=["decode", "spec4", "no-append"])
def test_decode_dense_cache_up_to_64k(sq, s_new, num_splits):
    """Cache lengths 1 .. 64k (after the append), 32 query / 8 KV heads, d128; split-KV chosen by
    the heuristic (batch 4 x 8 KV heads leaves most SMs idle) and disabled."""
    q, kn, vn = kv_inputs(4, sq, s_new, 32, 8, 128, seed=sq)
    gen = torch.Generator(device=DEV).manual_seed(1)
    k_cache = torch.randn(4, 65536, 8, 128, generator=gen, device=DEV, dtype=BF16)
    v_cache = torch.randn(4, 65536, 8, 128, generator=gen, device=DEV, dtype=BF16)
    start = [1 - s_new if s_new <= 1 else 0, 4096 - s_new, 30000, 65536 - s_new]
    cache_seqlens = torch.tensor([max(n, 0) for n in start], dtype=I32, device=DEV)
    check_kvcache(q, k_cache, v_cache, kn if s_new else None, vn if s_new else None, cache_seqlens,
                  num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 3], ids=["auto", "nosplit", "split3"])
@pytest.mark.parametrize("layout", ["separate", "vllm"])
def test_decode_paged_cache(layout, num_splits):
    """Paged page-64 cache (random page permutation, vLLM's interleaved layout too), lengths 0..40k
    before the append; each num_splits against the reference, and reproducible bit for bit."""
    b, hk, d, page_size, max_pages = 5, 8, 128, 64, 640
    num_pages = b * max_pages + 7
    gen = torch.Generator(device=DEV).manual_seed(2)
    if layout == "separate":
        k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
        v_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
    else:
        kv = torch.randn(num_pages, page_size, hk, 2 * d, generator=gen, device=DEV, dtype=BF16)
        k_cache, v_cache = kv.split(d, dim=-1)
    table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    cache_seqlens = torch.tensor([0, 63, 64, 12345, 40959], dtype=I32, device=DEV)
    q, kn, vn = kv_inputs(b, 1, 1, 32, hk, d, seed=3)
    out, lse = check_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, num_splits=num_splits)
    # the same step without the append (the new keys are in the cache now) gives the same bits
    again, lse2 = flash_attn_with_kvcache(q, k_cache, v_cache, None, None, cache_seqlens + 1, table, causal=True,
                                          num_splits=num_splits, return_lse=True)
    assert torch.equal(again, out) and torch.equal(lse2, lse)


def test_decode_int_cache_seqlens_and_batch_idx():
    q, kn, vn = kv_inputs(3, 2, 2, 8, 2, 64, seed=4)
    gen = torch.Generator(device=DEV).manual_seed(4)
    storage_k = torch.randn(6, 1100, 2, 64, generator=gen, device=DEV, dtype=BF16)
    storage_v = torch.randn(6, 1100, 2, 64, generator=gen, device=DEV, dtype=BF16)
    k_cache, v_cache = storage_k[:, :1024], storage_v[:, :1024]  # batch stride 1100 rows
    check_kvcache(q, k_cache, v_cache, kn, vn, 1000, cache_batch_idx=torch.tensor([5, 0, 3], dtype=I32, device=DEV))
    check_kvcache(q[:1], k_cache[:1], v_cache[:1], kn[:1], vn[:1], 1022)


# ================================================================ no recompiles, CUDA graphs
def test_fifty_decode_steps_compile_nothing_new():
    b_max, hk, d, page_size, max_pages = 16, 2, 128, 64, 32
    num_pages = b_max * max_pages
    k_cache = torch.randn(num_pages, page_size, hk, d, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    rng = random.Random(1)

    def step(i, b):
        q, kn, vn = kv_inputs(b, 1, 1, 16, hk, d, seed=i)
        table = torch.randperm(num_pages, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
        seqlens = torch.randint(0, max_pages * page_size, (b,), device=DEV, dtype=I32)
        flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, seqlens, table, causal=True)

    for b in (1, 4, b_max):  # every config the batch range can select (split-KV or not) compiles here
        step(0, b)
    torch.cuda.synchronize()
    before = compile_count()
    for i in range(1, 51):
        step(i, rng.randint(1, b_max))
    torch.cuda.synchronize()
    assert compile_count() == before


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_cuda_graph_decode_step(paged):
    """A decode step (append + attention) captured once, replayed after cache_seqlens, page_table, q
    and the new k/v changed in place: the result and the cache equal the eager call's."""
    b, h, hk, d, page_size, max_pages = 4, 16, 4, 128, 64, 16
    gen = torch.Generator(device=DEV).manual_seed(8)
    if paged:
        num_pages = b * max_pages + 8
        k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
        table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    else:
        k_cache = torch.randn(b, max_pages * page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
        table = None
    v_cache = torch.randn(k_cache.shape, generator=gen, device=DEV, dtype=BF16)
    q, kn, vn = kv_inputs(b, 1, 1, h, hk, d, seed=9)
    cache_seqlens = torch.tensor([10, 0, 500, 1000], dtype=I32, device=DEV)
    out = torch.empty_like(q)
    snapshot = k_cache.clone(), v_cache.clone()

    def step():
        flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, causal=True, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    cache_seqlens.copy_(torch.tensor([1023, 7, 0, 64], dtype=I32))
    if paged:
        table.copy_(torch.randperm(table.numel() + 8, generator=gen, device=DEV)[: table.numel()].view_as(table))
    for t in (q, kn, vn):
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV, dtype=BF16))
    k_cache.copy_(snapshot[0])
    v_cache.copy_(snapshot[1])
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone(), k_cache.clone(), v_cache.clone()

    k_cache.copy_(snapshot[0])
    v_cache.copy_(snapshot[1])
    eager = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(replayed[1], k_cache) and torch.equal(replayed[2], v_cache)
    assert torch.equal(replayed[0], eager)
    lengths = (cache_seqlens + 1).tolist()
    ref, _ = kvcache_ref(q, k_cache, v_cache, lengths, table, causal=True)
    pt, _ = kvcache_ref(q, k_cache, v_cache, lengths, table, causal=True, upcast=False)
    assert max_abs_err(eager, ref) <= 2 * max_abs_err(pt, ref) + 1e-4
    if paged:  # the replay read the new page table: the keys sit where the new table says
        assert torch.equal(gather_paged(k_cache, table[3], 65)[64], kn[3, 0])
