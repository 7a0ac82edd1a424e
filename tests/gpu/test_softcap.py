"""Logit soft-capping on the GPU (Gemma 2; issue 10 item 2; marker gpu, skipped without CUDA).

scores -> softcap * tanh(scores * softmax_scale / softcap) before the mask and the softmax (the
kernels use the hardware tanh.approx.f32), exact derivative (1 - tanh^2) in the backward. Forward
(out, lse) and backward (dq, dk, dv) against the float32 reference with the same softcap
(flash4.reference), the usual 2x-PyTorch-error rule + atol, NaN-poisoned outputs; q and k scaled
up (x4) so that the cap matters (checked: the capped result is far from the uncapped one); every
head dim, causal and not, GQA, combined with a sliding window, varlen (forward and backward),
decode through flash_attn_with_kvcache (plain, paged and cache_batch_idx). softcap is a runtime
value: 15 and 50 share one compiled kernel per configuration.
"""

import math

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash4 import forward
from flash4.request import Request
from flash4.backward import flash_attn_backward
from flash4.config import BWD_SUPPORTED_HEADDIMS, SUPPORTED_HEADDIMS
from flash4.reference import (LSE_ATOL, OUT_ATOL, attention_ref, attention_varlen_ref, fwd_errors, kvcache_ref,
                              varlen_fwd_errors)

import gpu_helpers
from gpu_helpers import BF16, assert_grads, cu_seqlens, poisoned_fwd_buffers

SOFTCAPS = [15.0, 50.0]


def inputs(b, sq, sk, h, hk, d, dtype=BF16, seed=0, gain=4.0):
    """q, k scaled by `gain` (scores of std ~ gain**2: well past a cap of 15), v and dout plain."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(s, generator=gen, device="cuda", dtype=dtype)
                     for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    return q * gain, k * gain, v, dout


def check_fwd(q, k, v, softcap, causal=False, window=None):
    d = q.shape[-1]
    out, lse = poisoned_fwd_buffers(q)
    forward.run(Request.dense(q, k, v, d ** -0.5, causal, window, softcap), out=out, lse=lse)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, causal, window_size=window, softcap=softcap)
    assert errs["ok"], errs
    return out, lse


def ref_grads(q, k, v, dout, causal, window, softcap, upcast):
    """gpu_helpers.ref_grads with a window and a softcap."""
    return gpu_helpers.ref_grads(q, k, v, dout, causal, upcast, window_size=window, softcap=softcap)


def check_bwd(q, k, v, dout, softcap, causal=False, window=None):
    d = q.shape[-1]
    out, lse = forward.run(Request.dense(q, k, v, d ** -0.5, causal, window, softcap))
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, d ** -0.5, causal, *grads, window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    assert_grads(grads, ref_grads(q, k, v, dout, causal, window, softcap, True),
                 ref_grads(q, k, v, dout, causal, window, softcap, False))
    return grads


# ================================================================ dense
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_every_headdim(d, causal):
    """Forward and backward for both caps (one compiled kernel each way: the cap is a runtime value),
    GQA (4 query heads on 2 KV heads), seqlen_q != seqlen_k."""
    q, k, v, dout = inputs(1, 300, 420, 4, 2, d, seed=d)
    for softcap in SOFTCAPS:
        check_fwd(q, k, v, softcap, causal)
        if d in BWD_SUPPORTED_HEADDIMS:
            check_bwd(q, k, v, dout, softcap, causal)


def test_the_cap_matters():
    """The capped result is far from the uncapped one (the inputs exercise the cap), and no lse
    exceeds softcap + log(seqlen_k) (every capped score is below softcap)."""
    q, k, v, _ = inputs(2, 256, 256, 4, 4, 128, seed=1)
    out, lse = check_fwd(q, k, v, 15.0)
    plain, _ = attention_ref(q, k, v)
    assert (out.float() - plain).abs().max().item() > 0.1
    assert (lse <= 15.0 + math.log(256) + 1e-3).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [1, 2, 8])
def test_gqa_mqa(hk, causal):
    q, k, v, dout = inputs(2, 200, 333, 8, hk, 128, seed=hk)
    check_fwd(q, k, v, 30.0, causal)
    check_bwd(q, k, v, dout, 30.0, causal)


@pytest.mark.parametrize("window, causal", [((64, 0), False), ((100, 37), False), ((-1, 50), False), ((80, -1), True)])
@pytest.mark.parametrize("d", [64, 128])
def test_with_a_window(d, window, causal):
    q, k, v, dout = inputs(1, 400, 500, 4, 2, d, seed=17)
    for softcap in SOFTCAPS:
        check_fwd(q, k, v, softcap, causal, window)
    check_bwd(q, k, v, dout, 15.0, causal, window)


def test_public_api_autograd():
    q, k, v, dout = inputs(1, 256, 300, 4, 2, 128, seed=7)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=True, softcap=20.0, return_lse=True)
    out.backward(dout)
    errs = fwd_errors(q, k, v, out.detach(), lse.detach(), causal=True, softcap=20.0)
    assert errs["ok"], errs
    assert_grads([t.grad for t in leaves], ref_grads(q, k, v, dout, True, None, 20.0, True),
                 ref_grads(q, k, v, dout, True, None, 20.0, False))


# ================================================================ varlen
def _varlen(lengths, h, hk, d, seed=0, gain=4.0):
    cu = cu_seqlens(lengths)
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(total, n, d, generator=gen, device="cuda", dtype=BF16) for n in (h, hk, hk, h))
    return q * gain, k * gain, v, dout, cu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_varlen_forward_backward(softcap, causal):
    lengths = [0, 1, 50, 300, 129, 17]
    q, k, v, dout, cu = _varlen(lengths, 4, 2, 128, seed=11)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=causal, softcap=softcap,
                                      return_lse=True)
    errs = varlen_fwd_errors(q, k, v, cu, cu, out.detach(), lse.detach(), causal=causal, softcap=softcap)
    assert errs["ok"], errs
    out.backward(dout)

    def grads(upcast):
        ref = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
               for t in (q, k, v)]
        o, _ = attention_varlen_ref(*ref, cu, cu, causal=causal, upcast=upcast, softcap=softcap)
        o.backward(dout.float() if upcast else dout)
        return [t.grad for t in ref]

    assert_grads([t.grad for t in leaves], grads(True), grads(False))


def test_varlen_with_a_window():
    lengths = [200, 3, 411]
    q, k, v, _, cu = _varlen(lengths, 4, 4, 64, seed=12)
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), causal=True, window_size=(90, 0), softcap=15.0,
                                      return_lse=True)
    errs = varlen_fwd_errors(q, k, v, cu, cu, out, lse, causal=True, window_size=(90, 0), softcap=15.0)
    assert errs["ok"], errs


# ================================================================ decode (flash_attn_with_kvcache)
def _check_kvcache(out, lse, q, kc, vc, lens, softcap, **kw):
    """The 2x-PyTorch-error rule + atol on out and lse (as flash4.reference.fwd_errors)."""
    out_ref, lse_ref = kvcache_ref(q, kc, vc, lens, softcap=softcap, **kw)
    out_pt, lse_pt = kvcache_ref(q, kc, vc, lens, softcap=softcap, upcast=False, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    for name, got, ref, pt, atol in (("out", out, out_ref, out_pt, OUT_ATOL), ("lse", lse, lse_ref, lse_pt, LSE_ATOL)):
        err = (got.float() - ref).abs().max().item()
        pt_err = (pt.float() - ref).abs().max().item()
        assert err <= 2 * pt_err + atol, (name, err, pt_err)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("mode", ["dense", "paged", "batch_idx", "window"])
def test_decode(mode, softcap):
    b, s_cache, h, hk, d, sq = 3, 3000, 8, 2, 128, 1
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(b, sq, h, d, generator=gen, device="cuda", dtype=BF16) * 4
    kc = torch.randn(b, s_cache, hk, d, generator=gen, device="cuda", dtype=BF16) * 4
    vc = torch.randn_like(kc)
    k_new = torch.randn(b, 1, hk, d, generator=gen, device="cuda", dtype=BF16) * 4
    v_new = torch.randn_like(k_new)
    lens = torch.tensor([2999, 1234, 0], dtype=torch.int32, device="cuda")
    kw, ref_kw = {}, {}
    if mode == "paged":
        page_size = 64
        pages = s_cache // page_size + 1
        perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(0)).to("cuda")
        kp = torch.zeros(b * pages, page_size, hk, d, device="cuda", dtype=BF16)
        vp = torch.zeros_like(kp)
        table = perm.view(b, pages).to(torch.int32)
        pad = torch.zeros(pages * page_size - s_cache, hk, d, device="cuda", dtype=BF16)
        for i in range(b):  # sequence i's rows, page by page (index_put_ through the table: no copy)
            kp[table[i].long()] = torch.cat([kc[i], pad]).view(pages, page_size, hk, d)
            vp[table[i].long()] = torch.cat([vc[i], pad]).view(pages, page_size, hk, d)
        kc, vc = kp, vp
        kw["page_table"] = ref_kw["page_table"] = table
    elif mode == "batch_idx":
        idx = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")  # sequence i reads cache row idx[i]
        kw["cache_batch_idx"] = ref_kw["cache_batch_idx"] = idx
    elif mode == "window":
        kw["window_size"] = ref_kw["window_size"] = (511, 0)
        kw["causal"] = ref_kw["causal"] = True
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, lens.clone(), softcap=softcap, return_lse=True, **kw)
    _check_kvcache(out, lse, q, kc, vc, lens + 1, softcap, **ref_kw)
