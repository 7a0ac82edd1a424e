"""FwdConfig.tensor_hdims: a padded head dim's forward straight from the narrow tensors (TMA zero-fill
past D / Dv, O store clipped), no padded copies; flash_attn_func's no-grad path since 2026-12-04
(FLASH4_NARROW_HEADDIMS) (marker gpu).

Checked against the shipped path (flash4.forward.run on the zero-padded tensors, what
flash_attn_func does for these head dims): out and lse bitwise equal, out / lse NaN-poisoned
before the call so that an unwritten element fails; and out's neighbours in a wider buffer (a
strided out whose rows are followed by other data) untouched, so the clipped store writes
nothing past Dv.

These tests run with FLASH4_HEADDIM16=0 (the padded kernels are flash4.config.SUPPORTED_HEADDIMS'),
except test_api_narrow_headdim16: with it on (the default) d32 / 80 / 112 have kernels of their own
(tests/gpu/test_headdim16.py) and the narrow path serves the other multiples of 8 on the next
multiple of 16 (d40 on the d48 kernel, d72 on d80, d120 on d128).
"""

import math

import pytest
import torch

from flash4 import flash_attn_func, forward
from flash4.headdim import pad_last, padded_headdims
from flash4.request import Request

from gpu_helpers import BF16


@pytest.fixture(autouse=True)
def _supported_kernels(monkeypatch, request):
    if "headdim16" not in request.node.name:
        monkeypatch.setenv("FLASH4_HEADDIM16", "0")


def _inputs(b, sq, sk, h, hk, d, dv, dtype=BF16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=gen, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, generator=gen, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, dv, generator=gen, device="cuda", dtype=dtype))


def _padded(q, k, v, causal, window_size=(-1, -1), softcap=0.0):
    d, dv = q.shape[-1], v.shape[-1]
    dp, dvp = padded_headdims(d, dv)
    out, lse = forward.run(Request.dense(pad_last(q, dp), pad_last(k, dp), pad_last(v, dvp), d ** -0.5, causal,
                                         window_size, softcap))
    return out[..., :dv], lse


def _narrow(q, k, v, causal, window_size=(-1, -1), softcap=0.0, out=None):
    b, sq, h, _ = q.shape
    if out is None:
        out = torch.full((b, sq, h, v.shape[-1]), math.nan, device="cuda", dtype=q.dtype)
    lse = torch.full((b, h, sq), math.nan, device="cuda")
    stand_in = forward.narrow_stand_in(q, k, v, q.shape[-1] ** -0.5, causal, window_size, softcap)
    ran = forward.launch_narrow(q, k, v, out, lse, stand_in)
    return ran, out, lse


@pytest.mark.parametrize("d", [8, 32, 40, 80, 112, 160, 200, 248])
@pytest.mark.parametrize("causal", [False, True])
def test_narrow_bitwise(d, causal):
    q, k, v = _inputs(2, 300, 421, 4, 4, d, d)
    ran, out, lse = _narrow(q, k, v, causal)
    assert ran
    torch.cuda.synchronize()
    ref_out, ref_lse = _padded(q, k, v, causal)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("case", ["fp16", "gqa_full", "window", "softcap", "long", "short_keys", "hdimv"])
def test_narrow_variants(case):
    causal, window, softcap, dtype = True, (-1, -1), 0.0, BF16
    shape = (2, 300, 4, 4, 80, 80)  # b, s, h, hk, d, dv
    sk = 421
    if case == "fp16":
        dtype = torch.float16
    elif case == "gqa_full":  # unpacked GQA (packing is for causal d64 / windows)
        causal, shape = False, (2, 300, 8, 2, 112, 112)
    elif case == "window":
        window = (100, 0)
    elif case == "softcap":
        softcap, shape = 30.0, (1, 300, 4, 4, 200, 200)
    elif case == "long":
        shape, sk = (1, 4096, 4, 4, 112, 112), 4096
    elif case == "short_keys":
        sk = 7
    elif case == "hdimv":  # (80, 56) pads to (96, 96)
        shape = (2, 300, 4, 4, 80, 56)
    b, s, h, hk, d, dv = shape
    q, k, v = _inputs(b, s, sk, h, hk, d, dv, dtype=dtype)
    ran, out, lse = _narrow(q, k, v, causal, window, softcap)
    assert ran
    torch.cuda.synchronize()
    ref_out, ref_lse = _padded(q, k, v, causal, window, softcap)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_narrow_store_clipped():
    """out as a view into a wider buffer: the columns past Dv (other data) are not written."""
    q, k, v = _inputs(2, 300, 421, 4, 4, 40, 40)
    wide = torch.full((2, 300, 4, 64), 7.0, device="cuda", dtype=BF16)
    out = wide[..., :40]
    out.fill_(math.nan)
    ran, out, lse = _narrow(q, k, v, True, out=out)
    assert ran
    torch.cuda.synchronize()
    ref_out, ref_lse = _padded(q, k, v, True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert bool((wide[..., 40:] == 7.0).all())


@pytest.mark.parametrize("d, causal", [(32, False), (80, True), (112, False)])
def test_api_narrow_matches_padded(monkeypatch, d, causal):
    """flash_attn_func without autograd (the narrow path; a second call through its prepared
    memo.NarrowCall) against the same call with FLASH4_NARROW_HEADDIMS=0 (the padded copies): out and
    lse bitwise. (The memo's NarrowCall since 2026-12-04 evening: compile- and CPU-recorder-verified,
    not run on hardware yet.)"""
    q, k, v = _inputs(2, 300, 421, 4, 2, d, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    again, lse_again = flash_attn_func(q, k, v, causal=causal, return_lse=True)  # the kept memo.NarrowCall
    assert torch.equal(again, out) and torch.equal(lse_again, lse)
    monkeypatch.setenv("FLASH4_NARROW_HEADDIMS", "0")
    ref_out, ref_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("d, causal", [(40, True), (72, False), (120, True), (24, False)])
def test_api_narrow_headdim16(monkeypatch, d, causal):
    """FLASH4_HEADDIM16 on (the default): the no-grad narrow path onto the next multiple-of-16 kernel
    (d40 -> 48, d72 -> 80, d120 -> 128, d24 -> 32) against the padded copies onto that same kernel
    (FLASH4_NARROW_HEADDIMS=0): out and lse bitwise; the launch really is narrow."""
    monkeypatch.setenv("FLASH4_HEADDIM16", "1")
    q, k, v = _inputs(2, 300, 421, 4, 4, d, d, seed=d)
    dp = padded_headdims(d, d, 90)[0]
    assert dp == -(-d // 16) * 16
    ran, out_n, lse_n = _narrow(q, k, v, causal)
    assert ran
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, out_n) and torch.equal(lse, lse_n)
    monkeypatch.setenv("FLASH4_NARROW_HEADDIMS", "0")
    ref_out, ref_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_api_narrow_falls_back():
    """Strides TMA cannot read (a head stride of 40 + 4 elements), autograd, GQA packing: the padded path, same results."""
    q, k, v = _inputs(2, 300, 421, 4, 4, 40, 40)
    wide = torch.randn(2, 300, 4, 44, device="cuda", dtype=BF16)
    q_odd = wide[..., :40]
    q_odd.copy_(q)
    assert forward.launch_narrow  # the path exists; the API must not use it here
    assert torch.equal(flash_attn_func(q_odd, k, v, causal=True), flash_attn_func(q, k, v, causal=True))
    qg = q.detach().requires_grad_()
    out = flash_attn_func(qg, k, v, causal=True)
    out.sum().backward()
    assert qg.grad is not None and torch.equal(out.detach(), flash_attn_func(q, k, v, causal=True))
    # d40 causal GQA pads to the d64 kernel, which packs the query heads: the padded path
    qh, kh, vh = _inputs(1, 256, 2048, 8, 2, 40, 40)
    assert forward.launch_narrow(qh, kh, vh, torch.empty_like(qh), torch.empty(1, 8, 256, device="cuda"),
                                 forward.narrow_stand_in(qh, kh, vh, 40 ** -0.5, True)) is False
    out_gqa = flash_attn_func(qh, kh, vh, causal=True)
    assert torch.isfinite(out_gqa).all()
