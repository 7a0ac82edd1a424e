"""The sm100 backward's numerics model (flash4.models.sm100_bwd) against flash4.reference, on the CPU.

Criterion (the backward's, flash4.selftest / tests/gpu/test_bwd.py): per gradient
err <= 2 * err(PyTorch in the input dtype) + GRAD_ATOL, errors max |g - ref| against the float64
autograd gradients of flash4.reference.attention_ref; PyTorch's are autograd of the same function
computed in the input dtype. Without a window the model's inputs out / lse come from the sm100
forward's model (flash4.models.sm100_fwd), so each case runs the Blackwell dataflow end to end; with
one (the forward model has none) from the float64 reference. Random inputs (head dims 64 and 128,
causal, sliding windows and neither, softcap, GQA / MQA, odd lengths, seqlen_q != seqlen_k both
ways, bf16 and fp16) and adversarial ones (large and extreme logits, with and without the forward's LSE split;
rows that see one key; rows that see none; a dominant key). Equivalences: mma_k None / tiles / dq
order change only roundings; the preprocess's D and the dq_accum adds are the documented orders.
It checks the algorithm, not the kernel (compile-verified, not run on hardware).

    python tests/cpu/test_sm100_bwd_model.py    # prints the error bands per case
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from flash4.constants import LOG2E
from flash4.kernels.common.scales import host_scales
from flash4.models import sm100_bwd as B
from flash4.models import sm100_fwd as F
from flash4.reference import attention_ref, max_abs_err
from flash4.selftest import GRAD_ATOL

NAMES = ("dq", "dk", "dv")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small float64 matmuls: one thread is much faster than two on the shared 2-core box
    (tests/cpu/test_sm100_numerics.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_case(b, sq, sk, h, hk, d, dtype=torch.bfloat16, seed=0, magnitude=1.0):
    """q, k, v, dout (q and k times magnitude)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(s, generator=g) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    return (q * magnitude).to(dtype), (k * magnitude).to(dtype), v.to(dtype), do.to(dtype)


def ref_grads(q, k, v, dout, causal, upcast, window_size=None, softcap=0.0):
    """Autograd of attention_ref: float64 (upcast) or the input dtype (PyTorch same dtype)."""
    leaves = [(t.double() if upcast else t.clone()).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, None, causal, upcast=upcast, compute_dtype=torch.float64, window_size=window_size,
                           softcap=softcap)
    return torch.autograd.grad(out, leaves, dout.double() if upcast else dout)


def exact_split(q, k, v, causal, window_size=None):
    """The forward's unrounded log2-domain LSE split (hi, lo) from the float64 reference (what the
    exact-reference forward produces, up to its own error)."""
    _, lse = attention_ref(q, k, v, None, causal, compute_dtype=torch.float64, window_size=window_size)
    l2 = lse * LOG2E
    hi = torch.where(torch.isfinite(l2), l2, math.inf).float()
    lo = torch.where(torch.isfinite(l2), l2 - hi.double(), 0.0).float()
    return torch.stack([hi, lo])


def errors(q, k, v, dout, causal, grads, window_size=None, softcap=0.0):
    g_ref = ref_grads(q, k, v, dout, causal, True, window_size, softcap)
    g_pt = ref_grads(q, k, v, dout, causal, False, window_size, softcap)
    return {name: (max_abs_err(g, r), max_abs_err(p, r)) for name, g, r, p in zip(NAMES, grads, g_ref, g_pt)}


def forward(q, k, v, causal, window_size=None, softcap=0.0):
    """out, lse: the sm100 forward's model, or (with a window or softcap, which it lacks) the float64
    reference."""
    if window_size is None and not softcap:
        return F.forward(q, k, v, None, causal)
    out, lse = attention_ref(q, k, v, None, causal, compute_dtype=torch.float64, window_size=window_size,
                             softcap=softcap)
    return out.to(q.dtype), lse.float()


def check(q, k, v, dout, causal, lse_split=None, window_size=None, softcap=0.0, **kw):
    """Forward (model) -> backward model -> the 2x rule per gradient. Returns (errors, stats)."""
    out, lse = forward(q, k, v, causal, window_size, softcap)
    dq, dk, dv, stats = B.backward(dout, q, k, v, out, lse, None, causal, window_size, softcap, lse_split=lse_split,
                                   return_stats=True, **kw)
    for name, g, t in zip(NAMES, (dq, dk, dv), (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype, (name, g.shape, g.dtype)
    e = errors(q, k, v, dout, causal, (dq, dk, dv), window_size, softcap)
    for name, (err, pt) in e.items():
        assert math.isfinite(pt), f"{name}: PyTorch's same-dtype error is {pt}"
        assert err <= 2 * pt + GRAD_ATOL, f"{name}: err {err:.3e} > 2 x PyTorch {pt:.3e} + {GRAD_ATOL}"
    return e, stats


# ---------------------------------------------------------------- random inputs

SHAPES = [  # (b, sq, sk, h, hk)
    (1, 77, 77, 2, 2),  # odd, one partial tile
    (1, 200, 333, 4, 1),  # MQA, sq < sk
    (1, 333, 200, 2, 1),  # sq > sk: causal rows without keys
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_random(shape, d, causal):
    b, sq, sk, h, hk = shape
    _, stats = check(*make_case(b, sq, sk, h, hk, d, seed=sq + d), causal)
    assert stats["kv_tiles"] == -(-sk // 128)


@pytest.mark.parametrize("causal", [False, True])
def test_random_fp16(causal):
    check(*make_case(1, 257, 300, 2, 1, 128, dtype=torch.float16, seed=3), causal)


@pytest.mark.parametrize("case", [(1, 200, 333, 2, 1, False, torch.bfloat16, None),
                                  (1, 300, 131, 4, 2, True, torch.bfloat16, None),
                                  (1, 257, 200, 2, 2, False, torch.float16, (45, 7))],
                         ids=lambda c: f"sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-{'causal' if c[5] else 'full'}-"
                                       f"{str(c[6])[-8:]}" + ("-window" if c[7] else ""))
def test_headdim_192_v128(case):
    """(192, 128), the serial 1-CTA schedule: the same per-step arithmetic (its dQ read-out passes move
    the same fp32 values), V and dO with 128 columns."""
    b, sq, sk, h, hk, causal, dtype, window = case
    q, k, _, _ = make_case(b, sq, sk, h, hk, 192, dtype=dtype, seed=sq + sk)
    g = torch.Generator().manual_seed(sk)
    v, do = (torch.randn(s, generator=g).to(dtype) for s in ((b, sk, hk, 128), (b, sq, h, 128)))
    e, _ = check(q, k, v, do, causal, window_size=window)
    assert all(err > 0 for err, _ in e.values())


@pytest.mark.parametrize("case", [(1, 200, 333, 2, 1, False, torch.bfloat16, None),
                                  (1, 300, 131, 2, 1, True, torch.float16, None),
                                  (1, 257, 200, 2, 2, False, torch.bfloat16, (45, 7))],
                         ids=lambda c: f"sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-{'causal' if c[5] else 'full'}-"
                                       f"{str(c[6])[-8:]}" + ("-window" if c[7] else ""))
def test_headdim_256_two_passes(case):
    """hd256, the two passes (docs/design/sm100_backward.md section 10.4): pass dv computes S^T, P^T and
    dV as the one-kernel steps 1-4 and 6; pass dkdq recomputes S^T from the same operands in the same
    k-steps (bitwise the same P^T), accumulates dP^T over its 32-column V / dO chunks in the same
    k-step order as one MMA, and moves the same fp32 dQ values in 32-column read-out passes. So the
    one-kernel model at D = 256 is both passes' arithmetic; checked within the 2x rule."""
    b, sq, sk, h, hk, causal, dtype, window = case
    e, _ = check(*make_case(b, sq, sk, h, hk, 256, dtype=dtype, seed=sq + sk), causal, window_size=window)
    assert all(err > 0 for err, _ in e.values())


@pytest.mark.parametrize("case", [(1, 200, 333, 2, 1, False, torch.bfloat16, 2.0, 5.0, None),
                                  (1, 300, 131, 2, 1, True, torch.float16, 4.0, 5.0, None),
                                  (1, 257, 200, 2, 2, False, torch.bfloat16, 2.0, 10.0, (45, 7))],
                         ids=lambda c: f"sq{c[1]}-sk{c[2]}-{'causal' if c[5] else 'full'}-{str(c[6])[6:]}-x{c[7]:g}"
                                       f"-cap{c[8]:g}" + ("-window" if c[9] else ""))
def test_headdim_256_two_passes_softcap(case):
    """hd256 with softcap as the two passes compute it (flash4.models.sm100_bwd.backward_two_pass: pass dv
    takes tanh before its exp2, pass dkdq too and multiplies dS by grad_factor, dP^T over 32-column
    V / dO chunks): within the 2x rule against flash4.reference, and bitwise the one-kernel model
    (the passes recompute the same P^T and dP^T)."""
    b, sq, sk, h, hk, causal, dtype, mag, cap, window = case
    q, k, v, do = make_case(b, sq, sk, h, hk, 256, dtype=dtype, seed=sq + sk + 256, magnitude=mag)
    out, lse = forward(q, k, v, causal, window, cap)
    grads = B.backward_two_pass(do, q, k, v, out, lse, None, causal, window, cap)
    e = errors(q, k, v, do, causal, grads, window, cap)
    for name, (err, pt) in e.items():
        assert err <= 2 * pt + GRAD_ATOL, f"{name}: err {err:.3e} > 2 x PyTorch {pt:.3e} + {GRAD_ATOL}"
    one = B.backward(do, q, k, v, out, lse, None, causal, window, cap)
    assert all(torch.equal(x, y) for x, y in zip(grads, one))
    dv_only = B.backward(do, q, k, v, out, lse, None, causal, window, cap, bwd_pass="dv")
    assert not dv_only[0].any() and not dv_only[1].any() and torch.equal(dv_only[2], one[2])


def test_two_pass_softcap_needs_tanh_in_pass_dv():
    """The rule has teeth for pass dv: P without tanh (the pre-softcap dv pass) fails dv's 2x rule."""
    q, k, v, do = make_case(1, 200, 160, 2, 1, 256, seed=5, magnitude=4.0)
    out, lse = forward(q, k, v, True, None, 5.0)
    _, _, dv_plain = B.backward(do, q, k, v, out, lse, None, True, bwd_pass="dv")
    dq, dk, _ = B.backward(do, q, k, v, out, lse, None, True, softcap=5.0, bwd_pass="dkdq")
    e = errors(q, k, v, do, True, (dq, dk, dv_plain), softcap=5.0)
    assert e["dv"][0] > 2 * e["dv"][1] + GRAD_ATOL and e["dk"][0] <= 2 * e["dk"][1] + GRAD_ATOL, e


@pytest.mark.parametrize("variant", [dict(mma_k=None), dict(dq_order="reverse"),
                                     dict(dq_order=7), dict(tile_m=64, tile_n=64)],
                         ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_random_variants(variant):
    check(*make_case(1, 190, 390, 2, 1, 64, seed=11), True, **variant)


# The kernel author's cases (b, sq, sk, h, hk, d, causal, dtype, magnitude, window_size)
KERNEL_CASES = [
    (1, 200, 300, 2, 2, 128, False, torch.bfloat16, 1.0, None),
    (1, 300, 131, 4, 1, 128, True, torch.bfloat16, 1.0, None),
    (2, 131, 257, 4, 2, 64, True, torch.float16, 1.0, None),
    (1, 257, 257, 3, 1, 64, False, torch.bfloat16, 3.0, None),
    (1, 300, 200, 2, 1, 128, False, torch.bfloat16, 1.0, (45, 7)),
]


def _case_id(c):
    return (f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-{str(c[7])[6:]}-x{c[8]:g}"
            + (f"-w{c[9][0]},{c[9][1]}" if c[9] else ""))


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_kernel_cases(case):
    b, sq, sk, h, hk, d, causal, dtype, mag, window = case
    check(*make_case(b, sq, sk, h, hk, d, dtype=dtype, seed=sq * 7 + sk, magnitude=mag), causal, window_size=window)


# ---------------------------------------------------------------- sliding windows

WINDOW_CASES = [  # (b, sq, sk, h, hk, d, causal, dtype, window_size)
    (1, 300, 300, 2, 1, 64, True, torch.bfloat16, (100, -1)),  # causal + left side (the local kernel)
    (1, 200, 333, 4, 2, 128, False, torch.float16, (30, 60)),  # both sides, sq < sk, GQA
    (2, 333, 140, 2, 2, 64, False, torch.bfloat16, (-1, 20)),  # right side only, sq > sk: rows without keys
    (1, 150, 150, 3, 1, 64, False, torch.float16, (0, 0)),  # one key per row (the diagonal), MQA
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-"
                         f"{'causal' if c[6] else 'full'}-{str(c[7])[6:]}-w{c[8][0]},{c[8][1]}")
def test_window(case):
    b, sq, sk, h, hk, d, causal, dtype, window = case
    _, stats = check(*make_case(b, sq, sk, h, hk, d, dtype=dtype, seed=sq + sk + d), causal, window_size=window)
    # the visited pairs are m_block_range's: exactly the (m, n) pairs with a visible (query, key)
    from flash4.geometry import visible, window_sides
    w = window_sides(window, causal)
    want = {(i // 128, j // 128) for i in range(sq) for j in range(sk) if visible(i, j, sq, sk, causal, w)}
    assert stats["tile_pairs"] == len(want) and stats["steps"] == h // hk * len(want), (stats, len(want))


def test_window_rows_without_keys_get_zero_dq():
    """A right-only window (-1, 20) with sq > sk: query row i sees keys <= i - (sq - sk) + 20, so the
    first sq - sk - 20 rows see none: their dq is exactly 0; and a key block no query sees gets dk = dv = 0."""
    q, k, v, do = make_case(1, 333, 140, 2, 2, 64, seed=20)
    out, lse = forward(q, k, v, False, (-1, 20))
    dq, dk, dv = B.backward(do, q, k, v, out, lse, None, False, (-1, 20))
    assert (dq[:, :333 - 140 - 20] == 0).all() and dq[:, 333 - 140 - 20:].abs().amax() > 0
    q, k, v, do = make_case(1, 100, 300, 1, 1, 64, seed=21)  # window (0, 0), sq < sk: keys 0..199 unseen
    out, lse = forward(q, k, v, False, (0, 0))
    dq, dk, dv = B.backward(do, q, k, v, out, lse, None, False, (0, 0))
    assert (dk[:, :200] == 0).all() and (dv[:, :200] == 0).all() and dv[:, 200:].abs().amax() > 0


# ---------------------------------------------------------------- softcap

SOFTCAP_CASES = [  # (b, sq, sk, h, hk, d, causal, dtype, magnitude, softcap, window_size)
    (1, 200, 333, 2, 1, 64, False, torch.bfloat16, 1.0, 5.0, None),  # the self-test's cap (selftest._SOFTCAP)
    (1, 300, 131, 4, 2, 128, True, torch.bfloat16, 4.0, 5.0, None),  # tanh saturated: scores ~ +-30 / 5
    (1, 257, 257, 2, 2, 128, False, torch.float16, 4.0, 30.0, None),  # Gemma 2's attention cap 50 / 30 range
    (2, 131, 200, 2, 1, 64, True, torch.bfloat16, 8.0, 50.0, None),  # large logits under a large cap
    (1, 300, 200, 2, 1, 64, False, torch.bfloat16, 2.0, 10.0, (45, 7)),  # with a window
]


def _softcap_id(c):
    return (f"sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-{str(c[7])[6:]}-x{c[8]:g}"
            f"-cap{c[9]:g}" + (f"-w{c[10][0]},{c[10][1]}" if c[10] else ""))


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=_softcap_id)
def test_softcap(case):
    b, sq, sk, h, hk, d, causal, dtype, mag, cap, window = case
    check(*make_case(b, sq, sk, h, hk, d, dtype=dtype, seed=sq + sk + d, magnitude=mag), causal, window_size=window,
          softcap=cap)


@pytest.mark.parametrize("rel_err", [1e-5, -1e-5])
def test_softcap_within_the_measured_tanh_error(rel_err):
    """MUFU.TANH off by its measured bound (1.0e-5 relative, the same sign everywhere: the worst
    systematic case) still passes: the forward's LSE (exact tanh here) and the backward's P then
    disagree by exp(cap * t * rel_err), far below one bf16 rounding."""
    q, k, v, do = make_case(1, 300, 131, 4, 2, 128, seed=31, magnitude=4.0)
    check(q, k, v, do, True, softcap=5.0, tanh_rel_err=rel_err)


def test_softcap_rule_has_teeth():
    """Without score.grad_factor (dS not multiplied by 1 - t^2) the saturated-tanh case fails the rule;
    with softcap 0 the model is the plain one."""
    q, k, v, do = make_case(1, 300, 131, 4, 2, 128, seed=31, magnitude=4.0)
    out, lse = forward(q, k, v, True, softcap=5.0)
    saved = B.grad_factor
    try:
        B.grad_factor = lambda p, lse_l2, r: torch.ones_like(p)
        grads = B.backward(do, q, k, v, out, lse, None, True, softcap=5.0)
    finally:
        B.grad_factor = saved
    e = errors(q, k, v, do, True, grads, softcap=5.0)
    assert any(err > 2 * pt + GRAD_ATOL for err, pt in e.values()), e
    out, lse = forward(q, k, v, True)
    assert all(torch.equal(a, b) for a, b in zip(B.backward(do, q, k, v, out, lse, None, True),
                                                 B.backward(do, q, k, v, out, lse, None, True, softcap=0.0)))


def test_softcap_chain_spelled_out():
    """Steps 2 and 5 with softcap on one block: t = tanh(fp32(S * a)), P = 2^fma(t, c, -L), dS =
    fp32(fp32(fp32(fp32(dP - D) * P) * scale) * fma(-t', t', 1)) with t' = fp32(fp32(log2 P + L) * r);
    c, a, r the kernel's Float32 scales; the model's dk equals the hand chain, and t' recovers t."""
    q, k, v, do = make_case(1, 16, 16, 1, 1, 64, seed=23, magnitude=2.0)
    scale, cap = 0.3, 4.0
    out, lse = attention_ref(q, k, v, scale, False, compute_dtype=torch.float64, softcap=cap)
    out, lse = out.to(q.dtype), lse.float()
    dq, dk, dv = B.backward(do, q, k, v, out, lse, scale, softcap=cap, tile_m=16, tile_n=16)
    c = float(np.float32(cap) * np.float32(LOG2E))
    a = float(np.float32(scale) / np.float32(cap))
    r = float(np.float32(1.0) / np.float32(c))
    assert B.softcap_scales(scale, cap) == (c, a, r)
    s_t = F.mma_f32(None, k[0, :, 0].double(), q[0, :, 0].double().T, 16)
    dp_t = F.mma_f32(None, v[0, :, 0].double(), do[0, :, 0].double().T, 16)
    t = torch.tanh((s_t * a).double()).float()
    big_l = B.lse_log2(lse)[0, 0]
    p = F.exp2_hw(F.fma_f32(t, c, (-big_l).expand_as(s_t).contiguous()))
    t_back = ((torch.log2(p.double()).float() + big_l) * r)
    assert (t_back - t).abs().max() < 1e-4  # recovered from P and the LSE
    f = (1.0 - t_back.double() ** 2).float()  # one rounding of the exact fma (|t'| < 1 here: no cancellation trap)
    d = B.preprocess_dpsum(out, do)[0, 0]
    ds = (((dp_t - d) * p) * float(np.float32(scale))) * f
    want_dk = F.mma_f32(None, ds.to(q.dtype).double(), q[0, :, 0].double(), 16).to(q.dtype)
    want_dv = F.mma_f32(None, p.to(q.dtype).double(), do[0, :, 0].double(), 16).to(q.dtype)
    assert torch.equal(dk[0, :, 0], want_dk) and torch.equal(dv[0, :, 0], want_dv)


def test_softcap_grad_factor_is_zero_where_p_is():
    p = torch.tensor([[0.0, 0.5, 1.0]])
    lse_l2 = torch.tensor([[math.inf, 1.0, 0.0]])
    f = B.grad_factor(p, lse_l2, 0.25)
    assert f[0, 0] == 0 and f[0, 1] == np.float32(1 - 0.0) and f[0, 2] == 1.0  # t = 0: 1
    p = torch.tensor([0.25])
    assert B.grad_factor(p, torch.tensor([3.0]), 0.5) == np.float32(1 - 0.25)  # t = (-2 + 3) * 0.5


# ---------------------------------------------------------------- adversarial inputs

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_large_logits(dtype):
    """Scores ~ +-300 (x8 inputs, d 64): P is a near one-hot per row; |L| < 2^10."""
    q, k, v, do = make_case(1, 150, 260, 2, 1, 64, dtype=dtype, seed=4, magnitude=8.0)
    check(q, k, v, do, False)
    check(q, k, v, do, True)


def test_huge_logits():
    """Scores ~ 1e4 (|L| >= 2^10): the query blocks take the exact-LSE path; with the forward's split
    P is exact at the row max, without it (hi = fp32(L), lo = 0) the path changes nothing; the rule
    holds both ways."""
    q, k, v, do = make_case(1, 130, 200, 2, 1, 64, seed=5, magnitude=40.0)
    check(q, k, v, do, False, lse_split=exact_split(q, k, v, False))
    check(q, k, v, do, False)


def test_extreme_logits():
    """Scores ~2^20 / 8 with O(1) spread (q[..., 0] = 2^20, k[..., 0] = 1: P not one-hot): L ~ 2^17.5
    has an fp32 ulp of 2^-6, so the rounded lse_log2 alone would move every P by up to ~1%; with the
    forward's split the exact-LSE path takes it back. PyTorch's own bf16 errors are larger still: the
    rule holds with and without the split (test_exact_lse_path_huge_fill is the case it decides)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, s, 1, 64, generator=g) for s in (64, 128, 128, 64))
    q[..., 0], k = 2.0**20, k * 0.3
    k[..., 0] = 1.0
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    out, lse = attention_ref(q, k, v, None, False, compute_dtype=torch.float64)
    out, lse = out.to(q.dtype), lse.float()
    split = B.backward(do, q, k, v, out, lse, lse_split=exact_split(q, k, v, False))
    rounded = B.backward(do, q, k, v, out, lse)
    for grads in (split, rounded):
        e = errors(q, k, v, do, False, grads)
        assert all(err <= 2 * pt + GRAD_ATOL for err, pt in e.values()), e
    assert B.lse_log2(lse).abs().min() > 2 ** 17


def fill_split(fill: float, d: int, seqlen_k: int, batch: int, nheads: int, seqlen_q: int) -> torch.Tensor:
    """The forward's log2-domain split for q = k = fill (every score S = fill^2 d, exact in fp32), no
    mask: hi = fp32(S c), lo = fp32((S c - hi) + log2 seqlen_k) from exact rationals, c the kernels'
    fp32 scale_log2 at softmax_scale 1 / sqrt(d) (the forward's, folded on the host by
    kernels/common/scales.host_scales, equals the backward's device fold fp32(fp32(scale) fp32(log2 e)))."""
    from fractions import Fraction

    c = np.float32(np.float32(1 / math.sqrt(d)) * np.float32(LOG2E))
    assert c == np.float32(host_scales(1 / math.sqrt(d), 0.0, False)[0])
    sc = Fraction(fill * fill * d) * Fraction(float(c))
    hi = np.float32(float(sc))
    lo = np.float32(float(sc - Fraction(float(hi))) + math.log2(seqlen_k))
    shape = (batch, nheads, seqlen_q)
    return torch.stack([torch.full(shape, float(hi)), torch.full(shape, float(lo))])


def test_exact_lse_path_huge_fill():
    """Issue 8 on the sm100 backward: q = k = v = 133120 (bf16; tests/gpu/test_robustness.py's fill), no
    mask: every P is 1 / seqlen_k exactly, lse_log2 ~ 2^38 has an fp32 ulp of 2^15. With the exact-LSE
    path (every query block flagged) the model is within the 2x rule of flash4.reference; without it
    (P from the rounded lse_log2: 2^(up to +-2^14)) it is not."""
    fill, b, s, h, d = 133120.0, 1, 200, 2, 64
    q = torch.full((b, s, h, d), fill, dtype=torch.bfloat16)
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    split = fill_split(fill, d, s, b, h, s)
    lse = ((split[0].double() + split[1].double()) / LOG2E).float()
    assert (B.lse_log2(lse, split).abs() >= B.BWD_EXACT_LSE_LOG2).all()
    dq, dk, dv, stats = B.backward(dout, q, q, q, q, lse, lse_split=split, return_stats=True)
    assert stats["exact_blocks"] == b * h * -(-s // 128)
    assert abs(stats["p_max"] - 1 / s) <= 2 ** -20
    e = errors(q, q, q, dout, False, (dq, dk, dv))
    assert all(err <= 2 * pt + GRAD_ATOL for err, pt in e.values()), e
    rounded = B.backward(dout, q, q, q, q, lse, lse_split=split, exact_lse=False)
    e = errors(q, q, q, dout, False, rounded)
    assert not all(err <= 2 * pt + GRAD_ATOL for err, pt in e.values()), e


def test_exact_residual_is_the_rounding_error():
    """TwoSum: hi + lo = fp32(hi + lo) + r exactly (checked in rationals), r = 0 on +inf rows."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(6)
    hi = (torch.randn(1000, generator=g) * 2.0 ** 30).float()
    lo = (torch.randn(1000, generator=g) * 8.0).float()
    hi[0], lo[0] = math.inf, 0.0
    big_l = hi + lo
    r = B.exact_residual(hi, lo, big_l)
    assert r[0] == 0
    for h_, l_, b_, r_ in zip(hi[1:].tolist(), lo[1:].tolist(), big_l[1:].tolist(), r[1:].tolist()):
        assert Fraction(h_) + Fraction(l_) == Fraction(b_) + Fraction(r_)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_visible_key_rows(dtype):
    """Causal, sq == sk: row 0 sees key 0 only (P = 1, dS = 0); and seqlen_k 1: every row sees
    one key, so dq = dk = 0 in exact arithmetic and dv = sum of dout."""
    check(*make_case(1, 300, 300, 2, 1, 128, dtype=dtype, seed=9), True)
    q, k, v, do = make_case(2, 65, 1, 2, 1, 64, dtype=dtype, seed=10)
    e, _ = check(q, k, v, do, False)
    assert e["dq"][0] <= GRAD_ATOL and e["dk"][0] <= GRAD_ATOL


def test_rows_without_keys_get_zero_dq():
    """Causal, sq > sk: rows 0..sq-sk-1 see no key (lse -inf): their dq is exactly 0."""
    q, k, v, do = make_case(1, 200, 70, 2, 2, 64, seed=12)
    out, lse = F.forward(q, k, v, None, True)
    dq, dk, dv, stats = B.backward(do, q, k, v, out, lse, None, True, return_stats=True)
    assert (dq[:, :130] == 0).all()
    assert stats["skipped_pairs"] == 1 and stats["tile_pairs"] == 1  # query tile 0 (rows < 128 < 130) sees no key
    check(q, k, v, do, True)


def test_causal_skips_blocks_above_the_diagonal():
    """sq == sk = 300 causal: KV tile n is seen by query tiles m >= n only: 3 + 2 + 1 pairs."""
    q, k, v, do = make_case(1, 300, 300, 1, 1, 64, seed=13)
    out, lse = F.forward(q, k, v, None, True)
    *_, stats = B.backward(do, q, k, v, out, lse, None, True, return_stats=True)
    assert stats["tile_pairs"] == 6 and stats["skipped_pairs"] == 3 and stats["dq_adds"] == 6
    assert stats["p_max"] <= 1 + 2 ** -6


def test_dominant_key():
    """Key 5 scores 40 log2 units above the rest in every row (q[..., 0] = 4, k[5, 0] = 40 / (4 c)):
    P ~ one-hot, dP - D cancels catastrophically."""
    q, k, v, do = make_case(1, 129, 300, 2, 1, 128, seed=14)
    c = LOG2E / math.sqrt(128)
    q, k = q.clone(), k.clone()
    q[..., 0], k[..., 0] = 4.0, 0.0
    k[:, 5, :, 0] = 40.0 / (4.0 * c)
    check(q, k, v, do, False)
    check(q, k, v, do, True)


def test_the_rule_has_teeth():
    """A wrong LSE (off by 0.02 nats: every P 2% too large) or a D off by 0.2 (of |D| ~ 1) fails
    the rule: the bands above are not loose enough to hide a dataflow bug of that size."""
    q, k, v, do = make_case(1, 200, 333, 2, 1, 64, seed=19)
    out, lse = F.forward(q, k, v)
    for kw in (dict(lse=lse - 0.02), dict(dlse=torch.full_like(lse, 0.2))):
        args = dict(lse=lse) | kw
        grads = B.backward(do, q, k, v, out, args.pop("lse"), **args)
        e = errors(q, k, v, do, False, grads)
        assert any(err > 2 * pt + GRAD_ATOL for err, pt in e.values()), (kw.keys(), e)


# ---------------------------------------------------------------- the dataflow's own pieces

def test_preprocess_dpsum_order():
    g = torch.Generator().manual_seed(15)
    out, do = (torch.randn(2, 5, 3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    d = B.preprocess_dpsum(out, do)
    prod = (out.float() * do.float()).permute(0, 2, 1, 3)  # (B, H, S, 64)
    lanes = []
    for lane in range(8):  # chunks lane, lane + 8 of 4 elements
        acc = torch.zeros(2, 3, 5)
        for j in range(2):
            for e in range(4):
                acc = acc + prod[..., (j * 8 + lane) * 4 + e]
        lanes.append(acc)
    a = [lanes[i] + lanes[i + 4] for i in range(4)]
    b = [a[0] + a[2], a[1] + a[3]]
    assert torch.equal(d, b[0] + b[1])
    assert torch.allclose(d.double(), prod.double().sum(-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 32"):
        B.preprocess_dpsum(out[..., :48], do[..., :48])


def test_lse_log2():
    """flash4.backward's host rounding fp32(lse * log2 e) (+inf for -inf), or the preprocess's
    fp32(hi + lo) of the forward's split."""
    lse = torch.tensor([[[0.5, -math.inf, 3.0]]])
    big = B.lse_log2(lse)
    assert big[0, 0, 1] == math.inf
    assert torch.equal(big[0, 0, ::2], torch.tensor([0.5, 3.0]) * LOG2E)  # one fp32 multiply
    split = torch.stack([torch.tensor([[[1.0, math.inf, 2.0]]]), torch.tensor([[[2 ** -30, 0.0, 0.5]]])])
    big = B.lse_log2(lse, split)
    assert big[0, 0, 0] == 1.0 and big[0, 0, 1] == math.inf and big[0, 0, 2] == 2.5  # fp32(hi + lo)


def test_ds_order_and_scale_constant():
    """Step 5 and 2 spelled out on one block: dS = fp32(fp32(fp32(dP - D) * P) * fp32(scale)),
    c = fp32(fp32(scale) * fp32(log2 e)), P from one fma; the model's dk equals the hand chain."""
    q, k, v, do = make_case(1, 16, 16, 1, 1, 64, seed=22)
    scale = 0.3
    out, lse = F.forward(q, k, v, scale)
    dq, dk, dv = B.backward(do, q, k, v, out, lse, scale, tile_m=16, tile_n=16)
    c = float(np.float32(scale) * np.float32(LOG2E))
    s_t = F.mma_f32(None, k[0, :, 0].double(), q[0, :, 0].double().T, 16)
    dp_t = F.mma_f32(None, v[0, :, 0].double(), do[0, :, 0].double().T, 16)
    neg_l = (-B.lse_log2(lse)[0, 0]).expand_as(s_t).contiguous()
    p = F.exp2_hw(F.fma_f32(s_t, c, neg_l))
    d = B.preprocess_dpsum(out, do)[0, 0]
    ds = ((dp_t - d) * p) * float(np.float32(scale))
    want_dk = F.mma_f32(None, ds.to(q.dtype).double(), q[0, :, 0].double(), 16).to(q.dtype)
    want_dv = F.mma_f32(None, p.to(q.dtype).double(), do[0, :, 0].double(), 16).to(q.dtype)
    assert torch.equal(dk[0, :, 0], want_dk) and torch.equal(dv[0, :, 0], want_dv)


def test_gqa_accumulates_in_one_chain():
    """MQA: dK of the KV head is one fp32 chain over (head 0's blocks, head 1's blocks), not the
    fp32 sum of per-head tiles; both are within roundings of the MHA model's dK summed over heads."""
    q, k, v, do = make_case(1, 130, 140, 2, 1, 64, seed=23)
    out, lse = F.forward(q, k, v)
    mqa = B.backward(do, q, k, v, out, lse)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    out2, lse2 = F.forward(q, kk, vv)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    mha = B.backward(do, q, kk, vv, out, lse)
    for got, per_head in zip(mqa[1:], mha[1:]):
        summed = per_head.float().sum(2, keepdim=True)
        assert max_abs_err(got, summed) <= 2 ** -7 * summed.abs().max().item()
    assert torch.equal(mqa[0], mha[0])  # dq does not depend on the KV grouping


def test_dq_order_changes_only_roundings():
    """dq_accum's add order (atomics) moves dq by roundings; dk, dv do not depend on it (bitwise)."""
    q, k, v, do = make_case(1, 130, 520, 1, 1, 64, seed=16)
    out, lse = F.forward(q, k, v)
    fwd = B.backward(do, q, k, v, out, lse, dq_order="forward")
    rev = B.backward(do, q, k, v, out, lse, dq_order="reverse")
    assert torch.equal(fwd[1], rev[1]) and torch.equal(fwd[2], rev[2])
    ulp = 2.0 ** (math.floor(math.log2(fwd[0].abs().max().item())) - 7)
    assert max_abs_err(fwd[0], rev[0]) <= ulp


def test_dlse_joins_d():
    """dlse (the LSE's gradient) joins D: dq, dk follow the float64 formula with dlse
    (attention_bwd_ref), far closer than to the one without it; dv does not depend on it."""
    from flash4.reference import attention_bwd_ref

    q, k, v, do = make_case(1, 100, 140, 2, 1, 64, seed=17)
    out, lse = F.forward(q, k, v)
    dlse = torch.randn(1, 2, 100, generator=torch.Generator().manual_seed(18))
    got = B.backward(do, q, k, v, out, lse, dlse=dlse)
    want = attention_bwd_ref(do, q, k, v, out, lse, dlse, compute_dtype=torch.float64)
    base = attention_bwd_ref(do, q, k, v, out, lse, None, compute_dtype=torch.float64)
    for g, w, b0 in zip(got[:2], want[:2], base[:2]):
        assert max_abs_err(g, w) < 0.1 * max_abs_err(b0, w)  # the dlse term is there, and right
    assert torch.equal(got[2], B.backward(do, q, k, v, out, lse)[2])


def test_bad_arguments():
    q, k, v, do = make_case(1, 4, 4, 1, 1, 64)
    out, lse = F.forward(q, k, v)
    with pytest.raises(ValueError, match="tile_n"):
        B.backward(do, q, k, v, out, lse, tile_n=100)
    with pytest.raises(ValueError, match="bfloat16 or all float16"):
        B.backward(do.float(), q, k, v, out, lse)
    with pytest.raises(ValueError, match="dq_order"):
        B.backward(do, q, k, v, out, lse, dq_order="sideways")
    with pytest.raises(ValueError, match="lse"):
        B.backward(do, q, k, v, out, lse[:, :, :2])


# ---------------------------------------------------------------- the bands

def bands():
    """Per case: each gradient's error / (2 * PyTorch's + GRAD_ATOL) (<= 1 passes)."""
    cases = [(f"random {'x'.join(map(str, s))} d{d}{' causal' if c else ''}", make_case(*s, d, seed=s[1] + d), c, None)
             for s in SHAPES for d in (64, 128) for c in (False, True)]
    cases.append(("fp16 1x257x300x2x1 d128 causal", make_case(1, 257, 300, 2, 1, 128, dtype=torch.float16, seed=3),
                  True, None))
    cases.append(("large logits x8 d64", make_case(1, 150, 260, 2, 1, 64, seed=4, magnitude=8.0), False, None))
    cases += [(_case_id(c), make_case(*c[:6], dtype=c[7], seed=c[1] * 7 + c[2], magnitude=c[8]), c[6], c[9])
              for c in KERNEL_CASES]
    cases = [c + (0.0,) for c in cases]
    cases += [(_softcap_id(c), make_case(*c[:6], dtype=c[7], seed=c[1] + c[2] + c[5], magnitude=c[8]), c[6], c[10],
               c[9]) for c in SOFTCAP_CASES]
    print("case | dq err, pt, ratio | dk ... | dv ...")
    worst = 0.0
    for name, (q, k, v, do), causal, window, cap in cases:
        out, lse = forward(q, k, v, causal, window, cap)
        e = errors(q, k, v, do, causal, B.backward(do, q, k, v, out, lse, None, causal, window, cap), window, cap)
        cells = []
        for err, pt in e.values():
            ratio = err / (2 * pt + GRAD_ATOL)
            worst = max(worst, ratio)
            cells.append(f"{err:.2e}, {pt:.2e}, {ratio:.3f}")
        print(f"{name} | " + " | ".join(cells))
    print(f"worst ratio {worst:.3f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    bands()


# ---------------------------------------------------------------- packed sequences (issue 23)

@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_with_nan_past_each_end(causal, seqused):
    """Packed batch (varlen, optionally seqused_q / seqused_k) whose rows outside every sequence
    (between the used rows and the next sequence, after the last) are NaN: the gradients of each
    sequence stay finite and within the 2x rule, rows outside every sequence get 0 (the model of
    zero_tail + the padded layout: backward_packed)."""
    d, h, hk, dtype = 64, 2, 1, torch.bfloat16
    lens_q, lens_k = [77, 130, 20], [90, 50, 200]
    used_q = [70, 130, 1] if seqused else lens_q
    used_k = [90, 33, 150] if seqused else lens_k
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32)
    tq, tk = int(cu_q[-1]) + 9, int(cu_k[-1]) + 5  # rows past cu_seqlens[-1] too
    q, k, v, dout = (t[0] for t in make_case(1, max(tq, tk), max(tq, tk), h, hk, d, dtype, seed=3))
    q, dout, k, v = q[:tq].clone(), dout[:tq].clone(), k[:tk].clone(), v[:tk].clone()
    out = torch.full_like(dout, float("nan"))
    lse = torch.full((h, tq), float("nan"))
    inside_q, inside_k = torch.zeros(tq, dtype=torch.bool), torch.zeros(tk, dtype=torch.bool)
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b]) + used_q[b])
        rk = slice(int(cu_k[b]), int(cu_k[b]) + used_k[b])
        inside_q[rq], inside_k[rk] = True, True
        o, l = forward(q[None, rq], k[None, rk], v[None, rk], causal)
        out[rq], lse[:, rq] = o[0], l[0]
    for t, inside in ((q, inside_q), (dout, inside_q), (k, inside_k), (v, inside_k)):
        t[~inside] = float("nan")
    su = dict(seqused_q=torch.tensor(used_q), seqused_k=torch.tensor(used_k)) if seqused else {}
    dq, dk, dv = B.backward_packed(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, **su)
    for g, inside in ((dq, inside_q), (dk, inside_k), (dv, inside_k)):
        assert torch.isfinite(g).all() and (g[~inside] == 0).all()
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b]) + used_q[b])
        rk = slice(int(cu_k[b]), int(cu_k[b]) + used_k[b])
        e = errors(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], causal,
                   (dq[None, rq], dk[None, rk], dv[None, rk]))
        for name, (err, pt) in e.items():
            assert err <= 2 * pt + GRAD_ATOL, f"sequence {b} {name}: err {err:.3e} > 2 x PyTorch {pt:.3e}"


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_packed_hd256_two_passes_with_nan_past_each_end(softcap):
    """hd256 packed (seqused_q / seqused_k, NaN outside every sequence) as the two passes compute it:
    pass dv's dv and pass dkdq's dq, dk (backward_packed per pass: each pass zeroes the rows past a
    sequence, pass dkdq its V / dO chunks too) are finite, 0 outside every sequence, and within the 2x
    rule per sequence, softcap or not."""
    d, h, hk, dtype = 256, 2, 1, torch.bfloat16
    lens_q, lens_k, used_q, used_k = [77, 150], [90, 140], [70, 150], [90, 101]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32)
    tq, tk = int(cu_q[-1]) + 3, int(cu_k[-1]) + 5
    q, k, v, dout = (t[0] for t in make_case(1, max(tq, tk), max(tq, tk), h, hk, d, dtype, seed=9, magnitude=2.0))
    q, dout, k, v = q[:tq].clone(), dout[:tq].clone(), k[:tk].clone(), v[:tk].clone()
    out, lse = torch.full_like(dout, float("nan")), torch.full((h, tq), float("nan"))
    inside_q, inside_k = torch.zeros(tq, dtype=torch.bool), torch.zeros(tk, dtype=torch.bool)
    seqs = [(slice(int(cu_q[b]), int(cu_q[b]) + used_q[b]), slice(int(cu_k[b]), int(cu_k[b]) + used_k[b]))
            for b in range(2)]
    for rq, rk in seqs:
        inside_q[rq], inside_k[rk] = True, True
        o, l = forward(q[None, rq], k[None, rk], v[None, rk], True, None, softcap)
        out[rq], lse[:, rq] = o[0], l[0]
    for t, inside in ((q, inside_q), (dout, inside_q), (k, inside_k), (v, inside_k)):
        t[~inside] = float("nan")
    su = dict(seqused_q=torch.tensor(used_q), seqused_k=torch.tensor(used_k), causal=True, softcap=softcap)
    dv = B.backward_packed(dout, q, k, v, out, lse, cu_q, cu_k, bwd_pass="dv", **su)[2]
    dq, dk, _ = B.backward_packed(dout, q, k, v, out, lse, cu_q, cu_k, bwd_pass="dkdq", **su)
    for g, inside in ((dq, inside_q), (dk, inside_k), (dv, inside_k)):
        assert torch.isfinite(g).all() and (g[~inside] == 0).all()
    for rq, rk in seqs:
        e = errors(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], True,
                   (dq[None, rq], dk[None, rk], dv[None, rk]), softcap=softcap)
        for name, (err, pt) in e.items():
            assert err <= 2 * pt + GRAD_ATOL, f"{name}: err {err:.3e} > 2 x PyTorch {pt:.3e}"
