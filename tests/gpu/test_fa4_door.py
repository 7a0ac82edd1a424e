"""flash4.fa4, flash-attn-4's Python API, on the GPU (issue 29; marker gpu, skipped without CUDA).

Through the door as a flash-attn-4 user calls it: bands with literal sides (None unbounded) and
flash-attn-4's causal / window resolution, forward into NaN-poisoned out / lse (_flash_attn_fwd's
preallocated buffers) and backward (autograd and the raw _flash_attn_bwd) against the float32
reference (the 2x-PyTorch-error rule), the varlen door's routes (packed, 4-D with seqused_k, paged,
KV cache), the LSE's gradient, torch.compile(fullgraph=True), and dSink with flash-attn-4's own
tolerance rule (its check_dsink_vs_ref) for every head dim, MHA / GQA / MQA, dense and varlen.
"""

import math

import pytest
import torch

from flash4 import fa4
from flash4.geometry import Band
from flash4.reference import (attention_ref, attention_varlen_ref, fwd_errors, kvcache_ref, max_abs_err,
                              paged_kv_cache, varlen_fwd_errors)

from gpu_helpers import GRAD_ATOL, assert_grads, inputs, make_varlen, poisoned_fwd_buffers

# (causal, window_size) as flash-attn-4 takes them
MASKS = [(False, (None, -5)), (False, (-5, None)), (False, (None, None)), (True, (None, None)), (True, (40, None)),
         (False, (17, -3)), (False, (-2, 30)), (False, (None, 0))]


def _ref_grads(q, k, v, dout, causal, band, upcast, **kw):
    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal, upcast=upcast, window_size=band, **kw)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("causal, window", MASKS)
@pytest.mark.parametrize("d, hk", [(128, 2), (64, 1), (96, 4)])
def test_func_forward_backward(causal, window, d, hk):
    q, k, v, dout = inputs(2, 211, 300, 4, hk, d)
    c, band = fa4.resolve_causal_window(causal, *window)
    out, lse = poisoned_fwd_buffers(q)
    o, l, _, _ = fa4._flash_attn_fwd(q, k, v, causal=causal, window_size_left=window[0],
                                     window_size_right=window[1], out=out, lse=lse)
    torch.cuda.synchronize()
    assert o is out and l is lse and not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, c, window_size=band)
    assert errs["ok"], errs
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out2, lse2 = fa4.flash_attn_func(*leaves, causal=causal, window_size=window)
    assert not lse2.requires_grad and lse2.shape == lse.shape  # computed (inputs need grad), no gradient
    assert fwd_errors(q, k, v, out2.detach(), lse2, None, c, window_size=band)["ok"]
    out2.backward(dout)
    assert_grads([t.grad for t in leaves], _ref_grads(q, k, v, dout, c, band, True),
                 _ref_grads(q, k, v, dout, c, band, False))


def test_lse_gradient():
    q, k, v, dout = inputs(2, 128, 200, 4, 2, 128, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.flash_attn_func(*leaves, window_size=(None, -3), return_lse=True)
    dlse = torch.randn_like(lse)
    finite = torch.isfinite(lse.detach())  # rows whose band holds no key: lse -inf, no gradient
    zero = torch.zeros((), device="cuda")
    ((out.float() * dout.float()).sum() + torch.where(finite, lse * dlse, zero).sum()).backward()
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ref_leaves, window_size=Band(None, -3))
    ((ref * dout.float()).sum() + torch.where(finite, ref_lse * dlse, zero).sum()).backward()
    for g, gr in zip((t.grad for t in leaves), (t.grad for t in ref_leaves)):
        assert (g.float() - gr).abs().max() <= 2e-2


@pytest.mark.parametrize("window", [(None, -5), (-5, None), (None, None)])
def test_varlen_routes(window):
    """Packed rows; a 4-D q / k / v with seqused_k needing grad (packed route); a paged pool and a
    dense cache with seqused_k (the KV-cache route)."""
    band = fa4.resolve_causal_window(False, *window)[1]
    len_q, len_k = [37, 0, 300, 1], [200, 5, 300, 64]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 4, 2, 128, seed=2)
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300,
                                          max_seqlen_k=300, window_size=window, return_lse=True)
    errs = varlen_fwd_errors(q, k, v, cu_q, cu_k, out, lse, window_size=band)
    assert errs["ok"], errs

    k_cache, v_cache, table, seqused_k = paged_kv_cache(k, v, cu_k, 16)
    out, lse = fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=300,
                                          seqused_k=seqused_k, page_table=table, window_size=window, return_lse=True)
    errs = varlen_fwd_errors(q, k_cache, v_cache, cu_q, None, out, lse, None, seqused_k, table, window_size=band)
    assert errs["ok"], errs

    q4, k4, v4, dout = inputs(3, 50, 400, 8, 2, 128, seed=3)
    used = torch.tensor([400, 7, 333], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(q4, k4, v4, seqused_k=used, window_size=window, num_splits=2,
                                          return_lse=True)  # the KV-cache route (no gradient)
    ref, ref_lse = kvcache_ref(q4, k4, v4, used, window_size=band)
    pt, pt_lse = kvcache_ref(q4, k4, v4, used, window_size=band, upcast=False)
    assert out.shape == q4.shape and lse.shape == (3, 8, 50)
    assert max_abs_err(out, ref) <= 2 * max_abs_err(pt, ref) + 1e-4
    assert max_abs_err(lse, ref_lse) <= 2 * max_abs_err(pt_lse, ref_lse) + 1e-3
    leaves = [t.clone().requires_grad_() for t in (q4, k4, v4)]
    out2, _ = fa4.flash_attn_varlen_func(*leaves, seqused_k=used, window_size=window)  # packed route
    assert max_abs_err(out2.detach(), ref) <= 2 * max_abs_err(pt, ref) + 1e-4
    out2.backward(dout)
    assert all(not t.grad.isnan().any() for t in leaves)


def test_raw_backward_band_and_sink():
    q, k, v, dout = inputs(2, 150, 150, 4, 2, 128, seed=4)
    sink = torch.randn(4, device="cuda", dtype=torch.bfloat16)
    out, lse, _, _ = fa4._flash_attn_fwd(q, k, v, window_size_left=-4, learnable_sink=sink, return_lse=True)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    res = fa4._flash_attn_bwd(q, k, v, out, dout, lse, window_size_left=-4, dq=grads[0], dk=grads[1], dv=grads[2],
                              learnable_sink=sink)
    assert all(r is g for r, g in zip(res[:3], grads)) and res[3].dtype == sink.dtype
    band = Band(-4, None)
    assert_grads(grads, _ref_grads(q, k, v, dout, False, band, True, learnable_sink=sink),
                 _ref_grads(q, k, v, dout, False, band, False, learnable_sink=sink))
    # dSink from the kernel's own D (BwdConfig.sink_delta), not from the bf16 out: the 2x rule against
    # the float32 reference's sink gradient, as the other gradients.
    sink_ref = sink.detach().float().requires_grad_()
    sink_pt = sink.detach().clone().requires_grad_()
    out_ref, _ = attention_ref(q.float(), k.float(), v.float(), window_size=band, learnable_sink=sink_ref)
    out_pt, _ = attention_ref(q, k, v, window_size=band, upcast=False, learnable_sink=sink_pt)
    dsink_ref = torch.autograd.grad(out_ref, sink_ref, dout.float())[0]
    dsink_pt = torch.autograd.grad(out_pt, sink_pt, dout)[0]
    assert max_abs_err(res[3], dsink_ref) <= 2 * max_abs_err(dsink_pt, dsink_ref) + 1e-3


def test_compile_fullgraph_band():
    import torch._dynamo

    q, k, v, dout = inputs(2, 256, 256, 4, 2, 128, seed=5)

    def step(q, k, v):
        out, lse = fa4.flash_attn_func(q, k, v, window_size=(None, -7), return_lse=True)
        return out, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = compiled(*leaves)
    out.backward(dout)
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_e, lse_e = step(*eager_leaves)
    out_e.backward(dout)
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
    for a, b in zip(leaves, eager_leaves):
        assert torch.allclose(a.grad, b.grad, atol=GRAD_ATOL, rtol=1e-2)


# ================================================================ dSink: flash-attn-4's tolerance rule
def check_dsink_vs_ref(actual, ref, pt, rtol=2, atol=0.0):
    """flash-attn-4's rule (tests/cute/test_flash_attn.py): |dsink - ref| <= rtol * max|pt - ref| + 2 ulp(ref) + atol."""
    ulp = torch.nextafter(ref.abs(), torch.full_like(ref, float("inf"))) - ref.abs()
    diff = (actual - ref).abs()
    tolerance = rtol * (pt - ref).abs().max().item() + 2 * ulp + atol
    assert torch.all(diff <= tolerance), f"dSink: {diff=} exceeds {tolerance=}"


HEADDIMS = [(64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256)]


# Since BwdConfig.sink_delta (D from the kernel's fp32 P and dP, not the bf16 out) all 72 cases pass on the
# H200 (2026-12-02: 72 XPASS under the former xfail mark; docs/conformance/fa4-suite.md, dSink).
@pytest.mark.parametrize("d, dv", HEADDIMS)
@pytest.mark.parametrize("mha", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("sq, sk, causal", [(113, 203, True), (64, 128, False)])
def test_dsink_suite_tolerance(d, dv, mha, varlen, sq, sk, causal):
    """flash-attn-4's test_flash_attn_output dSink check (seed 0, batch 9, 6 heads, bf16 sink), through
    flash4.fa4 (dense) or its varlen door (packed rows)."""
    torch.manual_seed(0)
    b, h = 9, 6
    hk = {"mha": 6, "gqa": 3, "mqa": 1}[mha]
    q_ref = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k_ref = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    v_ref = torch.randn(b, sk, hk, dv, device="cuda", dtype=torch.bfloat16).requires_grad_()
    sink_ref = torch.randn(h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    q, k, v, sink = (t.detach().clone().requires_grad_() for t in (q_ref, k_ref, v_ref, sink_ref))
    if varlen:
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device="cuda")
        out, _ = fa4.flash_attn_varlen_func(q.reshape(b * sq, h, d), k.reshape(b * sk, hk, d),
                                            v.reshape(b * sk, hk, dv), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                            max_seqlen_q=sq, max_seqlen_k=sk, causal=causal, learnable_sink=sink)
        out = out.view(b, sq, h, dv)
    else:
        out, _ = fa4.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
    g = torch.randn_like(out)
    dsink = torch.autograd.grad(out, sink, g)[0]
    out_ref, _ = attention_ref(q_ref, k_ref, v_ref, None, causal, learnable_sink=sink_ref)
    out_pt, _ = attention_ref(q_ref, k_ref, v_ref, None, causal, upcast=False, learnable_sink=sink_ref)
    dsink_ref = torch.autograd.grad(out_ref, sink_ref, g)[0]
    dsink_pt = torch.autograd.grad(out_pt, sink_ref, g)[0]
    assert dsink.dtype == sink.dtype
    check_dsink_vs_ref(dsink, dsink_ref, dsink_pt)
