"""A value head dim different from the query/key head dim on the GPU (issue 13 item 1; marker gpu,
skipped without CUDA): DeepSeek-V3/R1 MLA prefill (q/k 192, v 128), 128/64 and 64/128.

out (B, Sq, H, Dv), lse unchanged, softmax_scale 1/sqrt(D of q). Forward (out, lse) and backward
(dq, dk, dv) against the float32 reference (flash4.reference: einsums, any Dv), the usual
2x-PyTorch-error rule + atol, NaN-poisoned outputs; causal and not, GQA, seqlen not a multiple of
the tiles, seqlen_q != seqlen_k, one varlen case (forward and backward), decode through
flash_attn_with_kvcache (plain, and paged with split-KV and GQA packing).
"""

import itertools
import math

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash4 import forward
from flash4.request import Request
from flash4.reference import LSE_ATOL, OUT_ATOL, attention_varlen_ref, fwd_errors, kvcache_ref, varlen_fwd_errors

from gpu_helpers import BF16, assert_grads, check_bwd_dv as check_bwd, inputs, poisoned_fwd_buffers, ref_grads

PAIRS = [(192, 128), (128, 64), (64, 128)]
IDS = [f"{d}v{dv}" for d, dv in PAIRS]


def check_fwd(q, k, v, causal=False):
    out, lse = poisoned_fwd_buffers(q, v.shape[-1])
    forward.run(Request.dense(q, k, v, None, causal), out=out, lse=lse)  # None: 1/sqrt(d of q)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, causal)
    assert errs["ok"], errs
    return out, lse


# ================================================================ dense
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_forward_backward(d, dv, causal):
    """MHA, seqlen_q != seqlen_k, neither a multiple of the tiles."""
    q, k, v, dout = inputs(2, 300, 421, 4, 4, d, dv, seed=d + dv)
    out, _ = check_fwd(q, k, v, causal)
    assert out.shape == (2, 300, 4, dv)
    check_bwd(q, k, v, dout, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_gqa(d, dv, causal):
    q, k, v, dout = inputs(1, 333, 333, 8, 2, d, dv, seed=3)
    check_fwd(q, k, v, causal)
    check_bwd(q, k, v, dout, causal)


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_long_and_short(d, dv):
    """Many key blocks (several pipeline turns) and a single query row."""
    q, k, v, _ = inputs(1, 1, 2000, 2, 2, d, dv, seed=4)
    check_fwd(q, k, v, True)
    q, k, v, dout = inputs(1, 1100, 1100, 2, 1, d, dv, seed=5)
    check_fwd(q, k, v, True)
    check_bwd(q, k, v, dout, True)


def test_deterministic_backward():
    q, k, v, dout = inputs(1, 500, 500, 4, 4, 192, 128, seed=6)
    a = check_bwd(q, k, v, dout, True, deterministic=True)
    b = check_bwd(q, k, v, dout, True, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_public_api_autograd(d, dv):
    q, k, v, dout = inputs(1, 256, 300, 4, 2, d, dv, seed=7)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=True, return_lse=True)
    assert out.shape == (1, 256, 4, dv)
    out.backward(dout)
    errs = fwd_errors(q, k, v, out.detach(), lse.detach(), causal=True)
    assert errs["ok"], errs
    assert_grads([t.grad for t in leaves], ref_grads(q, k, v, dout, True, True), ref_grads(q, k, v, dout, True, False))


def test_out_buffer_must_have_dv():
    q, k, v, _ = inputs(1, 64, 64, 2, 2, 192, 128)
    with pytest.raises(ValueError, match="out must be"):
        forward.run(Request.dense(q, k, v, None, False), out=torch.empty_like(q))


# ================================================================ varlen
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_backward(causal):
    lengths = [0, 1, 50, 300, 129, 17]
    d, dv, h, hk = 192, 128, 4, 2
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(total, n, x, generator=gen, device="cuda", dtype=BF16)
                     for n, x in ((h, d), (hk, d), (hk, dv), (h, dv)))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=causal, return_lse=True)
    assert out.shape == (total, h, dv)
    errs = varlen_fwd_errors(q, k, v, cu, cu, out.detach(), lse.detach(), causal=causal)
    assert errs["ok"], errs
    out.backward(dout)

    def grads(upcast):
        ref = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
               for t in (q, k, v)]
        o, _ = attention_varlen_ref(*ref, cu, cu, causal=causal, upcast=upcast)
        o.backward(dout.float() if upcast else dout)
        return [t.grad for t in ref]

    assert_grads([t.grad for t in leaves], grads(True), grads(False))


# ================================================================ decode (flash_attn_with_kvcache)
def _check_kvcache(out, lse, q, kc, vc, lens, **kw):
    out_ref, lse_ref = kvcache_ref(q, kc, vc, lens, **kw)
    out_pt, lse_pt = kvcache_ref(q, kc, vc, lens, upcast=False, **kw)
    assert out.shape == out_ref.shape
    assert not out.isnan().any() and not lse.isnan().any()
    for name, got, ref, pt, atol in (("out", out, out_ref, out_pt, OUT_ATOL), ("lse", lse, lse_ref, lse_pt, LSE_ATOL)):
        # rows that see no key (causal, more new queries than cached keys) have lse = -inf exactly
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), fin) and (got[~fin] == ref[~fin]).all(), name
        err = (got.float() - ref)[fin].abs().max().item()
        pt_err = (pt.float() - ref)[fin].abs().max().item()
        assert err <= 2 * pt_err + atol, (name, err, pt_err)


@pytest.mark.parametrize("mode", ["dense", "paged_split"])
@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_decode(d, dv, mode):
    b, s_cache, h, hk, sq = 3, 3000, 8, 2, 1
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(b, sq, h, d, generator=gen, device="cuda", dtype=BF16)
    kc = torch.randn(b, s_cache, hk, d, generator=gen, device="cuda", dtype=BF16)
    vc = torch.randn(b, s_cache, hk, dv, generator=gen, device="cuda", dtype=BF16)
    k_new = torch.randn(b, 1, hk, d, generator=gen, device="cuda", dtype=BF16)
    v_new = torch.randn(b, 1, hk, dv, generator=gen, device="cuda", dtype=BF16)
    lens = torch.tensor([2999, 1234, 0], dtype=torch.int32, device="cuda")
    kw, ref_kw = {"num_splits": 1}, {}
    if mode == "paged_split":
        page_size = 64
        pages = s_cache // page_size + 1
        perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(0)).to("cuda")
        table = perm.view(b, pages).to(torch.int32)
        caches = []
        for c in (kc, vc):
            x = c.shape[-1]
            paged = torch.zeros(b * pages, page_size, hk, x, device="cuda", dtype=BF16)
            pad = torch.zeros(pages * page_size - s_cache, hk, x, device="cuda", dtype=BF16)
            for i in range(b):
                paged[table[i].long()] = torch.cat([c[i], pad]).view(pages, page_size, hk, x)
            caches.append(paged)
        kc, vc = caches
        kw = {"page_table": table, "num_splits": 4}  # split-KV + GQA packing: the combine runs with Dv
        ref_kw["page_table"] = table
    out = torch.full((b, sq, h, dv), math.nan, device="cuda", dtype=BF16)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, lens.clone(), out=out, return_lse=True, **kw)
    assert out.shape == (b, sq, h, dv)
    _check_kvcache(out, lse, q, kc, vc, lens + 1, **ref_kw)


def test_decode_cache_batch_idx():
    b, s_cache, h, hk, d, dv = 3, 500, 4, 2, 192, 128
    gen = torch.Generator(device="cuda").manual_seed(14)
    q = torch.randn(b, 2, h, d, generator=gen, device="cuda", dtype=BF16)
    kc = torch.randn(b, s_cache, hk, d, generator=gen, device="cuda", dtype=BF16)
    vc = torch.randn(b, s_cache, hk, dv, generator=gen, device="cuda", dtype=BF16)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")
    lens = torch.tensor([400, 77, 1], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, causal=True,
                                       return_lse=True)
    _check_kvcache(out, lse, q, kc, vc, lens, cache_batch_idx=idx, causal=True)
