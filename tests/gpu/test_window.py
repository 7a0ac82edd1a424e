"""Sliding-window (local) attention on the GPU (issue 10; marker gpu, skipped without CUDA).

flash-attn's rule: query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right, -1 =
unbounded on that side alone, causal sets right = 0. Forward (out, lse) and backward (dq, dk, dv)
against the float32 reference with the same window (flash4.reference), the usual 2x-PyTorch-error
rule, NaN-poisoned outputs; windows one-sided, zero-width (the diagonal only), wider than the
sequence, seqlen_q != seqlen_k both ways; every head dim; GQA; deterministic bitwise; varlen with
sequences shorter than the window; decode with a window over a long cache; the block skipping that
makes a narrow window cheap is checked by counting nothing but time-free facts (the geometry
tests on the CPU cover the block ranges).
"""

import math

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash4 import forward
from flash4.request import Request
from flash4.backward import flash_attn_backward
from flash4.config import SUPPORTED_HEADDIMS
from flash4.reference import LSE_ATOL, OUT_ATOL, attention_ref, fwd_errors, kvcache_ref, varlen_fwd_errors

from gpu_helpers import assert_grads, inputs, poisoned_fwd_buffers, ref_grads

WINDOWS = [(0, 0), (16, 0), (0, 16), (100, 37), (-1, 64), (64, -1), (5000, 5000), (-1, 0)]


def check_fwd(q, k, v, window, causal=False):
    d = q.shape[-1]
    out, lse = poisoned_fwd_buffers(q)
    forward.run(Request.dense(q, k, v, d ** -0.5, causal, window), out=out, lse=lse)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, causal, window_size=window)
    assert errs["ok"], errs
    return out, lse


def check_bwd(q, k, v, dout, window, causal=False, deterministic=False):
    d = q.shape[-1]
    out, lse = forward.run(Request.dense(q, k, v, d ** -0.5, causal, window))
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, d ** -0.5, causal, *grads, deterministic=deterministic,
                        window_size=window)
    torch.cuda.synchronize()
    g_ref = ref_grads(q, k, v, dout, causal, True, window_size=window)
    g_pt = ref_grads(q, k, v, dout, causal, False, window_size=window)
    assert_grads(grads, g_ref, g_pt)
    return grads


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (300, 1000), (1000, 300), (1, 777), (129, 1)])
def test_forward_windows(sq, sk, window):
    q, k, v, _ = inputs(2, sq, sk, 4, 2, 128)
    check_fwd(q, k, v, window)


@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_headdim(d, causal):
    q, k, v, dout = inputs(1, 700, 900, 2, 2, d, seed=d)
    check_fwd(q, k, v, (130, 70), causal)
    check_bwd(q, k, v, dout, (130, 70), causal)


@pytest.mark.parametrize("window", WINDOWS)
def test_backward_windows(window):
    q, k, v, dout = inputs(1, 600, 800, 4, 1, 64, seed=3)
    check_bwd(q, k, v, dout, window)


def test_rows_without_keys():
    # window (0, 0) with sq > sk: rows i < sq - sk see no key -> out 0, lse -inf, dq 0
    q, k, v, dout = inputs(1, 300, 100, 2, 2, 128)
    out, lse = check_fwd(q, k, v, (0, 0))
    assert (out[:, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()
    dq, _, _ = check_bwd(q, k, v, dout, (0, 0))
    assert (dq[:, :200] == 0).all()


def test_deterministic_is_bitwise():
    q, k, v, dout = inputs(2, 1000, 1000, 8, 2, 128, seed=5)
    first = check_bwd(q, k, v, dout, (200, 10), deterministic=True)
    again = check_bwd(q, k, v, dout, (200, 10), deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_public_api_autograd():
    q, k, v, dout = inputs(1, 512, 512, 4, 4, 64, seed=7)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True, window_size=(100, -1))
    out.backward(dout)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out_ref, _ = attention_ref(*ref, causal=True, window_size=(100, -1))
    out_ref.backward(dout.float())
    assert (out.float() - out_ref).abs().max().item() < 0.05
    for g, gr in zip((t.grad for t in leaves), (t.grad for t in ref)):
        assert (g.float() - gr).abs().max().item() < 0.1


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_shorter_than_window(causal):
    lengths = [0, 1, 50, 300, 1000, 17]
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lengths)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(total, 4, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, 2, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
                                      window_size=(256, 256), return_lse=True)
    errs = varlen_fwd_errors(q, k, v, cu, cu, out, lse, causal=causal, window_size=(256, 256))
    assert errs["ok"], errs


def test_decode_window_over_long_cache():
    b, s_cache, h, hk, d = 2, 20000, 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(b, 1, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b, s_cache, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([s_cache, 12345], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, window_size=(1023, 0),
                                       return_lse=True)
    out_ref, lse_ref = kvcache_ref(q, kc, vc, lens, causal=True, window_size=(1023, 0))
    out_pt, _ = kvcache_ref(q, kc, vc, lens, causal=True, window_size=(1023, 0), upcast=False)
    err = (out.float() - out_ref).abs().max().item()
    pt_err = (out_pt.float() - out_ref).abs().max().item()
    assert err <= 2 * pt_err + OUT_ATOL and (lse - lse_ref).abs().max().item() <= LSE_ATOL
