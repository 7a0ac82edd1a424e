"""sm_90 kernels at every multiple of 16 up to 128 (FLASH4_HEADDIM16; flash4.config.sm90.KERNEL_HEADDIMS).

With the switch on, d16 / 32 / 48 / 80 / 112 run on kernels of their own width (no zero-padding),
and the other multiples of 8 pad to the next multiple of 16. Checked against the float32 reference
(the 2x-PyTorch rule) into NaN-poisoned out / lse / dq / dk / dv: the forward and backward kernels
directly (GQA, causal, windows, softcap, deterministic bitwise), the public doors end to end
(flash_attn_func with autograd and without, flash_attn_varlen_func, the decode door's split-KV and
its combine), and the same calls with the switch off (the padded path) agreeing within the rule.
"""

import math

import pytest
import torch

from flash4 import backward, flash_attn_func, flash_attn_varlen_func, forward
from flash4.backward import flash_attn_backward
from flash4.config import sm90
from flash4.reference import attention_ref, attention_varlen_ref, fwd_errors
from flash4.request import Request

from gpu_helpers import BF16, GRAD_ATOL, assert_grads, check_deterministic, inputs, ref_grads

NEW = (16, 32, 48, 80, 112)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("FLASH4_HEADDIM16", "1")


@pytest.fixture(autouse=True)
def _sm90_only():
    from flash4.arch import device_arch
    from flash4.config import active_family

    if active_family(device_arch()).name != "sm90":
        pytest.skip("the sm90 family's head dims")


def _rule(got, ref, low, name):
    err, bound = (got.float() - ref.float()).abs().max().item(), 2 * (low.float() - ref.float()).abs().max().item() + GRAD_ATOL
    assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("d", NEW)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [4, 1])
def test_kernels_poisoned(d, causal, hk):
    """The forward and backward kernels at head dim d (no padding) into NaN-filled buffers."""
    q, k, v, dout = inputs(2, 333, 421, 4, hk, d, seed=d)
    scale = d ** -0.5
    out = torch.full_like(q, math.nan)
    lse = torch.full((2, 4, 333), math.nan, device="cuda")
    request = Request.dense(q, k, v, scale, causal)
    forward.run(request, out=out, lse=lse)
    torch.cuda.synchronize()
    errs = fwd_errors(q, k, v, out, lse, None, causal)
    assert errs["ok"], errs
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, *grads)
    torch.cuda.synchronize()
    assert_grads(grads, ref_grads(q, k, v, dout, causal, True), ref_grads(q, k, v, dout, causal, False))


@pytest.mark.parametrize("d", [16, 80])
@pytest.mark.parametrize("kind", ["window", "softcap"])
def test_kernels_window_softcap(d, kind):
    q, k, v, dout = inputs(1, 517, 517, 4, 2, d, seed=3)
    scale = d ** -0.5
    kw = {"window_size": (64, 16)} if kind == "window" else {"softcap": 20.0}
    window = kw.get("window_size", (-1, -1))
    softcap = kw.get("softcap", 0.0)
    out, lse = forward.run(Request.dense(q, k, v, scale, False, window, softcap))
    errs = fwd_errors(q, k, v, out, lse, None, False, **kw)
    assert errs["ok"], errs
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, False, *grads, window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    assert_grads(grads, ref_grads(q, k, v, dout, False, True, **kw), ref_grads(q, k, v, dout, False, False, **kw))


@pytest.mark.parametrize("d", [48, 112])
def test_deterministic_bitwise(d):
    check_deterministic(2, 300, 4, 2, d, True, calls=2, seed=5)


@pytest.mark.parametrize("d, want", [(80, 80), (112, 112), (32, 32), (40, 48), (72, 80), (8, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_public_autograd(on, d, want, causal):
    """flash_attn_func with autograd at head dims the switch serves natively or pads to 16."""
    from flash4.headdim import padded_headdims

    assert padded_headdims(d, d, 90) == (want, want)
    q, k, v, dout = inputs(2, 257, 300, 8, 2, d, seed=7)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 8, 257)
    out.backward(dout)
    ro, rl = attention_ref(q, k, v, causal=causal)
    lo, ll = attention_ref(q, k, v, causal=causal, upcast=False)
    _rule(out, ro, lo, "out")
    _rule(lse, rl, ll, "lse")
    for name, leaf, gr, gp in zip(("dq", "dk", "dv"), leaves, ref_grads(q, k, v, dout, causal, True),
                                  ref_grads(q, k, v, dout, causal, False)):
        assert leaf.grad.shape == gr.shape and not leaf.grad.isnan().any()
        _rule(leaf.grad, gr, gp, name)


@pytest.mark.parametrize("d", [32, 40, 80])
def test_public_no_grad_matches_switch_off(monkeypatch, d):
    """Without autograd (the narrow path where d is not a multiple of 16): within the rule, and
    equal in shape and finiteness to the padded path of the switch off."""
    q, k, v, _ = inputs(2, 500, 500, 4, 4, d, seed=9)
    monkeypatch.setenv("FLASH4_HEADDIM16", "1")
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    out2, lse2 = flash_attn_func(q, k, v, causal=True, return_lse=True)  # the prepared call (flash4.memo)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    monkeypatch.setenv("FLASH4_HEADDIM16", "0")
    out_off, lse_off = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ro, rl = attention_ref(q, k, v, causal=True)
    lo, ll = attention_ref(q, k, v, causal=True, upcast=False)
    for o in (out, out_off):
        _rule(o, ro, lo, "out")
    for lse_ in (lse, lse_off):
        _rule(lse_, rl, ll, "lse")


@pytest.mark.parametrize("d", [16, 80])
def test_varlen(on, d):
    lens = [37, 0, 200, 5, 129]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(sum(lens), 4, d, generator=gen, device="cuda", dtype=BF16)
    k, v = (torch.randn(sum(lens), 2, d, generator=gen, device="cuda", dtype=BF16) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu, cu, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ro, rl = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    lo, ll = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
    _rule(out, ro, lo, "out")
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    _rule(lse[fin], rl[fin], ll[fin], "lse")
    ref_leaves = [[t.detach().float().requires_grad_() for t in (q, k, v)],
                  [t.detach().clone().requires_grad_() for t in (q, k, v)]]
    for i, upcast in enumerate((True, False)):
        o, _ = attention_varlen_ref(*ref_leaves[i], cu, cu, causal=True, upcast=upcast)
        o.backward(dout.float() if upcast else dout)
    for j, name in enumerate(("dq", "dk", "dv")):
        assert not leaves[j].grad.isnan().any()
        _rule(leaves[j].grad, ref_leaves[0][j].grad, ref_leaves[1][j].grad, name)


@pytest.mark.parametrize("d", [48, 80])
def test_decode_door_split_kv(on, d):
    """A short-query, long-key call without autograd takes the decode step (GQA packing, split-KV and
    the combine, whose lanes cover d80's columns raggedly)."""
    q, k, v, _ = inputs(2, 1, 8192, 8, 2, d, seed=11)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    errs = fwd_errors(q, k, v, out, lse, None, False)
    assert errs["ok"], errs


def test_kernel_headdims_served(on):
    from flash4.config import kernel_headdims

    assert kernel_headdims(90) == sm90.KERNEL_HEADDIMS
