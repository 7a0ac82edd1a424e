"""One decode engine behind every door, on the GPU (marker gpu; skipped without CUDA).

flash_attn_func, the SDPA plug-in and flash_attn_varlen_func (vLLM's decode layout: q (B, H, D),
cu_seqlens_q = arange(B + 1), max_seqlen_q = 1, paged K/V with seqused_k and a page table; and
uneven / padded query counts up to 8) run short-query, long-key calls as the decode step of
flash_attn_with_kvcache (flash4.config.decode_door). Each case: the call goes through the decode
step (a spy on flash4.forward._door_decode), writes every element of NaN-poisoned out / lse
(flash4.forward.run with the caller's buffers) and is within the rule against the float32
reference (max |x - ref| <= 2 * max |PyTorch same-dtype - ref| + atol, out and lse); q lengths
1, 2, 4, 8, GQA 32/8 and MHA, dense and paged (pages 16 and 64), causal or not; a decode step of
each door captured in a CUDA graph and replayed after its inputs changed in place.
"""

import math

import pytest
import torch

import flash4
from flash4 import forward
from flash4.reference import (OUT_ATOL, fwd_errors, kvcache_ref, max_abs_err, paged_kv_cache, varlen_fwd_errors,
                              varlen_row_mask)
from flash4.request import Request

from gpu_helpers import BF16, DEV, I32, cu_seqlens


@pytest.fixture
def door_decodes(monkeypatch):
    """Counts flash4.forward._door_decode calls (the door's call ran as a decode step). flash4.memo is
    off here: a prepared call (a door's repeated signature) launches its decode step without
    flash4.forward._door_decode (tests/cpu/test_memo_cpu.py checks it launches the same kernels)."""
    from flash4 import memo

    monkeypatch.setattr(memo, "ENABLED", False)
    calls = []
    inner = forward._door_decode

    def spy(*args, **kwargs):
        calls.append(args[0].seq.layout)
        return inner(*args, **kwargs)

    monkeypatch.setattr(forward, "_door_decode", spy)
    return calls


def _within(name, got, ref, pt, atol):
    err, pt_err = max_abs_err(got.float(), ref.float()), max_abs_err(pt.float(), ref.float())
    assert err <= 2 * pt_err + atol, f"{name}: err {err:.3e} > 2 * PyTorch err {pt_err:.3e} + {atol}"


def _dense_inputs(b, sq, sk, h, hk, d=128, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=gen, device=DEV, dtype=BF16) for s, n in ((sq, h), (sk, hk), (sk, hk)))


# ================================================================ flash_attn_func (dense)
@pytest.mark.parametrize("sq", [1, 2, 4, 8])
@pytest.mark.parametrize("h,hk", [(32, 8), (8, 8)], ids=["gqa", "mha"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_door_decode(door_decodes, sq, h, hk, causal):
    b, sk = 2, 5000
    q, k, v = _dense_inputs(b, sq, sk, h, hk, seed=sq)
    out = torch.full((b, sq, h, 128), math.nan, dtype=BF16, device=DEV)
    lse = torch.full((b, h, sq), math.nan, dtype=torch.float32, device=DEV)
    forward.run(Request.dense(q, k, v, None, causal), out=out, lse=lse)
    torch.cuda.synchronize()
    assert door_decodes == ["dense"]
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, causal=causal)
    assert errs["ok"], errs
    public = flash4.flash_attn_func(q, k, v, causal=causal)  # the door itself: the same step
    assert door_decodes == ["dense", "dense"] and torch.equal(public, out)


def test_dense_door_batch1_128k(door_decodes):
    """The issue's cell: batch 1 x 128k keys, 32/8 heads: split-KV and packed GQA through flash_attn_func."""
    q, k, v = _dense_inputs(1, 1, 131072, 32, 8)
    out, lse = flash4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert door_decodes == ["dense"]
    errs = fwd_errors(q, k, v, out, lse, causal=True)
    assert errs["ok"], errs


def test_dense_door_with_grad_stays_dense(door_decodes):
    q, k, v = (t.requires_grad_() for t in _dense_inputs(1, 1, 4096, 8, 2))
    out = flash4.flash_attn_func(q, k, v)
    out.sum().backward()
    assert door_decodes == [] and q.grad is not None and not q.grad.isnan().any()


# ================================================================ the SDPA plug-in
def test_sdpa_decode(door_decodes, monkeypatch):
    import torch.nn.attention as attention
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash4.integrations import sdpa

    if not sdpa.available():
        pytest.skip(f"torch {torch.__version__} has no flash-attention plug-in registry")
    sdpa.register()
    attention.activate_flash_attention_impl("flash4")
    try:
        q, k, v = _dense_inputs(2, 1, 8192, 32, 8, seed=5)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True)
        torch.cuda.synchronize()
    finally:
        attention.restore_flash_attention_impl()
    assert door_decodes == ["dense"]
    errs = fwd_errors(q, k, v, out.transpose(1, 2))
    assert errs["ok"], errs


# ================================================================ flash_attn_varlen_func (paged)
def _paged_inputs(len_q, len_k, h, hk, page_size, d=128, seed=0, pad_q=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(sum(len_q) + pad_q, h, d, generator=gen, device=DEV, dtype=BF16)
    k, v = (torch.randn(sum(len_k), hk, d, generator=gen, device=DEV, dtype=BF16) for _ in range(2))
    cu_k = cu_seqlens(len_k)
    k_cache, v_cache, table, seqused_k = paged_kv_cache(k, v, cu_k, page_size, extra_pages_per_seq=2,
                                                        generator=torch.Generator(device="cpu").manual_seed(seed))
    return q, k, v, cu_seqlens(len_q), cu_k, k_cache, v_cache, table, seqused_k


@pytest.mark.parametrize("len_q,max_q", [
    ((1,) * 8, 1),           # vLLM decode: cu_seqlens_q = arange(B + 1)
    ((1,), 1),               # batch 1 (the 128k decode cell's shape)
    ((1, 0, 1, 1, 0), 1),    # padding sequences of length 0 (CUDA-graph batch padding)
    ((2, 2, 2), 2),
    ((4, 1, 0, 3), 4),       # uneven speculative drafts
    ((8, 8), 8),
], ids=["vllm", "b1", "padded", "q2", "uneven4", "q8"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_door_decode(door_decodes, len_q, max_q, page_size, causal):
    len_k = tuple(1500 + 700 * i for i in range(len(len_q)))
    q, k, v, cu_q, cu_k, k_cache, v_cache, table, seqused_k = _paged_inputs(len_q, len_k, 32, 8, page_size, pad_q=3)
    out = torch.full(q.shape, math.nan, dtype=BF16, device=DEV)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float32, device=DEV)
    request = Request.varlen(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k, page_table=table,
                             softmax_scale=1 / math.sqrt(128), causal=causal)
    forward.run(request, out=out, lse=lse)
    torch.cuda.synchronize()
    assert door_decodes == ["paged"]
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    assert not out[rows].isnan().any() and not lse[:, rows].isnan().any()
    assert out[~rows].isnan().all() and lse[:, ~rows].isnan().all(), "a row outside every sequence was written"
    errs = varlen_fwd_errors(q, k_cache, v_cache, cu_q, None, out, lse, None, seqused_k, table, None, causal)
    assert errs["ok"], errs
    public = flash4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k,
                                           page_table=table, causal=causal)
    assert torch.equal(public[rows], out[rows])


# ================================================================ CUDA graphs
def test_cuda_graph_dense_door():
    q, k, v = _dense_inputs(2, 1, 4096, 32, 8, seed=11)
    out = torch.empty_like(q)

    def step():
        out.copy_(flash4.flash_attn_func(q, k, v, causal=True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device=DEV).manual_seed(12)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV, dtype=BF16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash4.flash_attn_func(q, k, v, causal=True))
    errs = fwd_errors(q, k, v, out, causal=True)
    assert errs["ok"], errs


def test_cuda_graph_vllm_decode():
    """vLLM's decode step captured once, replayed after seqused_k, the page table and q changed in place."""
    b, h, hk, d, page_size, max_pages = 6, 32, 8, 128, 16, 256
    gen = torch.Generator(device=DEV).manual_seed(13)
    num_pages = b * max_pages + 8
    k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    seqused_k = torch.tensor([4000, 1, 0, 2048, 17, 4096], dtype=I32, device=DEV)
    cu_q = torch.arange(b + 1, dtype=I32, device=DEV)
    q = torch.randn(b, h, d, generator=gen, device=DEV, dtype=BF16)
    out = torch.empty_like(q)

    def step():
        out.copy_(flash4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None, seqused_k=seqused_k,
                                                page_table=table, causal=True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seqused_k.copy_(torch.tensor([5, 4096, 3000, 0, 1024, 77], dtype=I32))
    table.copy_(torch.randperm(num_pages, generator=gen, device=DEV)[: table.numel()].view_as(table).to(I32))
    q.copy_(torch.randn(q.shape, generator=gen, device=DEV, dtype=BF16))
    graph.replay()
    torch.cuda.synchronize()
    eager = flash4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None, seqused_k=seqused_k,
                                          page_table=table, causal=True)
    assert torch.equal(out, eager)
    lengths = seqused_k.tolist()
    ref, _ = kvcache_ref(q.unsqueeze(1), k_cache, v_cache, lengths, table, causal=True)
    pt, _ = kvcache_ref(q.unsqueeze(1), k_cache, v_cache, lengths, table, causal=True, upcast=False)
    _within("out", out.unsqueeze(1), ref, pt, OUT_ATOL)
