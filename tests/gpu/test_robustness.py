"""Extreme inputs: three of issue 8's four inputs that broke flash4, each tested as the whole class
of fault it stands for (marker gpu via tests/conftest.py; skipped without CUDA).

1. Very negative rows in the backward. Every score of a row about -120, so every LSE < -88:
   the backward recomputes P = 2^(S*c - LSE*log2 e); a key position past seqlen_k inside the last
   key tile (TMA fills K with 0, so S = 0 there) gives 2^(+160) = inf unless it is masked, and
   inf * 0 = NaN spreads into dQ. Class: the padded keys of the last key tile, whatever the tile
   shape (every head dim: tile_n 128 and 64), causal or not, bf16 and fp16, MQA, deterministic.
   Gradients go into NaN-poisoned dq/dk/dv and are judged against the float64 reference with the
   suite's rule (tests/gpu/test_bwd.py): err <= 2 * err(PyTorch same dtype) + GRAD_ATOL. Issue
   8's own inputs put the -120 on k, which makes one coordinate of dq a cancellation the rule
   cannot judge (see the note above `very_negative_inputs`); the class is tested with it on q.
2. Huge magnitudes. Scores of 3e10..2e11 (q = k = v = 133120 in bf16, 60000 in fp16) and random
   inputs scaled by up to 3000: the exponent S*c - max*c must be exact at the max (an FMA against
   a rounded max*c is off by up to half its ulp, i.e. thousands, so exp2 gives 0 or inf), and the
   backward's P must not lose log(row sum) to the rounding of a huge LSE. Checked: exact out for
   the constant fills, finite LSE within float32 relative precision of the float64 reference,
   the random cases under the 2x rule against PyTorch's same-dtype result and against the float32
   reference (lse relative, since it is huge), with the default forward and with the non-default
   configs (always rescale, emulated exp2 at 25% / 50%), and the backward (through autograd, which
   keeps whatever the forward saves for it) finite and under the rule with a magnitude-aware atol.
3. Batch beyond CUDA's gridDim.y/z limit (65535): batch 65536 (and 65537), seqlen 32, one head.
   Forward and backward write every element (NaN-poisoned outputs checked in full) and match the
   float32 reference on batch indices at the start, around 32768 / 65535, and at the end.
(The fourth, double backward, is an autograd contract rather than an input class: test_double_backward.py.)
"""

import dataclasses
import math

import pytest
import torch

from flash4 import flash_attn_func
from flash4 import forward
from flash4.request import Request
from flash4.backward import flash_attn_backward
from flash4.config import BWD_SUPPORTED_HEADDIMS, select_fwd_config
from flash4.reference import LSE_ATOL, OUT_ATOL, attention_ref, causal_mask, fwd_errors, max_abs_err

from gpu_helpers import GRAD_ATOL, poisoned_fwd_buffers

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---- helpers of the sections below ----

def ref_grads(q, k, v, dout, scale, causal, upcast, compute_dtype=torch.float64):
    """dq, dk, dv of attention_ref: in compute_dtype (upcast) or in the input dtype (PyTorch same dtype)."""
    if upcast:
        leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    else:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, softmax_scale=scale, causal=causal, upcast=upcast, compute_dtype=compute_dtype)
    out.backward(dout.to(compute_dtype) if upcast else dout)
    return [t.grad for t in leaves]


def assert_grads_ok(grads, g_ref, g_pt, where, scale_aware=False, names=("dq", "dk", "dv")):
    """err <= 2 * pt_err + atol per gradient, errors as max |g - g_ref|; no NaN, no inf.

    scale_aware: atol = max(GRAD_ATOL, 1e-3 * max |g_ref|). GRAD_ATOL is an absolute floor tuned for
    gradients of order 1; with inputs scaled by 100s the gradients scale with them, and the fp32
    rounding the kernel is allowed (as is PyTorch's, in the 2x term) grows in proportion, so the
    floor must too: 1e-3 of the largest reference gradient, ~1/8 of a bf16 ulp there.
    """
    for name, g, gr, gp in zip(names, grads, g_ref, g_pt):
        assert not g.isnan().any(), f"{where}: {name} has NaN at {g.isnan().nonzero()[:4].tolist()}"
        assert torch.isfinite(g).all(), f"{where}: {name} has inf at {(~torch.isfinite(g)).nonzero()[:4].tolist()}"
        err = max_abs_err(g, gr)
        pt_err = max_abs_err(gp, gr)
        assert math.isfinite(pt_err), f"{where}: {name}: the case itself overflows PyTorch's same-dtype backward"
        atol = max(GRAD_ATOL, 1e-3 * gr.abs().max().item()) if scale_aware else GRAD_ATOL
        assert err <= 2 * pt_err + atol, f"{where}: {name}: err {err:.3e} > 2 * pt_err {pt_err:.3e} + {atol:.3e}"


# ---- 1. very negative rows in the backward ----

VERY_NEGATIVE_SCORE = -120.0  # every LSE below -88: exp(-LSE) overflows fp32
# Issue 8's shapes: key tail 64 of 128, 1.5 and 5.5 key tiles, seqlen_q 1 with a partial and a full tile.
ISSUE_SHAPES = ((64, 64), (192, 192), (704, 704), (1, 100), (1, 128))
HEADDIM_SHAPES = ((1, 100), (200, 300))
# Where the -120 comes from. Every score is offset_q * offset_k * scale along coordinate 0.
#   "k" (issue 8's reproducer): q[..., 0] = 1, k[..., 0] = -120 sqrt(d). Then dq[..., 0] =
#       -120 * sum_j dS_ij, whose exact value is 0: a cancellation in which FlashAttention's
#       D = rowsum(dO * O), taken from the *rounded* O by design, and dS rounded for the dQ MMA leave
#       errors of PyTorch's own size (a CPU model of the kernel's roundings: up to 13x PyTorch's
#       same-dtype error on single seeds), so the 2x rule cannot judge that one coordinate; it gets
#       a worst-case rounding bound instead (offset_allowance), the other coordinates the rule.
#   "q": q[..., 0] = -120 sqrt(d) * 8, k[..., 0] = 1/8 (both exact in bf16 / fp16). The same
#       scores and the same fault (a padded key has S = q . 0 = 0), but the cancelling sum is
#       scaled by 1/64 instead, so every coordinate of every gradient is judged by the rule (CPU
#       model over 6 seeds of every case here: at most 0.3 of the bound).
K_OFFSET_SMALL = 0.125


def very_negative_inputs(b, sq, sk, h, hk, d, dtype, offset_on="q", seed=0):
    """q, k ~ 0.1 randn except coordinate 0, which puts every score (scale 1/sqrt(d)) at
    -120 +- 0.01 (see offset_on above); v and dout ~ randn."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = 0.1 * torch.randn(b, sq, h, d, generator=gen, device="cuda")
    k = 0.1 * torch.randn(b, sk, hk, d, generator=gen, device="cuda")
    if offset_on == "k":
        q[..., 0] = 1.0
        k[..., 0] = VERY_NEGATIVE_SCORE * math.sqrt(d)
    else:
        q[..., 0] = VERY_NEGATIVE_SCORE * math.sqrt(d) / K_OFFSET_SMALL
        k[..., 0] = K_OFFSET_SMALL
    v = torch.randn(b, sk, hk, d, generator=gen, device="cuda")
    dout = torch.randn(b, sq, h, d, generator=gen, device="cuda")
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def offset_allowance(q, k, v, dout, scale, causal):
    """Worst-case rounding bound on dq[..., 0] when k[..., 0] carries the offset (nheads == nheads_k):
    |scale * k0| * eps * max over rows of (sum_d |dO| (|O| + sum_j P |v|) + sum_j |dS|): D from O
    rounded to the input dtype (O's own rounding, and P's in O = P V) and dS rounded to it, each at
    most half an ulp; eps is one ulp (2x headroom). Float64 throughout."""
    qd, kd, vd, dod = (t.double() for t in (q, k, v, dout))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    dp = torch.einsum("bqhd,bkhd->bhqk", dod, vd)
    ds = p * (dp - (dod * o).sum(-1).transpose(1, 2).unsqueeze(-1))
    o_bound = o.abs() + torch.einsum("bhqk,bkhd->bqhd", p, vd.abs())
    per_row = (dod.abs() * o_bound).sum(-1).transpose(1, 2) + ds.abs().sum(-1)
    return scale * kd[..., 0].abs().max().item() * torch.finfo(q.dtype).eps * per_row.max().item()


def check_very_negative(sq, sk, d, causal, dtype=torch.bfloat16, b=1, h=2, hk=2, deterministic=False,
                        offset_on="q"):
    q, k, v, dout = very_negative_inputs(b, sq, sk, h, hk, d, dtype, offset_on)
    scale = 1 / math.sqrt(d)
    where = (f"sq={sq} sk={sk} d={d} causal={causal} {DTYPE_NAMES[dtype]} h={h}/{hk} det={deterministic} "
             f"offset on {offset_on}")
    _, lse_ref = attention_ref(q, k, v, scale, causal, compute_dtype=torch.float64)
    assert lse_ref.max().item() < -88, f"{where}: construction: every LSE must be below -88, max {lse_ref.max()}"

    out, lse = poisoned_fwd_buffers(q)
    forward.run(Request.dense(q, k, v, scale, causal), out=out, lse=lse)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any(), f"{where}: forward NaN"
    errs = fwd_errors(q, k, v, out, lse, scale, causal)
    assert errs["ok"], (where, errs)

    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, dq=dq, dk=dk, dv=dv, deterministic=deterministic)
    torch.cuda.synchronize()
    g_ref = ref_grads(q, k, v, dout, scale, causal, upcast=True)
    g_pt = ref_grads(q, k, v, dout, scale, causal, upcast=False)
    if offset_on == "q":
        assert_grads_ok((dq, dk, dv), g_ref, g_pt, where)
        return
    # offset on k: every gradient finite, the rule on all but dq[..., 0], the rounding bound there.
    assert_grads_ok((dq[..., 1:], dk, dv), (g_ref[0][..., 1:], g_ref[1], g_ref[2]),
                    (g_pt[0][..., 1:], g_pt[1], g_pt[2]), where, names=("dq[..., 1:]", "dk", "dv"))
    assert torch.isfinite(dq).all(), f"{where}: dq not finite at {(~torch.isfinite(dq)).nonzero()[:4].tolist()}"
    err0, pt_err0 = max_abs_err(dq[..., 0], g_ref[0][..., 0]), max_abs_err(g_pt[0][..., 0], g_ref[0][..., 0])
    bound = 2 * pt_err0 + GRAD_ATOL + offset_allowance(q, k, v, dout, scale, causal)
    assert err0 <= bound, f"{where}: dq[..., 0] err {err0:.3e} > {bound:.3e} (2 * pt_err {pt_err0:.3e} + allowance)"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", ISSUE_SHAPES, ids=[f"{a}x{b}" for a, b in ISSUE_SHAPES])
def test_very_negative_rows_issue_reproducer(sq, sk, causal):
    """Issue 8's exact inputs (B 1, H 2, d 64, bf16, q[..., 0] = 1, k[..., 0] = -960)."""
    check_very_negative(sq, sk, 64, causal, offset_on="k")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", ISSUE_SHAPES, ids=[f"{a}x{b}" for a, b in ISSUE_SHAPES])
def test_very_negative_rows_issue_shapes(sq, sk, causal):
    check_very_negative(sq, sk, 64, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", HEADDIM_SHAPES, ids=[f"{a}x{b}" for a, b in HEADDIM_SHAPES])
@pytest.mark.parametrize("d", BWD_SUPPORTED_HEADDIMS)
def test_very_negative_rows_every_headdim(d, sq, sk, causal):
    """tile_n 128 (d <= 128) and 64 (split headdim), both with a partial last key tile."""
    check_very_negative(sq, sk, d, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", ((64, 64), (1, 100), (200, 300)), ids=["64x64", "1x100", "200x300"])
@pytest.mark.parametrize("d", [64, 128])
def test_very_negative_rows_fp16(d, sq, sk, causal):
    check_very_negative(sq, sk, d, causal, dtype=torch.float16)


@pytest.mark.parametrize("d", [64, 256])
def test_very_negative_rows_mqa_deterministic(d):
    """MQA (4 query heads on 1 key head: dK/dV sum over heads) and the deterministic dQ order."""
    check_very_negative(200, 300, d, False, h=4, hk=1, deterministic=True)


# ---- 2. huge magnitudes ----

FILL_BF16 = 133120.0  # 2^17 + 2^11: exact in bf16; q.k = 133120^2 * d exact in fp32
FILL_FP16 = 60000.0  # exact in fp16 (ulp 32 there)
# Forward configs: the shipped one, and the non-default softmax paths (same tiles).
VARIANTS = {
    "default": None,
    "always_rescale": dict(rescale_threshold=0.0),
    "emu_exp2_25": dict(exp2_emu_frac=0.25),
    "emu_exp2_50": dict(exp2_emu_frac=0.5),
}
# Relative precision asked of a huge LSE: float32's (2^-24 = 6e-8) with room for a few roundings.
LSE_REL = 1e-6
# Random huge inputs: q, k = a * randn. bf16 keeps any a; in fp16 the same-dtype PyTorch scores
# (the 2x rule's yardstick, computed with the scale folded into q) must stay below 65504:
# max |score| ~ 5 * a^2 * scale * sqrt(d) over these shapes, so a <= 60 at d <= 128, scale 1/8.
HUGE_RANDOM = [(torch.bfloat16, 30.0), (torch.bfloat16, 300.0), (torch.bfloat16, 3000.0),
               (torch.float16, 30.0), (torch.float16, 60.0)]
# A power of two, so folding it into q for the PyTorch yardstick is exact (1/sqrt(d) is not at d128).
HUGE_SCALE = 0.125


def run_fwd(q, k, v, scale, causal, variant):
    """Forward into NaN-filled out/lse: the API's path ("default") or the shipped config with the
    variant's fields replaced (compiled and run like tests/gpu/test_softmax_adversarial.py)."""
    out, lse = poisoned_fwd_buffers(q)
    changes = VARIANTS[variant]
    if changes is None:
        forward.run(Request.dense(q, k, v, scale, causal), out=out, lse=lse)
    else:
        from flash4.compile.cache import get_fwd_runner

        cfg = dataclasses.replace(select_fwd_config(q.shape[3], DTYPE_NAMES[q.dtype], causal), **changes)
        get_fwd_runner(cfg)(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    return out, lse


def assert_lse_relative(lse, lse_ref, where, rel=LSE_REL):
    assert not lse.isnan().any(), f"{where}: lse NaN at {lse.isnan().nonzero()[:5].tolist()}"
    assert torch.isfinite(lse).all(), f"{where}: lse not finite at {(~torch.isfinite(lse)).nonzero()[:5].tolist()}"
    ref = lse_ref.double()
    rel_err = ((lse.double() - ref).abs() / ref.abs()).max().item()
    assert rel_err <= rel, f"{where}: lse relative error {rel_err:.3e} > {rel:g}"


def check_constant_fill(shape, fill, dtype, causal, variant):
    q = torch.full(shape, fill, dtype=dtype, device="cuda")
    scale = 1 / math.sqrt(shape[3])
    where = f"fill {fill:g} {tuple(shape)} {DTYPE_NAMES[dtype]} causal={causal} {variant}"
    out, lse = run_fwd(q, q, q, scale, causal, variant)
    # Every visible key has the same score: P = 1 each, out = v exactly, LSE = score + log(#keys).
    bad = out != fill
    assert not bad.any(), f"{where}: out != {fill:g} at {bad.nonzero()[:5].tolist()}: {out[bad][:5].tolist()}"
    _, lse_ref = attention_ref(q, q, q, scale, causal, compute_dtype=torch.float64)
    assert_lse_relative(lse, lse_ref, where)
    return lse


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_fill_single_key(causal, variant):
    """q = k = v = 133120 (bf16), one query, one key, d 64: out 133120, LSE = 133120^2 * 64 / 8."""
    lse = check_constant_fill((1, 1, 1, 64), FILL_BF16, torch.bfloat16, causal, variant)
    expected = FILL_BF16**2 * 64 / 8 + math.log(1)
    rel = abs(lse.item() - expected) / expected
    assert rel <= LSE_REL, f"lse {lse.item()!r} vs {expected!r}: relative error {rel:.3e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_fill_bf16(causal, variant):
    """(1, 300, 2, 128) filled with 133120: scores ~2e11; causal rows see 1..300 keys."""
    check_constant_fill((1, 300, 2, 128), FILL_BF16, torch.bfloat16, causal, variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_fill_fp16(causal, variant):
    """(1, 200, 2, 64) filled with 60000 (fp16): scores ~3e10."""
    check_constant_fill((1, 200, 2, 64), FILL_FP16, torch.float16, causal, variant)


def huge_random_inputs(b, sq, sk, h, d, a, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = a * torch.randn(b, sq, h, d, generator=gen, device="cuda")
    k = a * torch.randn(b, sk, h, d, generator=gen, device="cuda")
    v = torch.randn(b, sk, h, d, generator=gen, device="cuda")
    dout = torch.randn(b, sq, h, d, generator=gen, device="cuda")
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def pytorch_same_dtype(q, k, v, scale, causal):
    """PyTorch's result in the input dtype with the scale folded into q (exact: a power of two), so
    fp16's unscaled q.k, which passes 65504 well before the scaled scores do, never overflows."""
    assert math.log2(scale).is_integer(), scale
    return attention_ref(q * scale, k, v, 1.0, causal, upcast=False)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype, a", HUGE_RANDOM, ids=[f"{DTYPE_NAMES[t]}-a{a:g}" for t, a in HUGE_RANDOM])
def test_huge_random_forward(dtype, a, d, causal, variant):
    """q, k = a * randn (scores up to ~4e7 at a = 3000), v = randn, (1, 257, 2, d), against the
    float64 reference, by two yardsticks:
      * PyTorch in the input dtype (the suite's rule): out err <= 2 * pt_err + OUT_ATOL, and for lse,
        huge here, its relative form err <= 2 * pt_err + 1e-6 * max |ref| + LSE_ATOL. At these
        magnitudes PyTorch's rounded scores often pick the wrong key (pt_err ~ |v|), so this
        rule alone would pass a row of garbage;
      * the float32 reference (scores in fp32, as the kernel's): out err <= 2 * err_fp32 + OUT_ATOL
        + eps * max |v|, the eps term for what the kernel rounds and the fp32 reference does not
        (P to the input dtype for the PV product, at most half an ulp of each weight, and out
        itself: together <= eps / 2 * max |v|); lse as above with err_fp32."""
    q, k, v, _ = huge_random_inputs(1, 257, 257, 2, d, a, dtype)
    where = f"{DTYPE_NAMES[dtype]} a={a:g} d={d} causal={causal} {variant}"
    out, lse = run_fwd(q, k, v, HUGE_SCALE, causal, variant)
    assert not out.isnan().any(), f"{where}: out NaN at {out.isnan().nonzero()[:5].tolist()}"
    assert torch.isfinite(out).all(), f"{where}: out not finite"
    assert torch.isfinite(lse).all(), f"{where}: lse not finite at {(~torch.isfinite(lse)).nonzero()[:5].tolist()}"
    out_ref, lse_ref = attention_ref(q, k, v, HUGE_SCALE, causal, compute_dtype=torch.float64)
    out_err, lse_err = max_abs_err(out, out_ref), max_abs_err(lse, lse_ref)
    lse_atol = LSE_REL * lse_ref.abs().max().item() + LSE_ATOL

    out_pt, lse_pt = pytorch_same_dtype(q, k, v, HUGE_SCALE, causal)
    out_pt_err, lse_pt_err = max_abs_err(out_pt, out_ref), max_abs_err(lse_pt, lse_ref)
    assert math.isfinite(out_pt_err) and math.isfinite(lse_pt_err), f"{where}: the case overflows PyTorch's {dtype}"
    assert out_err <= 2 * out_pt_err + OUT_ATOL, f"{where}: out err {out_err:.3e} > 2 * {out_pt_err:.3e} + {OUT_ATOL}"
    assert lse_err <= 2 * lse_pt_err + lse_atol, (
        f"{where}: lse err {lse_err:.3e} > 2 * {lse_pt_err:.3e} + {lse_atol:.3e}")

    out_32, lse_32 = attention_ref(q, k, v, HUGE_SCALE, causal)
    out_32_err, lse_32_err = max_abs_err(out_32, out_ref), max_abs_err(lse_32, lse_ref)
    out_atol = OUT_ATOL + torch.finfo(dtype).eps * v.abs().max().item()
    assert out_err <= 2 * out_32_err + out_atol, (
        f"{where}: out err {out_err:.3e} > 2 * fp32 err {out_32_err:.3e} + {out_atol:.3e}")
    assert lse_err <= 2 * lse_32_err + lse_atol, (
        f"{where}: lse err {lse_err:.3e} > 2 * fp32 err {lse_32_err:.3e} + {lse_atol:.3e}")


def autograd_grads(q, k, v, dout, scale, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, softmax_scale=scale, causal=causal)
    out.backward(dout)
    torch.cuda.synchronize()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_fill_backward(causal):
    """Backward of (1, 300, 2, 128) filled with 133120: P = 1 / (#visible keys) exactly, which an
    LSE rounded to fp32 at ~2e11 (ulp 16384 > log 300) cannot give; dq, dk ~ 0, dv = sum P dO."""
    shape = (1, 300, 2, 128)
    q = torch.full(shape, FILL_BF16, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda").to(q.dtype)
    scale = 1 / math.sqrt(shape[3])
    grads = autograd_grads(q, q, q, dout, scale, causal)
    g_ref = ref_grads(q, q, q, dout, scale, causal, upcast=True)
    g_pt = ref_grads(q, q, q, dout, scale, causal, upcast=False)
    assert_grads_ok(grads, g_ref, g_pt, f"fill {FILL_BF16:g} {shape} causal={causal}", scale_aware=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_huge_random_backward(d, causal):
    """q, k = 300 * randn in bf16 (scores ~1e5, LSE ~3e5 with an fp32 ulp of 1/32), through autograd."""
    q, k, v, dout = huge_random_inputs(1, 257, 257, 2, d, 300.0, torch.bfloat16)
    grads = autograd_grads(q, k, v, dout, HUGE_SCALE, causal)
    g_ref = ref_grads(q, k, v, dout, HUGE_SCALE, causal, upcast=True)
    g_pt = ref_grads(q, k, v, dout, HUGE_SCALE, causal, upcast=False)
    assert_grads_ok(grads, g_ref, g_pt, f"a=300 d={d} causal={causal}", scale_aware=True)


# ---- 3. batch beyond the grid's y/z limit ----

def batch_indices(batch):
    """Start, around 2^15 and the old gridDim.z limit 65535, the end."""
    picks = {0, 1, 2, 3, 32767, 32768, 65533, 65534, 65535, 65536} | set(range(batch - 4, batch))
    return sorted(i for i in picks if 0 <= i < batch)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", [65536, 65537])
def test_batch_beyond_grid_limit(batch, causal):
    """seqlen 32, 1 head, d 64, bf16 (q is 256 MiB): every output element written (NaN-poisoned,
    checked in full), sampled batch entries within the rule against the float32 reference, and
    flash_attn_func's autograd path bitwise equal to the direct calls."""
    s, h, d = 32, 1, 64
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q, k, v, dout = (torch.randn(batch, s, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    scale = 1 / math.sqrt(d)

    out, lse = poisoned_fwd_buffers(q)
    # The log2 LSE split the autograd path keeps for the backward (so the direct calls below
    # compute exactly what flash_attn_func's autograd path does).
    lse_split = torch.full((2,) + tuple(lse.shape), math.nan, device="cuda")
    forward.run(Request.dense(q, k, v, scale, causal), out=out, lse=lse, lse_split=lse_split)
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"out unwritten/NaN at batch {out.isnan().nonzero()[:5, 0].tolist()}"
    assert not lse.isnan().any(), f"lse unwritten/NaN at batch {lse.isnan().nonzero()[:5, 0].tolist()}"
    assert not lse_split.isnan().any(), f"lse_split unwritten/NaN at {lse_split.isnan().nonzero()[:5].tolist()}"

    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, dq=dq, dk=dk, dv=dv, lse_split=lse_split)
    torch.cuda.synchronize()
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not g.isnan().any(), f"{name} unwritten/NaN at batch {g.isnan().nonzero()[:5, 0].tolist()}"

    idx = torch.tensor(batch_indices(batch), device="cuda")
    qs, ks, vs, dos = (t[idx] for t in (q, k, v, dout))
    errs = fwd_errors(qs, ks, vs, out[idx], lse[idx], scale, causal)
    assert errs["ok"], errs
    g_ref = ref_grads(qs, ks, vs, dos, scale, causal, upcast=True, compute_dtype=torch.float32)
    g_pt = ref_grads(qs, ks, vs, dos, scale, causal, upcast=False)
    assert_grads_ok((dq[idx], dk[idx], dv[idx]), g_ref, g_pt, f"batch={batch} causal={causal}")

    # The public path runs the same kernels on the same inputs (the LSE split included): bitwise equal
    # (seqlen 32 is one key block, so each dq element gets a single contribution: no order to differ).
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out2 = flash_attn_func(*leaves, causal=causal)
    assert torch.equal(out2.detach(), out)
    out2.backward(dout)
    torch.cuda.synchronize()
    for name, leaf, g in zip(("dq", "dk", "dv"), leaves, (dq, dk, dv)):
        assert torch.equal(leaf.grad, g), f"autograd {name} differs from the direct call"
