"""Head dims without a kernel of their own (flash4.headdim; issue 13 item 2; marker gpu).

Multiples of 8 from 8 to 256 other than 64/96/128/192/256 run zero-padded to the next kernel head
dim. Checked: the padded problem through the kernels with NaN-poisoned out / lse buffers (the
padded columns of out are exactly 0, the real ones within the 2x-PyTorch-error rule against the
float32 reference of the unpadded problem), and the public functions end to end (flash_attn_func
forward and backward, GQA, causal and not, a value head dim of its own; flash_attn_varlen_func).
"""

import math

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func
from flash4 import forward
from flash4.request import Request
from flash4.headdim import pad_last, padded_headdims
from flash4.reference import attention_ref, attention_varlen_ref, fwd_errors

from gpu_helpers import BF16, GRAD_ATOL


def _inputs(b, sq, sk, h, hk, d, dv, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=gen, device="cuda", dtype=BF16),
            torch.randn(b, sk, hk, d, generator=gen, device="cuda", dtype=BF16),
            torch.randn(b, sk, hk, dv, generator=gen, device="cuda", dtype=BF16))


@pytest.mark.parametrize("d", [8, 16, 32, 40, 72, 80, 112, 160, 200, 248])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_kernel_poisoned(d, causal):
    q, k, v = _inputs(2, 300, 421, 4, 2, d, d)
    dp, dvp = padded_headdims(d, d)
    out = torch.full((2, 300, 4, dvp), math.nan, device="cuda", dtype=BF16)
    lse = torch.full((2, 4, 300), math.nan, device="cuda")
    forward.run(Request.dense(pad_last(q, dp), pad_last(k, dp), pad_last(v, dvp), d ** -0.5, causal), out=out,
                lse=lse)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[..., d:] == 0).all()
    errs = fwd_errors(q, k, v, out[..., :d], lse, None, causal)
    assert errs["ok"], errs


def _grad_check(got, ref, low, name):
    err, bound = (got.float() - ref).abs().max(), 2 * (low.float() - ref).abs().max() + GRAD_ATOL
    assert err <= bound, f"{name}: {err} > {bound}"


@pytest.mark.parametrize("d, dv", [(8, 8), (32, 32), (80, 80), (112, 112), (160, 160), (32, 128), (112, 64), (40, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_public_forward_backward(d, dv, causal):
    q, k, v = _inputs(2, 257, 257, 8, 2, d, dv, seed=1)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=causal, return_lse=True)
    assert out.shape == (2, 257, 8, dv) and out.is_contiguous() and lse.shape == (2, 8, 257)
    dout = torch.randn_like(out)
    (out.float() * dout).sum().backward()
    res = {}
    for upcast in (True, False):
        ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, l = attention_ref(*ref, causal=causal, upcast=upcast)
        (o.float() * dout).sum().backward()
        res[upcast] = (o, l, [t.grad for t in ref])
    (ro, rl, rg), (lo, ll, lg) = res[True], res[False]
    _grad_check(out, ro, lo, "out")
    _grad_check(lse, rl, ll, "lse")
    for name, got, r, l_ in zip(("dq", "dk", "dv"), (t.grad for t in leaves), rg, lg):
        assert got.shape == r.shape
        _grad_check(got, r.float(), l_, name)


def test_varlen_small_headdim():
    lens = [37, 0, 200, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(sum(lens), 4, 32, generator=gen, device="cuda", dtype=BF16)
    k, v = (torch.randn(sum(lens), 2, 32, generator=gen, device="cuda", dtype=BF16) for _ in range(2))
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, causal=True, return_lse=True)
    ro, rl = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    lo, ll = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
    assert out.shape == q.shape
    _grad_check(out, ro.float(), lo, "out")
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    _grad_check(lse[fin], rl[fin].float(), ll[fin], "lse")
