"""Window bands that exclude the diagonal on the GPU (issue 29; marker gpu, skipped without CUDA).

Literal sides (flash4.geometry.Band, flash-attn-4's convention; None = unbounded): query i sees key j
iff i + sk - sq - left <= j <= i + sk - sq + right, so Band(None, -5) ends 5 keys before the
diagonal and Band(-5, None) starts 5 keys after it. The same kernels as every window (the sides are
runtime values). Forward (out, lse) into NaN-poisoned buffers and backward (dq, dk, dv) into
NaN-poisoned gradients against the float32 reference with the same band (the 2x-PyTorch-error rule);
rows whose band holds no key give out 0, lse -inf (the sink's logit with a sink) and zero dq; every
door: dense, varlen (packed, seqused), paged, the KV cache (decode, split-KV).
"""

import math

import pytest
import torch

import flash4
from flash4 import backward, forward
from flash4.backward import flash_attn_backward
from flash4.geometry import Band
from flash4.reference import (attention_ref, attention_varlen_ref, fwd_errors, kvcache_ref, max_abs_err,
                              paged_kv_cache, varlen_fwd_errors, varlen_row_mask)
from flash4.request import Request

from gpu_helpers import GRAD_ATOL, assert_grads, cu_seqlens, inputs, make_varlen, poisoned_fwd_buffers, ref_grads

BANDS = [Band(None, -5), Band(-5, None), Band(-3, 40), Band(30, -7), Band(None, -200), Band(-60, 100)]
SEQLENS = [(300, 300), (128, 517), (517, 128), (1, 300)]


def empty_rows(sq, sk, band):
    """Query rows whose band holds no key."""
    rows = torch.arange(sq)
    lo = torch.zeros_like(rows) if band.left is None else (rows + sk - sq - band.left).clamp(min=0)
    hi = torch.full_like(rows, sk - 1) if band.right is None else (rows + sk - sq + band.right).clamp(max=sk - 1)
    return rows[lo > hi].tolist()


@pytest.mark.parametrize("band", BANDS)
@pytest.mark.parametrize("sq, sk", SEQLENS)
@pytest.mark.parametrize("d, hk", [(128, 2), (64, 4)])
def test_dense_band_forward(sq, sk, band, d, hk):
    q, k, v, _ = inputs(2, sq, sk, 4, hk, d)
    out, lse = poisoned_fwd_buffers(q)
    forward.run(Request.dense(q, k, v, d ** -0.5, False, band), out=out, lse=lse)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, False, window_size=band)
    assert errs["ok"], errs
    empty = empty_rows(sq, sk, band)
    if empty:
        assert (out[:, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()


@pytest.mark.parametrize("band", BANDS)
@pytest.mark.parametrize("sq, sk", SEQLENS[:3])
@pytest.mark.parametrize("d, hk", [(128, 2), (96, 1)])
def test_dense_band_backward(sq, sk, band, d, hk):
    q, k, v, dout = inputs(2, sq, sk, 4, hk, d, seed=1)
    scale = d ** -0.5
    out, lse = forward.run(Request.dense(q, k, v, scale, False, band))
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, False, *grads, window_size=band)
    torch.cuda.synchronize()
    assert_grads(grads, ref_grads(q, k, v, dout, False, True, window_size=band),
                 ref_grads(q, k, v, dout, False, False, window_size=band))
    empty = empty_rows(sq, sk, band)
    if empty:
        assert (grads[0][:, empty] == 0).all()


@pytest.mark.parametrize("band", [Band(None, -5), Band(-5, None)])
def test_dense_band_deterministic(band):
    q, k, v, dout = inputs(2, 400, 400, 4, 1, 128, seed=2)
    scale = 128 ** -0.5
    out, lse = forward.run(Request.dense(q, k, v, scale, False, band))
    first = flash_attn_backward(dout, q, k, v, out, lse, scale, False, deterministic=True, window_size=band)
    again = flash_attn_backward(dout, q, k, v, out, lse, scale, False, deterministic=True, window_size=band)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert_grads(first, ref_grads(q, k, v, dout, False, True, window_size=band),
                 ref_grads(q, k, v, dout, False, False, window_size=band))


def test_band_with_sink_and_softcap():
    """A sink and softcap with a band: rows without keys give out 0 and lse = the head's sink."""
    q, k, v, dout = inputs(2, 200, 200, 4, 2, 128, seed=3)
    sink = torch.randn(4, device="cuda")
    band = Band(None, -20)
    out, lse = flash4.flash_attn_func(q, k, v, window_size=band, softcap=30.0, learnable_sink=sink, return_lse=True)
    errs = fwd_errors(q, k, v, out, lse, None, False, window_size=band, softcap=30.0, learnable_sink=sink)
    assert errs["ok"], errs
    empty = empty_rows(200, 200, band)
    assert empty and (out[:, empty] == 0).all()
    assert torch.allclose(lse[:, :, empty], sink.view(1, 4, 1).expand(2, 4, len(empty)))


def _varlen_ref_grads(q, k, v, cu_q, cu_k, dout, band, upcast, seqused_k=None):
    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_varlen_ref(*leaves, cu_q, cu_k, None, seqused_k, upcast=upcast, window_size=band)
    (out.float() * dout.float()).sum().backward()
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


@pytest.mark.parametrize("band", BANDS[:4])
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_band_forward_backward(band, seqused):
    len_q, len_k = [37, 0, 300, 1, 129], [200, 5, 300, 64, 7]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 4, 2, 128, seed=4)
    seqused_k = torch.tensor([150, 5, 299, 1, 7], dtype=torch.int32, device="cuda") if seqused else None
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device="cuda")
    lse = torch.full((4, q.shape[0]), math.nan, dtype=torch.float32, device="cuda")
    request = Request.varlen(q, k, v, cu_q, cu_k, max(len_q), max(len_k), None, seqused_k, None, 128 ** -0.5, False,
                             band)
    split = forward.new_lse_split(request)
    forward.run(request, out=out, lse=lse, lse_split=split)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    errs = varlen_fwd_errors(q, k, v, cu_q, cu_k, out, lse, None, seqused_k, None, None, False, window_size=band)
    assert errs["ok"], errs
    dout = torch.randn_like(out)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    backward.run(request, dout, out, lse, split, None, *grads)
    torch.cuda.synchronize()
    g_ref = _varlen_ref_grads(q, k, v, cu_q, cu_k, dout, band, True, seqused_k)
    g_pt = _varlen_ref_grads(q, k, v, cu_q, cu_k, dout, band, False, seqused_k)
    for name, g, gr, gp in zip(("dq", "dk", "dv"), grads, g_ref, g_pt):
        assert not g.isnan().any(), name
        err, pt_err = max_abs_err(g.float(), gr), max_abs_err(gp.float(), gr)
        assert err <= 2 * pt_err + GRAD_ATOL, f"{name}: err {err:.3e} > 2 * pt_err {pt_err:.3e} + {GRAD_ATOL}"


@pytest.mark.parametrize("band", [Band(None, -5), Band(-5, None), Band(-3, 40)])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_band(band, page_size):
    len_q, len_k = [3, 100, 1, 64], [300, 120, 77, 64]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 4, 2, 128, seed=5)
    k_cache, v_cache, table, seqused_k = paged_kv_cache(k, v, cu_k, page_size)
    out, lse = flash4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max(len_q), None, seqused_k=seqused_k,
                                             page_table=table, window_size=band, return_lse=True)
    errs = varlen_fwd_errors(q, k_cache, v_cache, cu_q, None, out, lse, None, seqused_k, table, None, False,
                             window_size=band)
    assert errs["ok"], errs


@pytest.mark.parametrize("band", [Band(None, -5), Band(-5, None), Band(-40, 60)])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("paged, sq", [(False, 1), (True, 1), (False, 5), (True, 5)])
def test_kvcache_band(band, num_splits, paged, sq):
    """flash_attn_with_kvcache (decode, split-KV) with a band, appending one key first."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    b, hk, d, cap = 3, 2, 128, 1024
    q = torch.randn(b, sq, 8, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([700, 3, 1000], dtype=torch.int32, device="cuda")
    if paged:
        page, per_seq = 64, cap // 64
        k_cache = torch.randn(b * per_seq, page, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(b * per_seq, device="cuda").view(b, per_seq).to(torch.int32)
    else:
        k_cache = torch.randn(b, cap, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = None
    out, lse = flash4.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens, table, window_size=band,
                                              num_splits=num_splits, return_lse=True)
    ref, ref_lse = kvcache_ref(q, k_cache, v_cache, seqlens + 1, table, window_size=band)
    pt, pt_lse = kvcache_ref(q, k_cache, v_cache, seqlens + 1, table, window_size=band, upcast=False)
    assert max_abs_err(out, ref) <= 2 * max_abs_err(pt, ref) + 1e-4
    assert max_abs_err(lse, ref_lse) <= 2 * max_abs_err(pt_lse, ref_lse) + 1e-3
